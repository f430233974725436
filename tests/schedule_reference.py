"""The walk ``agent.schedule.open_until`` replaced, kept as the reference its tests and its bench
(tests/bench/windows.py) compare against: every match's span built by cron's next_match
(``Spans.build``), a day at a time, merged and walked. Exact and slow (2.7 s for "* * * * *" 1m
over 400 days), so tests run it on short horizons, or from just before where a chain ends."""

from __future__ import annotations

from collections.abc import Iterable

from agent.policy.model import Window
from agent.schedule import Spans


def reference_open_until(windows: Iterable[Window], now: float,
                         horizon: float = 400 * 86400.0) -> float:
    windows = tuple(windows)
    if not windows:
        return now + horizon
    end, step = now, max(max(w.duration for w in windows) * 2, 86400.0)
    while end < now + horizon:
        span = Spans.build(windows, end, end + step).span_at(end)
        if span is None:
            return end
        if span[1] < end + step:
            return span[1]
        end = span[1] if span[1] > end else end + step
    # (it could return a chain's end a little past now + horizon: the documented contract, and
    # the new code, say now + horizon; the comparisons clip it)
    return now + horizon
