"""Benchmark window arithmetic: what one status, metrics job or worker step costs the daemon.

    .venv/bin/python tests/bench/windows.py [--repeat 200] [--no-reference]

``agent.schedule`` answers is_open / next_opening / open_until / pull_allowed_at for a role's
windows. open_until used to build every cron match's span a day at a time and walk the joined
ones: for ``* * * * *`` lasting 1m (the demo's policy: always open) that was 400 days of
1,440 matches, 2.7 s of CPU per call, and the daemon asks every second. It now walks runs of
joined spans (agent/schedule.py, ``_chain_end``).

For each case this times, per call, the daemon's question (``status``: is_open, then
open_until with the 366-day horizon or next_opening, as agent/pull/node_pulls.py asks it),
open_until (400 days) and pull_allowed_at, against two peers measured in the same run:
one ``CronSpec.next_match`` (the unit of the old walk, and what is_open costs per window) and
the old walk itself (a reference copy of it below, run once per case; its answer is checked
against the new one). Absolute times are noise on a shared machine, so the table gives ratios:
new / next_match, and old / new. Target: every call under ``TARGET`` on this machine; exits
1 above it, or if an answer differs from the old walk's.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.policy.model import Window
from agent.schedule import (
    _dt,
    _spec,
    _zone,
    is_open,
    next_opening,
    open_until,
    pull_allowed_at,
)
from tests.schedule_reference import reference_open_until

TARGET = 100e-6                 # s per call, any window set (issue 21)
HORIZON = 400 * 86400.0         # open_until's default
STATUS_HORIZON = 366 * 86400.0  # agent/pull/node_pulls.py asks this far for status


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


W = Window
CASES: list[tuple[str, tuple[Window, ...], float]] = [
    ("demo: * * * * * 1m", (W("* * * * *", 60.0),), ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("*/5 * * * * 5m", (W("*/5 * * * *", 300.0),), ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("0 * * * * 61m", (W("0 * * * *", 3660.0),), ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("0 * * * * 61m Berlin (DST)", (W("0 * * * *", 3660.0, "Europe/Berlin"),),
     ts(2026, 6, 2, 12, 0, 30) + 0.5),
    ("* * * * * 1m New York (DST)", (W("* * * * *", 60.0, "America/New_York"),),
     ts(2026, 6, 2, 12, 0, 30) + 0.5),
    ("mixed zones, joined", (W("0 22 * * *", 8 * 3600.0, "Europe/Berlin"),
                             W("0 5 * * *", 16 * 3600.0, "UTC"),
                             W("*/30 * * * *", 1800.0, "Australia/Lord_Howe")),
     ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("two halves of the day", (W("0 0-11 * * *", 3600.0), W("0 12-23 * * *", 3600.0)),
     ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("never: 0 0 30 2 *", (W("0 0 30 2 *", 3600.0),), ts(2026, 12, 2, 12, 0, 30) + 0.5),
    ("0 22 * * mon-fri 8h, open", (W("0 22 * * mon-fri", 8 * 3600.0),),
     ts(2026, 12, 3, 1, 0, 30) + 0.5),
    ("0 22 * * mon-fri 8h, closed", (W("0 22 * * mon-fri", 8 * 3600.0),),
     ts(2026, 12, 3, 12, 0, 30) + 0.5),
    ("nights + weekend (example)", (W("0 22 * * mon-fri", 8 * 3600.0),
                                    W("0 0 * * sat", 48 * 3600.0)),
     ts(2026, 12, 4, 23, 0, 30) + 0.5),
    ("all but December, 1m", (W("* * * 1-11 *", 60.0),), ts(2026, 1, 2, 12, 0, 30) + 0.5),
]


def status(windows: tuple[Window, ...], now: float) -> float | None:
    """What the daemon's status asks every second (agent/pull/node_pulls.py, NodePulls.window)."""
    if is_open(windows, now):
        return open_until(windows, now, horizon=STATUS_HORIZON)
    return next_opening(windows, now)


def per_call(repeat: int, fn, *args) -> float:
    """Best of five rounds of ``repeat`` calls of ``fn(*args)``, seconds per call."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the old walk (seconds per always-open case)")
    args = ap.parse_args()
    failures: list[str] = []
    print(f"{'case':<30} {'status':>8} {'open_until':>10} {'pull_at':>8} {'next_match':>10} "
          f"{'worst/nm':>8} {'old walk':>9} {'old/new':>8}  answer")
    for label, windows, now in CASES:
        spec, zone = _spec(windows[0].cron), _zone(windows[0].tz)
        status(windows, now)                     # warm the per-window caches, as a daemon is
        n = args.repeat
        t_status = per_call(n, status, windows, now)
        t_until = per_call(n, open_until, windows, now)
        t_pull = per_call(n, pull_allowed_at, windows, now + 7 * 3600, 0.5, 1200.0)
        t_nm = per_call(n, spec.next_match, _dt(now), False, zone)
        worst = max(t_status, t_until, t_pull)
        new = open_until(windows, now)
        old_text, ratio, verdict = "-", "-", "ok"
        if not args.no_reference:
            t0 = time.perf_counter()
            old = min(reference_open_until(windows, now), now + HORIZON)
            t_old = time.perf_counter() - t0
            old_text, ratio = f"{t_old * 1e3:.1f}ms", f"{t_old / t_until:.0f}x"
            if old != new:
                verdict = f"DIFFERS: old {_dt(old)}, new {_dt(new)}"
                failures.append(f"{label}: answer differs")
        if worst > TARGET:
            verdict += f"; {worst * 1e6:.0f}us > {TARGET * 1e6:.0f}us"
            failures.append(f"{label}: {worst * 1e6:.0f}us per call")
        closes = "open to horizon" if new >= now + HORIZON else (
            "closed" if new == now else f"closes {_dt(new):%Y-%m-%d %H:%M}")
        print(f"{label:<30} {t_status * 1e6:>6.1f}us {t_until * 1e6:>8.1f}us "
              f"{t_pull * 1e6:>6.1f}us {t_nm * 1e6:>8.1f}us {worst / t_nm:>7.1f}x "
              f"{old_text:>9} {ratio:>8}  {closes}; {verdict}")
    if failures:
        print("FAILED:", ", ".join(failures))
        return 1
    print(f"ok: every call under {TARGET * 1e6:.0f}us, answers as the old walk's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
