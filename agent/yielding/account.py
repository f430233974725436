"""What yielding cost and what it left unused: the backoff loop's account, tick by tick. Pure.

While the controller holds distribution under its cap (backed off or ramping) every tick adds
its length to ``yielded_s``. While training is on the node (the loop's ``training_present``: a
training port's connection, libnccl, a burst the fast path cut for lately, or a backoff) every
tick adds the link's capacity that the other traffic left free to ``idle_bits`` and what
distribution carried to ``pulled_bits``: their ratio is the share of the gaps between training's
bursts the pull used, the figure issue 23 is about (0.3% on the yield bench before the fast
path). Both come from byte counters over the tick, so they hold at any burst length. ``bursts``
counts the times other traffic rose over the threshold after a tick under it: ticks see bursts
only as long as a tick (100 ms), so at high link rates a short burst averages under the
threshold and goes uncounted (the fast path's detector counts every one:
``agent.yielding.bursts``).

>>> a = Account()
>>> a.add(0.1, link_bps=10**9, other_bps=9e8, distribution_bps=2e6, yielded=True, over=True)
>>> a.add(0.1, link_bps=10**9, other_bps=0.0, distribution_bps=2e6, yielded=True, over=False)
>>> a.add(0.1, link_bps=10**9, other_bps=0.0, distribution_bps=0.0, yielded=False,
...       over=False, training=False)
>>> a.bursts, round(a.yielded_s, 1), round(a.idle_used, 4)
(1, 0.2, 0.0036)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Account:
    yielded_s: float = 0.0          # seconds distribution was held under its cap
    idle_bits: float = 0.0          # link capacity other traffic left free, while training
    pulled_bits: float = 0.0        # what distribution carried, while training
    bursts: int = 0                 # rises of other traffic over the threshold
    _over: bool = False             # the last tick's other traffic was over the threshold

    def add(self, dt: float, *, link_bps: int | None, other_bps: float | None,
            distribution_bps: float | None, yielded: bool, over: bool,
            training: bool = True) -> None:
        """One tick of ``dt`` seconds. None: not known (no link reading, the link's rate not
        given, no distribution counter); the idle capacity is counted only when all are.
        ``training``: training is on the node (a tick yielded counts as training too)."""
        if over and not self._over:
            self.bursts += 1
        self._over = over
        if dt <= 0:
            return
        if yielded:
            self.yielded_s += dt
        if not (yielded or training):
            return
        if link_bps and other_bps is not None and distribution_bps is not None:
            self.idle_bits += max(0.0, link_bps - other_bps) * dt
            self.pulled_bits += max(0.0, distribution_bps) * dt

    @property
    def idle_used(self) -> float | None:
        """The share of the idle capacity the pull used while training (None: none counted)."""
        return self.pulled_bits / self.idle_bits if self.idle_bits > 0 else None
