"""Benchmark: what a 50-100 ms tick costs on APScheduler against a plain thread, same run.

The daemon's timing is on APScheduler (agent/scheduler.py); the backoff loop's tick stays on a
thread of its own. This measures why: CPU seconds per second of an empty job run every ``tick``
by a BackgroundScheduler interval job, beside a thread that waits on an Event with the same
period, and how late each run is (APScheduler wakes on its own schedule computations).

    python tests/bench/scheduler_tick.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.scheduler import Scheduler  # noqa: E402


def measure(run: str, tick: float, seconds: float) -> tuple[float, float]:
    """(CPU seconds per second, p99 lateness in ms) of an empty job every ``tick``."""
    late: list[float] = []
    start = time.monotonic()

    def job() -> None:
        now = time.monotonic()
        expected = start + round((now - start) / tick) * tick
        late.append(max(0.0, now - expected))

    cpu0 = time.process_time()
    if run == "apscheduler":
        s = Scheduler()
        s.start()
        s.every(tick, job, job_id="tick")
        time.sleep(seconds)
        s.shutdown(wait=True)
    else:
        stop = threading.Event()

        def loop() -> None:
            n = 1
            while not stop.wait(max(0.0, start + n * tick - time.monotonic())):
                job()
                n += 1

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        time.sleep(seconds)
        stop.set()
        t.join()
    cpu = time.process_time() - cpu0
    p99 = statistics.quantiles(late, n=100)[98] * 1000 if len(late) > 2 else 0.0
    return cpu / seconds, p99


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    print(f"empty job, {args.seconds:g} s each; CPU s per s (= share of one core), p99 lateness")
    print(f"{'tick':>6} {'runner':<12} {'CPU %':>7} {'p99 late ms':>12}")
    for tick in (0.1, 0.05):
        rows = {r: measure(r, tick, args.seconds) for r in ("thread", "apscheduler")}
        for runner, (cpu, p99) in rows.items():
            print(f"{tick * 1000:5.0f}ms {runner:<12} {cpu * 100:6.2f}% {p99:11.2f}")
        ratio = rows["apscheduler"][0] / rows["thread"][0] if rows["thread"][0] else float("inf")
        print(f"       apscheduler / thread CPU: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
