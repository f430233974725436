"""The schedule: waves in order, uniform per-node offsets, stable slots, windows, late learners."""

from __future__ import annotations

import math
from datetime import UTC, datetime

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
