"""Rates from cumulative kernel counters that may wrap, reset or vanish between two ticks.

Interface byte counters are 64-bit on today's kernels but 32-bit on some drivers and in
some containers; InfiniBand's legacy ``port_*_data`` counters are 32-bit and *saturate* at
their maximum instead of wrapping. A device that is removed and re-created under the same
name starts again from zero: the caller passes a generation (the ifindex, say) so that is seen
as a new device, not as a wrap.

>>> c = CounterRates()
>>> c.rate("eth0.rx", 1, 1000, now=0.0) is None          # first sight: no rate yet
True
>>> c.rate("eth0.rx", 1, 1500, now=0.5)                  # bytes per second
1000.0
>>> c.rate("eth0.rx", 1, 100, now=1.5)                   # a 32-bit wrap
4294965896.0
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

WRAP32 = 2**32
WRAP64 = 2**64
MAX32 = WRAP32 - 1

# A wrap that would mean more than this many bytes per second is taken for a reset
# (a driver reload, a counter cleared): 2 Tbit/s is beyond any NIC of today.
DEFAULT_MAX_BYTES_PER_S = 250 * 10**9


@dataclass(frozen=True)
class _Seen:
    generation: Hashable
    at: float
    value: int


def counter_delta(prev: int, cur: int, max_delta: float) -> int | None:
    """Increase from ``prev`` to ``cur``, across a 32- or 64-bit wrap; None for a reset."""
    if cur >= prev:
        return cur - prev
    width = WRAP32 if prev < WRAP32 else WRAP64
    wrapped = cur + width - prev
    return wrapped if wrapped <= max_delta else None


class CounterRates:
    """Remembers each counter's last value; gives bytes (or events) per second."""

    def __init__(self, max_per_s: float = DEFAULT_MAX_BYTES_PER_S) -> None:
        self._seen: dict[Hashable, _Seen] = {}
        self._max_per_s = max_per_s
        self.saturated: set[Hashable] = set()

    def rate(self, key: Hashable, generation: Hashable, value: int, now: float) -> float | None:
        """Per-second increase since the last call for ``key``; None when there is no baseline."""
        prev = self._seen.get(key)
        self._seen[key] = _Seen(generation, now, value)
        self.saturated.discard(key)
        if prev is None or prev.generation != generation or now <= prev.at:
            return None
        if value == prev.value == MAX32:
            # A 32-bit IB counter stuck at its maximum: it no longer counts anything.
            self.saturated.add(key)
            return None
        dt = now - prev.at
        delta = counter_delta(prev.value, value, self._max_per_s * dt)
        return None if delta is None else delta / dt

    def forget_except(self, keys: set[Hashable]) -> None:
        """Drop counters of devices that vanished, so a re-created one starts afresh."""
        for key in [k for k in self._seen if k not in keys]:
            del self._seen[key]
            self.saturated.discard(key)
