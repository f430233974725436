"""One token bucket shared by every stream of a process, its rate changeable while pulls run.

It is a GCRA (virtual scheduling) bucket: a theoretical arrival time ``tat`` advances by
``bytes / rate`` for each reservation; a caller whose reservation ends in the future sleeps until
then. Idle time banks at most ``burst`` seconds of credit, so over any second the bytes let through
stay within (1 + burst) x rate plus one chunk per stream. ``set_rate`` (the backoff controller's
knob) takes effect at once: waiters are woken and the schedule restarts from now.

The booking rule is pure (:func:`book`); at 1 MB/s, two half-megabyte bookings at t=0 end at 0.5 s
and 1 s, so their callers wait that long:

>>> book(0.0, 0.0, 500_000, 8_000_000, burst=0.0)
0.5
>>> book(0.5, 0.0, 500_000, 8_000_000, burst=0.0)
1.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def book(tat: float, now: float, n_bytes: int, bits_per_s: int, burst: float) -> float:
    """The theoretical arrival time once ``n_bytes`` are booked at ``now``, the one before being
    ``tat``; the caller waits until then. Idle time banks at most ``burst`` seconds of credit."""
    return max(tat, now - burst) + n_bytes * 8 / bits_per_s


class TokenBucket:
    def __init__(self, bits_per_s: int | None = None, *, burst: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._burst = burst
        self._cond = threading.Condition()
        self._rate = self._check(bits_per_s)
        self._tat = clock()
        self._generation = 0
        self._waiting = 0       # callers waiting for their bytes' turn at the rate
        self._cut = 0           # ...and for the fast path's cut to end
        self._disturbances = 0  # rate changes and cuts waited, ever (``disturbances``)
        # the fast path's cut (agent.yielding.bursts.BurstGate.hold): seconds a caller at the
        # current rate waits before its next bytes; None: no fast path
        self._hold: Callable[[int | None], float] | None = None

    @staticmethod
    def _check(bits_per_s: int | None) -> int | None:
        if bits_per_s is not None and bits_per_s <= 0:
            raise ValueError(f"rate must be positive bits/s or None (unlimited), got {bits_per_s}")
        return bits_per_s

    @property
    def rate(self) -> int | None:
        """The cap in bits/s; None: unlimited."""
        return self._rate

    def set_rate(self, bits_per_s: int | None) -> None:
        with self._cond:
            rate = self._check(bits_per_s)
            self._disturbances += rate != self._rate
            self._rate = rate
            self._tat = self._clock()
            self._generation += 1
            self._cond.notify_all()

    def hold_on(self, hold: Callable[[int | None], float] | None) -> None:
        """While ``hold(rate)`` is positive, callers of :meth:`consume` wait that long before
        booking (a burst on the link: the readers stop, their windows close). None: never."""
        with self._cond:
            self._hold = hold
            self._cond.notify_all()

    @property
    def cuts(self) -> bool:
        """A fast path may hold the readers (``hold_on``)."""
        return self._hold is not None

    def paused(self) -> bool:
        """The fast path holds readers now: one filling a chunk hands over what it has (and
        waits in :meth:`consume`)."""
        with self._cond:
            return self._hold is not None and self._hold(self._rate) > 0

    def wait_cut(self, stop: threading.Event | None = None) -> None:
        """Waits while the fast path's cut lasts (or until ``stop`` is set): for a reader that
        found bytes waiting and left them in its socket, with nothing to book."""
        with self._cond:
            self._held(stop)

    def chunk_size(self, largest: int, smallest: int = 16384) -> int:
        """Bytes worth reading per step: about 1/20 s of the current rate, within the bounds."""
        rate = self._rate
        if rate is None:
            return largest
        return max(smallest, min(largest, rate // 8 // 20))

    @property
    def waiting(self) -> int:
        """How many callers of :meth:`consume` are waiting now, for their bytes' turn at the
        rate or for the fast path's cut to end."""
        with self._cond:
            return self._waiting + self._cut

    @property
    def disturbances(self) -> int:
        """How many times the rate changed or a caller waited out a cut (0.1 s at a time),
        ever: goodput measured across a change of it measured the yielding, not the path."""
        with self._cond:
            return self._disturbances

    @property
    def rate_binds(self) -> bool:
        """A caller waits for its bytes' turn at the rate now (``pulls.rate``, the slow path's
        backoff): the cap, not the path, limits the pull. The fast path's cuts don't count:
        they last a burst, and the streams are wanted the moment it ends."""
        with self._cond:
            return self._waiting > 0

    def _reserve(self, n_bytes: int) -> float:
        """Books ``n_bytes``; returns how long the caller must wait before sending them."""
        now = self._clock()
        if self._rate is None:
            self._tat = now
            return 0.0
        self._tat = book(self._tat, now, n_bytes, self._rate, self._burst)
        return max(0.0, self._tat - now)

    def consume(self, n_bytes: int, stop: threading.Event | None = None) -> None:
        """Block until ``n_bytes`` may pass (or the rate changes, or ``stop`` is set)."""
        with self._cond:
            if self._hold is not None and not self._held(stop):
                return
            wait = self._reserve(n_bytes)
            if wait <= 0:
                return
            generation = self._generation
            deadline = self._clock() + wait
            self._waiting += 1
            try:
                while True:
                    # Short waits so that a stop request is noticed within 0.1 s.
                    self._cond.wait(min(wait, 0.1))
                    if self._generation != generation or (stop is not None and stop.is_set()):
                        return
                    wait = deadline - self._clock()
                    if wait <= 0:
                        return
            finally:
                self._waiting -= 1

    def _held(self, stop: threading.Event | None) -> bool:
        """Waits out the fast path's cut (under the condition); False: ``stop`` was set."""
        while self._hold is not None:
            wait = self._hold(self._rate)
            if wait <= 0:
                return True
            if stop is not None and stop.is_set():
                return False
            self._cut += 1
            self._disturbances += 1
            try:
                self._cond.wait(min(wait, 0.1))
            finally:
                self._cut -= 1
        return True
