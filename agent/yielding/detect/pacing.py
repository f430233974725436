"""Expensive detectors run as often as their own CPU cost allows, not every tick.

A sock_diag dump walks the kernel's whole TCP established hash (all namespaces' buckets), so its
cost grows with the host's memory, not with its connections: about 1 ms per address family on
the 2-core, 24 GB bench VM, more on a node with a terabyte. Scanning every process's maps for
libnccl grows with the processes. Each is given a share of one core; after every run the next
one waits ``cost / share`` (within ``least`` and ``most`` seconds), and its last readings stand
in between. The cost is the thread's CPU time (``time.thread_time``), measured, not assumed.

>>> p = Pacer(share=0.005, least=0.1, most=2.0)
>>> p.due(0.0), p.ran(0.0, cost=0.002), p.due(0.3), p.due(0.4)
(True, 0.4, False, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pacer:
    share: float              # of one core
    least: float              # seconds between runs, at the least (the tick)
    most: float               # and at the most (how stale a reading may get)
    next_at: float | None = None
    cost: float | None = field(default=None)   # smoothed CPU seconds per run

    def due(self, now: float) -> bool:
        return self.next_at is None or now >= self.next_at - 1e-9

    def ran(self, now: float, cost: float) -> float:
        """Record a run's cost; returns when the next one is due."""
        self.cost = cost if self.cost is None else 0.7 * self.cost + 0.3 * cost
        self.next_at = now + min(self.most, max(self.least, self.cost / self.share))
        return self.next_at


class Paced:
    """``sample(now)`` of a detector, run when its pacer says so; in between, its last result,
    or, while that found something, ``between(now)``: a cheap look at whether what it found is
    still there (an ended training connection must not hold the pull back until the next full
    scan: seconds, measured)."""

    def __init__(self, sample: Callable[[float], Any], pacer: Pacer,
                 cpu: Callable[[], float] = time.thread_time,
                 between: Callable[[float], Any] | None = None) -> None:
        self._sample = sample
        self.pacer = pacer
        self._cpu = cpu
        self._between = between
        self._last: Any = ()

    def __call__(self, now: float) -> Any:
        if self.pacer.due(now):
            started = self._cpu()
            self._last = self._sample(now)
            self.pacer.ran(now, self._cpu() - started)
        elif self._last and self._between is not None:
            self._last = self._between(now)
        return self._last
