"""Periodic bursts, anticipated: a training step's all-reduce comes back at a steady period, so
the pull can stop just before the next one instead of a detection after its start. Pure: times
in, a wait out.

What a cut can't take back (``agent.yielding.sockets``: what the windows granted) and what the
detector lets through before its bucket is full (64 KiB) both arrive after a burst's first byte
at the bottleneck: at 1 Gbit/s about 120 kB with the windows' bound for unannounced bursts, 2%
of a 6 MB burst (250 kB, 4%, with a 128 KiB bucket and the looser bound). Held ``lead`` before
the burst is due, the pull has nothing in flight when it comes, and the windows may hold the
looser bound again (``sockets.most_in_flight``).

The rule: the cuts' starts (``BurstState.cut_start_ns``, one per burst) are kept; when the last
``KEEP`` came at a steady period (each gap within ``JITTER`` of their median, between
``MIN_PERIOD`` and ``MAX_PERIOD``), the next start is due a period after the last, and the
readers wait from ``lead`` before it until ``grace`` after it: by then the detector's own cut
holds them (a burst came), or none came and they read again (undone). Only ``AHEAD`` periods are
anticipated past the last real start: bursts that stopped (training ended, a step that waits on
I/O) cost at most that many leads. What it costs while bursts keep coming: about
``lead / period`` of the gaps (3 ms of 120 ms at 1 Gbit/s).

>>> r = Rhythm(lead_ns=3_000_000, grace_ns=2_000_000)
>>> for k in range(1, 6):
...     r.see(k * 120_000_000)                      # a start every 120 ms, the last at 600
>>> r.period_ns()
120000000
>>> r.wait_ns(720_000_000 - 4_000_000), r.wait_ns(720_000_000 - 2_000_000)
(0, 4000000)
>>> r.wait_ns(720_000_000 + 3_000_000)              # none came: the readers read again
0
"""

from __future__ import annotations

import statistics
from collections import deque

KEEP = 5                       # starts that make a rhythm (four gaps)
JITTER = 0.1                   # each gap within 10% of the median gap
MIN_PERIOD = 5_000_000         # ns: faster than this is one burst to the detector
MAX_PERIOD = 10_000_000_000    # ns: slower than this is not a step anyone waits on
AHEAD = 2                      # periods anticipated past the last start seen


class Rhythm:
    """The starts seen and the wait they imply; ``lead_ns``/``grace_ns`` around each due start
    (plus the gaps' own spread)."""

    def __init__(self, lead_ns: int, grace_ns: int) -> None:
        self.lead_ns = lead_ns
        self.grace_ns = grace_ns
        self.starts: deque[int] = deque(maxlen=KEEP)
        self.anticipated = 0             # due starts the readers were held for
        self._due = 0                    # the last one counted
        self._windows: list[tuple[int, int, int]] | None = None   # until the next start

    def see(self, start_ns: int) -> None:
        """A cut's start (seen again and again while it lasts: counted once)."""
        if start_ns <= 0 or (self.starts and start_ns <= self.starts[-1]):
            return
        self.starts.append(start_ns)
        self._windows = None

    def period_ns(self) -> int | None:
        """The steady period of the last starts; None: no rhythm."""
        if len(self.starts) < KEEP:
            return None
        s = list(self.starts)
        gaps = [b - a for a, b in zip(s, s[1:], strict=False)]
        period = int(statistics.median(gaps))
        if not MIN_PERIOD <= period <= MAX_PERIOD:
            return None
        if max(abs(g - period) for g in gaps) > JITTER * period:
            return None
        return period

    def windows(self) -> list[tuple[int, int, int]]:
        """(from, due, until) of each start anticipated, in ns; empty: no rhythm. Worked out
        once per start: the readers ask before every read."""
        if self._windows is not None:
            return self._windows
        period = self.period_ns()
        if period is None:
            self._windows = []
            return self._windows
        s = list(self.starts)
        spread = max(abs((b - a) - period) for a, b in zip(s, s[1:], strict=False))
        lead, grace = self.lead_ns + spread, self.grace_ns + spread
        self._windows = [(s[-1] + k * period - lead, s[-1] + k * period,
                          s[-1] + k * period + grace) for k in range(1, AHEAD + 1)]
        return self._windows

    def wait_ns(self, now_ns: int) -> int:
        """How long a reader waits now for a burst that is due (0: none due)."""
        for start, due, until in self.windows():
            if start <= now_ns < until:
                if due != self._due:
                    self._due = due
                    self.anticipated += 1
                return until - now_ns
        return 0
