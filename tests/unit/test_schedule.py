"""The schedule: waves in order, uniform per-node offsets, stable slots, windows, late learners."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import pytest

from agent.policy import parse_policy
from agent.policy.model import Policy, Role, Waves, Window
from agent.schedule import (
    cache_spread,
    is_open,
    next_opening,
    offset_fraction,
    open_until,
    pull_allowed_at,
    slot,
    start_at,
    wave_index,
    windows_for,
)
from tests.schedule_reference import reference_open_until

POLICY = parse_policy("""\
version: 1
roles:
  cache: {hosts: [cache-*]}
  inference: {hosts: [inf-*]}
  evaluation: {hosts: [eval-*]}
  training:
    hosts: [gpu-*]
    windows:
      - {cron: "0 22 * * mon-fri", duration: 8h}
      - {cron: "0 0 * * sat", duration: 48h}
waves: {gap: 30m, spread: 20m, cache_lead: 10m}
""")
TRAINING = POLICY.role("training").windows


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


PUBLISHED = ts(2026, 12, 2, 12, 0)   # a Wednesday, noon UTC


def test_slot_is_the_formula():
    frac = offset_fraction("node-1", "evaluation", "llama", "v2")
    assert 0 <= frac < 1
    expected = PUBLISHED + 600 + 1 * 1800 + frac * 1200
    assert slot(PUBLISHED, "node-1", "evaluation", "llama", "v2", POLICY) == expected


def test_waves_in_order():
    nodes = [f"n{i}" for i in range(300)]
    spans = {}
    for role in ("cache", "inference", "evaluation", "training"):
        slots = [slot(PUBLISHED, n, role, "m", "v1", POLICY) for n in nodes]
        spans[role] = (min(slots), max(slots))
    assert spans["cache"][1] < spans["inference"][0] - 0       # caches before wave 0
    assert spans["cache"][1] <= PUBLISHED + cache_spread(POLICY) <= PUBLISHED + 300
    assert spans["inference"][1] < spans["evaluation"][0]     # spread (20m) < gap (30m)
    assert spans["evaluation"][1] < spans["training"][0]
    assert [wave_index(POLICY, r) for r in ("cache", "inference", "evaluation", "training",
                                            "unlisted")] == [None, 0, 1, 2, 3]


def test_offsets_uniform_over_10k_nodes():
    n = 10_000
    fracs = sorted(offset_fraction(f"node-{i:05d}", "training", "llama", "v7") for i in range(n))
    # Kolmogorov-Smirnov against U(0, 1): critical D at alpha = 0.001 is 1.95 / sqrt(n).
    d = max(max((i + 1) / n - f, f - i / n) for i, f in enumerate(fracs))
    assert d < 1.95 / math.sqrt(n)
    # chi-square over 20 bins, 19 degrees of freedom: 43.82 at alpha = 0.001
    bins = [0] * 20
    for f in fracs:
        bins[int(f * 20)] += 1
    chi2 = sum((b - n / 20) ** 2 / (n / 20) for b in bins)
    assert chi2 < 43.82


def test_same_slot_after_restart_different_for_another_version():
    a = slot(PUBLISHED, "5f2c0a", "training", "llama", "v2", POLICY)
    again = slot(PUBLISHED, "5f2c0a", "training", "llama", "v2", parse_policy(
        "version: 1\nroles: {inference: {hosts: [i*]}, evaluation: {hosts: [e*]}}\n"
        "waves: {gap: 30m, spread: 20m, cache_lead: 10m}\n"))
    assert a == again                                  # nothing but the inputs: no state
    assert a != slot(PUBLISHED, "5f2c0a", "training", "llama", "v3", POLICY)
    assert a != slot(PUBLISHED, "5f2c0a", "training", "qwen", "v2", POLICY)
    assert a != slot(PUBLISHED, "77d1e9", "training", "llama", "v2", POLICY)


def test_late_learned_version_starts_at_once():
    node, role = "n1", "inference"
    s = slot(PUBLISHED, node, role, "m", "v1", POLICY)
    assert start_at(PUBLISHED, PUBLISHED, node, role, "m", "v1", POLICY) == s
    learned = s + 3 * 3600                      # the node was down, or polled late
    assert start_at(PUBLISHED, learned, node, role, "m", "v1", POLICY) == learned


def test_window_across_midnight():
    ws = (Window("0 22 * * *", 8 * 3600),)
    assert not is_open(ws, ts(2026, 12, 2, 21, 59))
    assert is_open(ws, ts(2026, 12, 2, 22, 0))
    assert is_open(ws, ts(2026, 12, 3, 0, 30))           # after midnight
    assert is_open(ws, ts(2026, 12, 3, 5, 59, 59))
    assert not is_open(ws, ts(2026, 12, 3, 6, 0))
    assert open_until(ws, ts(2026, 12, 3, 1, 0)) == ts(2026, 12, 3, 6, 0)
    assert next_opening(ws, ts(2026, 12, 3, 6, 0)) == ts(2026, 12, 3, 22, 0)
    assert next_opening(ws, ts(2026, 12, 3, 1, 0)) == ts(2026, 12, 3, 1, 0)


def test_named_weekdays_and_weekend():
    # Friday 23:00 is in the weeknight window, which runs into the weekend one: open till Monday.
    assert is_open(TRAINING, ts(2026, 12, 4, 23, 0))
    assert open_until(TRAINING, ts(2026, 12, 4, 23, 0)) == ts(2026, 12, 7, 0, 0)
    assert is_open(TRAINING, ts(2026, 12, 6, 15, 0))                   # Sunday afternoon
    assert not is_open(TRAINING, ts(2026, 12, 7, 12, 0))               # Monday noon
    assert next_opening(TRAINING, ts(2026, 12, 7, 12, 0)) == ts(2026, 12, 7, 22, 0)
    # Sunday night 22:00 is no weekday window (mon-fri), but the weekend one still runs.
    assert is_open(TRAINING, ts(2026, 12, 6, 22, 30))


def test_training_waits_for_its_window_spread_over_the_fleet():
    # Published Wednesday noon: the training wave's slots (13:10-13:30) are in the day, so
    # starts move to 22:00 plus each node's share of the spread (not all on the same second).
    starts = [start_at(PUBLISHED, PUBLISHED, f"gpu-{i}", "training", "m", "v1", POLICY)
              for i in range(200)]
    assert all(ts(2026, 12, 2, 22, 0) <= s < ts(2026, 12, 2, 22, 20) for s in starts)
    assert len(set(starts)) == 200
    assert all(is_open(TRAINING, s) for s in starts)


def test_pull_allowed_at():
    assert pull_allowed_at((), 123.0) == 123.0
    assert pull_allowed_at(TRAINING, ts(2026, 12, 3, 1, 0)) == ts(2026, 12, 3, 1, 0)
    assert pull_allowed_at(TRAINING, ts(2026, 12, 3, 7, 0)) == ts(2026, 12, 3, 22, 0)
    assert pull_allowed_at(TRAINING, ts(2026, 12, 3, 7, 0), frac=0.5, spread=3600) == \
        ts(2026, 12, 3, 22, 30)
    never = (Window("0 0 30 2 *", 3600),)
    assert pull_allowed_at(never, PUBLISHED) is None


def test_no_windows_is_always_open():
    assert is_open((), PUBLISHED) and next_opening((), PUBLISHED) == PUBLISHED


def test_window_values_for_status():
    now = PUBLISHED + 60
    windows = windows_for(POLICY, "training")
    assert not is_open(windows, now) and next_opening(windows, now) == ts(2026, 12, 2, 22, 0)
    assert start_at(PUBLISHED, PUBLISHED, "gpu-7", "training", "m", "v1", POLICY) \
        >= ts(2026, 12, 2, 22, 0)
    night = ts(2026, 12, 3, 1, 0)
    assert is_open(windows, night) and open_until(windows, night) == ts(2026, 12, 3, 6, 0)


def test_cache_spread_stays_inside_the_lead():
    p = Policy(roles=(Role("cache"),), waves=Waves(spread=1200, cache_lead=30))
    assert cache_spread(p) == 15
    assert cache_spread(Policy()) == 60


def test_a_policy_without_roles_waits_for_no_wave_it_has_no_nodes_for():
    minimal = parse_policy("version: 1\nwaves: {gap: 30m, spread: 20m}\n")
    assert wave_index(minimal, "training") == 0
    frac = offset_fraction("n", "training", "llama", "v2")
    assert slot(PUBLISHED, "n", "training", "llama", "v2", minimal) == PUBLISHED + frac * 1200
    assert wave_index(POLICY, "training") == 2


BERLIN = parse_policy("""\
version: 1
timezone: Europe/Berlin
roles:
  training:
    hosts: [gpu-*]
    windows:
      - {cron: "0 22 * * *", duration: 8h}
