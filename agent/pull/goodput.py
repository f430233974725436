"""A floor on one request's goodput, so that a trickling source can't hold a stream forever.

The read timeout bounds each read, so a server (or a broken middlebox) that sends a few bytes
just inside every timeout would hold a stream for ever. A ``Meter`` watches one request's body:
it counts only the time the stream spends blocked reading the network (its "server time"), never
the time it waits for the shared token bucket nor the time it spends writing and hashing, so a
stream held to a low rate by the bucket is never taken for a slow source.

Reads complete in chunks, and bytes inside a read still in flight can't be seen; so the judgement
is an upper bound: the bytes of the reads that completed in the span averaged over, plus the whole
size of the read in flight. A source is abandoned only when even that bound stays under the
floor; reads are capped (``Floor.max_read``) at half the floor's bytes per span so that the bound
can fall under it.

>>> t = [0.0]
>>> m = Meter(Floor(min_rate=1000, average_over=10, grace=10), clock=lambda: t[0])
>>> m.begin(100); t[0] = 11.0
>>> m.verdict()
(10.0, 10.0)
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Floor:
    min_rate: float            # bytes/s; 0 turns the floor off
    average_over: float        # seconds of server time the rate is averaged over
    grace: float               # seconds of server time before any judgement

    @property
    def enabled(self) -> bool:
        return self.min_rate > 0 and self.average_over > 0

    def max_read(self, chunk: int) -> int:
        """The largest read worth asking for, given ``chunk`` (the usual one)."""
        if not self.enabled:
            return chunk
        return max(1024, min(chunk, int(self.min_rate * self.average_over / 2)))


class Meter:
    """One request's body: its reads (``begin``/``end``, from the stream) and a verdict (from
    the watcher). ``abort`` (set by the HTTP layer) breaks a read blocked on the network."""

    def __init__(self, floor: Floor, clock: Callable[[], float], source: str = "",
                 what: str = "") -> None:
        self.floor = floor
        self.source = source                    # for messages: the source's URL
        self.what = what                        # and what the request carries
        self._clock = clock
        self._lock = threading.Lock()
        self._server_time = 0.0                 # seconds blocked in completed reads
        self._reading_since: float | None = None
        self._want = 0
        self._total = 0
        # (server time at the end of a read, bytes by then); the oldest sample precedes the
        # span averaged over, so the bytes before its start are known.
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(0.0, 0)])
        self.abort: Callable[[], None] | None = None
        self.abandoned: str | None = None
        self._closed = False

    def begin(self, want: int) -> None:
        with self._lock:
            self._reading_since = self._clock()
            self._want = want

    def end(self, n: int) -> None:
        with self._lock:
            if self._reading_since is not None:
                self._server_time += max(0.0, self._clock() - self._reading_since)
            self._reading_since = None
            self._total += n
            self._samples.append((self._server_time, self._total))
            start = self._server_time - self.floor.average_over
            while len(self._samples) > 1 and self._samples[1][0] <= start:
                self._samples.popleft()

    def cut(self, why: str) -> None:
        """Abandon the request: ``why`` becomes its error, its blocked read is broken."""
        with self._lock:
            if self._closed:
                return                          # its connection may be another request's now
            self.abandoned = why
            if self.abort is not None:
                self.abort()

    def close(self) -> bool:
        """The body is done with; True if the request was cut (its connection is broken)."""
        with self._lock:
            self._closed = True
            return self.abandoned is not None

    def verdict(self) -> tuple[float, float] | None:
        """(at most how many bytes/s, over how many seconds) when the source is under the floor;
        None while it is above it, or too early to tell."""
        if not self.floor.enabled:
            return None
        with self._lock:
            now = self._server_time
            in_flight = 0
            if self._reading_since is not None:
                now += max(0.0, self._clock() - self._reading_since)
                in_flight = self._want
            if now < max(self.floor.grace, 1e-9):
                return None
            span = min(float(self.floor.average_over), now)
            start = now - span
            before = 0
            for t, total in self._samples:
                if t > start:
                    break
                before = total
            most = self._total - before + in_flight
        if most >= self.floor.min_rate * span:
            return None
        return most / span, span


class Arrivals:
    """Bytes received by many threads, told a receive at a time (``adder``), summed on read.

    A counter per thread: the hot path takes no lock, and no count is lost the way ``+=`` on one
    shared attribute loses one when two threads interleave its read and its write.

    >>> a = Arrivals()
    >>> add = a.adder(); add(10); add(5); a.adder()(1)
    >>> a.total
    16
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: list[list[int]] = []

    def adder(self) -> Callable[[int], None]:
        """A counter for one thread: call it with each receive's bytes."""
        cell = [0]
        with self._lock:
            self._cells.append(cell)

        def add(n: int) -> None:
            cell[0] += n
        return add

    @property
    def total(self) -> int:
        with self._lock:
            cells = list(self._cells)
        return sum(c[0] for c in cells)