""")


def test_windows_are_read_on_the_policys_time_zone():
    w = BERLIN.role("training").windows
    assert w[0].tz == "Europe/Berlin"
    assert is_open(w, ts(2026, 12, 2, 21, 30))          # 22:30 in Berlin (CET)
    assert not is_open(w, ts(2026, 12, 2, 20, 30))
    assert is_open(w, ts(2026, 7, 2, 20, 30))           # 22:30 in Berlin (CEST)
    assert next_opening(w, ts(2026, 12, 2, 12, 0)) == ts(2026, 12, 2, 21, 0)


def test_a_window_on_a_daylight_saving_change():
    # 29 March 2026 at 02:00 CET the clocks jump to 03:00: the 8 h window that opened at 22:00
    # CET the evening before still lasts 8 hours (it closes at 07:00 CEST, 05:00 UTC).
    w = BERLIN.role("training").windows
    opened = next_opening(w, ts(2026, 3, 28, 12, 0))
    assert opened == ts(2026, 3, 28, 21, 0)
    assert open_until(w, ts(2026, 3, 29, 1, 0)) == ts(2026, 3, 29, 5, 0)
    # 25 October: 22:00 CET is 21:00 UTC again, the day the clocks went back.
    assert next_opening(w, ts(2026, 10, 25, 12, 0)) == ts(2026, 10, 25, 21, 0)


def test_an_unknown_time_zone_is_a_file_line_error():
    import pytest as _pytest

    from agent.policy import PolicyError
    with _pytest.raises(PolicyError) as e:
        parse_policy("version: 1\nroles: {}\ntimezone: Mars/Olympus_Mons\n", "p.yaml")
    assert "p.yaml:3: timezone 'Mars/Olympus_Mons'" in str(e.value)


# -- window arithmetic against the span-by-span reference -----------------------------------
# open_until walks runs of joined windows (agent/schedule.py, _chain_end); the reference
# (tests/schedule_reference.py) is the walk it replaced, exact and slow: it runs on short
# horizons, or from a time just before where a long chain ends.

FIELDS = (["*", "0", "*/5", "*/15", "0,30", "10-50/20", "59", "*/7", "0-29"],
          ["*", "0", "22", "*/2", "1-23/2", "2", "3", "0-11", "12-23", "8-18", "*/6", "2,3"],
          ["*", "*", "*", "1-15", "1", "*/2", "28-31", "29"],
          ["*", "*", "*", "1-11", "3,10", "2", "*/3"],
          ["*", "*", "*", "mon-fri", "sat,sun", "sat", "0", "1-5/2"])
ZONES = ["UTC", "UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]
LENGTHS = [60, 300, 600, 3600, 3660, 7200, 8 * 3600, 86400, 90000, 2 * 86400, 4 * 86400, 30]
# daylight-saving changes of those zones in 2026, UTC: nows are drawn around them too
CHANGES = [ts(2026, 3, 29, 1), ts(2026, 10, 25, 1), ts(2026, 3, 8, 7), ts(2026, 11, 1, 6),
           ts(2026, 4, 4, 15), ts(2026, 10, 3, 15, 30)]


def random_case(rng):
    same = rng.choice(ZONES) if rng.random() < 0.8 else None    # a policy has one zone
    windows = tuple(
        Window(" ".join(rng.choice(f) for f in FIELDS),
               float(rng.choice(LENGTHS) if rng.random() < 0.8 else rng.randint(1, 3 * 86400)),
               same or rng.choice(ZONES))
        for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.4:
        now = rng.choice(CHANGES) + rng.uniform(-3 * 86400, 3 * 86400)
    else:
        now = ts(2026, 1, 1) + rng.uniform(0, 400 * 86400)
    if rng.random() < 0.5:
        now = 60.0 * round(now / 60)                  # on a minute: spans that just touch
    return windows, now, rng.choice([3600.0, 86400.0, 5 * 86400.0])


def test_open_until_matches_the_span_by_span_reference_on_random_windows():
    for seed in range(250):
        windows, now, horizon = random_case(random.Random(seed))
        want = min(reference_open_until(windows, now, horizon), now + horizon)
        assert open_until(windows, now, horizon) == want, (seed, windows, now, horizon)


def test_pull_allowed_at_matches_the_reference_on_random_windows():
    for seed in range(1000, 1100):
        rng = random.Random(seed)
        windows, now, _ = random_case(rng)
        frac = rng.random()
        opening = next_opening(windows, now)
        if opening is None or opening == now:
            want = opening
        else:
            # a horizon of 5 days is as good as 400 here: the spread (20 min) is shorter
            length = min(reference_open_until(windows, opening, 5 * 86400.0),
                         opening + 5 * 86400.0) - opening
            want = opening + frac * min(1200.0, length)
        assert pull_allowed_at(windows, now, frac, 1200.0) == want, (seed, windows, now)


ALWAYS = [(Window("* * * * *", 60.0),), (Window("*/5 * * * *", 300.0),),
          (Window("0 * * * *", 3660.0),),
          (Window("0 0-11 * * *", 3600.0), Window("0 12-23 * * *", 3600.0)),   # jointly
          (Window("0 0 * * *", 86400.0),),
          (Window("0 0 * * mon-fri", 3 * 86400.0),)]                          # over weekends


@pytest.mark.parametrize("windows", ALWAYS, ids=lambda ws: " + ".join(
    f"{w.cron} {w.duration:.0f}s" for w in ws))
def test_windows_that_join_up_for_ever_are_open_to_the_horizon(windows):
    now = ts(2026, 12, 2, 12, 0, 30)
    assert is_open(windows, now)
    assert open_until(windows, now) == now + 400 * 86400
    assert open_until(windows, now, horizon=366 * 86400) == now + 366 * 86400
    assert pull_allowed_at(windows, now) == now
    # the same from the reference, over a horizon it can afford
    assert reference_open_until(windows, now, 3 * 86400) == open_until(windows, now, 3 * 86400)


@pytest.mark.parametrize("windows,now,near,closes", [
    # every minute in Berlin: the hour repeated in autumn isn't matched twice, so the last
    # match is 02:59 CEST (00:59 UTC) and the next 03:00 CET (02:00 UTC): closed for an hour
    ((Window("* * * * *", 60.0, "Europe/Berlin"),), ts(2026, 6, 1, 12), ts(2026, 10, 24, 12),
     ts(2026, 10, 25, 1, 0)),
    ((Window("0 * * * *", 3660.0, "Europe/Berlin"),), ts(2026, 6, 1, 12), ts(2026, 10, 24, 12),
     ts(2026, 10, 25, 1, 1)),
    # a night window in Berlin joined to a day window in UTC: one chain all winter, broken
    # when Berlin's night moves an hour earlier in spring (20:00-04:00 UTC, then 05:00-21:00)
    ((Window("0 22 * * *", 8 * 3600.0, "Europe/Berlin"), Window("0 5 * * *", 16 * 3600.0)),
     ts(2026, 11, 2, 12), ts(2027, 3, 27, 12), ts(2027, 3, 29, 4, 0)),
    # all weekdays but not in December: the chain runs to the last day of November
    ((Window("* * * 1-11 *", 60.0),), ts(2026, 1, 1, 1), ts(2026, 11, 29), ts(2026, 12, 1)),
])
def test_long_chains_end_where_the_reference_says(windows, now, near, closes):
    assert reference_open_until(windows, near) == closes       # cheap from just before
    assert open_until(windows, now) == closes                  # the whole chain, at once
    assert open_until(windows, near) == closes


def test_windows_that_never_open_cost_no_search():
    never = (Window("0 0 30 2 *", 3600.0), Window("0 0 31 apr *", 60.0))
    now = ts(2026, 12, 2, 12)
    assert not is_open(never, now) and next_opening(never, now) is None
    assert open_until(never, now) == now and pull_allowed_at(never, now) is None
    mixed = never + (Window("0 22 * * mon-fri", 8 * 3600.0),)
    assert open_until(mixed, ts(2026, 12, 3, 1)) == ts(2026, 12, 3, 6)


def test_window_arithmetic_takes_runs_not_cron_steps(monkeypatch):
    """What the daemon asks every second (status) and every worker step, counted in cron
    steps, not timed: the old walk made 576,000 of them for "* * * * *" 1m."""
    from agent.cron import CronSpec
    calls = []
    real = CronSpec.next_match
    monkeypatch.setattr(CronSpec, "next_match", lambda self, *a, **k: (
        calls.append(self.text), real(self, *a, **k))[1])
    now = ts(2026, 12, 2, 12, 0, 30)
    for windows in ALWAYS + [TRAINING, (Window("* * * * *", 60.0, "Europe/Berlin"),)]:
        calls.clear()
        if is_open(windows, now):
            open_until(windows, now, horizon=366 * 86400)
        else:
            next_opening(windows, now)
        pull_allowed_at(windows, now + 7 * 3600, 0.5, 1200.0)
        assert len(calls) <= 6 * len(windows), (windows, len(calls))


def test_a_slot_past_what_a_calendar_holds_never_comes():
    """A publisher's `--published 9999-12-31T23:59:59Z` plus a wave's delay is after year 9999:
    the windows can't be read there; the start is None (never), not a ValueError."""
    from agent import schedule
    far = 253402300799.0
    windowed = Policy(roles=(Role("training", hosts=("*",), windows=(
        Window("0 22 * * *", 3600.0),)),))
    for policy in (Policy(), windowed):
        assert schedule.start_at(far, 0.0, "n", "training", "m", "v", policy) is None
    assert schedule.start_at(1e9, 1e9, "n", "training", "m", "v", Policy()) is not None


def test_windows_that_join_are_open_at_the_instant_one_ends_and_the_next_begins():
    """`* * * * *` 1m at 18:00:00 exactly: the 17:59 window closes as the 18:00 one opens, so
    pulls may run (a publication time is often a whole minute: `wagent plan` starts there)."""
    w = (Window("* * * * *", 60.0),)
    t = datetime(2026, 12, 2, 18, 0, tzinfo=UTC).timestamp()
    assert is_open(w, t) and next_opening(w, t) == t
    two = (Window("0 22 * * *", 3600.0), Window("0 23 * * *", 3600.0))
    t = datetime(2026, 12, 2, 23, 0, tzinfo=UTC).timestamp()
    assert is_open(two, t)
    assert not is_open((Window("0 22 * * *", 3600.0),), t)      # alone, it closed at 23:00
