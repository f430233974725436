"""How many streams a pull runs: chosen by measuring what each one adds, at most the policy's
``pulls.streams``. Pure: the pull (``agent.pull.transfer``) feeds it its byte count and whether
its token bucket held it, a few times a second, and starts or ends streams as it says.

Why measure: a path wants about (link rate / one connection's rate) streams. Fewer leave the
link idle behind a per-connection cap (an origin's or a CDN's, a proxy's, a long round trip's
window); more only add queues (which the yielding then has to fight), connections on the
server, and CPU. On the testbed, 8 streams gave 38.5 MiB/s where 24 gave 69.9 behind a 5 MB/s
cap per connection; one or two fill a path with no such cap. Neither number can be known
ahead.

The rule, judged on windows of goodput that begin ``SETTLE`` s after a change, each
``WINDOW`` s (``RAMP_WINDOW`` while ramping: a step of the ramp looks for a third more or
nothing, a probe for a few percent) and ``GRAINS`` receives long (at most ``LONGEST`` s), and
go on while each is more than ``RISING`` above the one before (new connections on a long round
trip are still in slow start), at most ``WINDOWS`` of them:

- start with ``START`` streams (the maximum if lower), then one more, then ``GROW`` times as
  many while each added stream carries at least ``LINEAR`` of what an average one carried
  before: below the path's limit every stream adds its own rate. The ramp is a search for
  link / per-connection rate, which nothing tells ahead; a large factor spends fewer
  judgements at counts that leave most of the link idle (2 > 3 > 12 > 48), and the step past
  the limit says where the limit is (next rule), so the overshoot costs one judgement;
- an added step that grew the aggregate by less than ``MIN_GROWTH`` (a window's noise) is
  given back, and the count settles;
- one that grew it, but less than in proportion, crossed the path's limit: the limit is near
  ``before + added x (what each added stream carried / what an average one carried)``, the
  count where the added streams would have carried an average share each. That count is
  tried, and kept if goodput stays within ``KEEP`` of the larger count's; from a step that
  tried nothing smaller, the count grows on by a quarter;
- *settled*: every ``REPROBE`` s probe, alternately a quarter more (kept if it grew the
  aggregate by ``MIN_GROWTH``, then growing on by quarters) and a quarter fewer (kept if
  goodput stays within ``KEEP``); when goodput rose by more than ``MOVED`` (a cap per
  connection lifted, a faster source), at once: twice as many, then growing as a pull does.
  Goodput that fell is left to the probes: the likelier cause is other traffic on the link,
  and a pull that yields must not answer it with more connections (a cap that appeared is found
  by the next probe up, which grows on by quarters while each step adds);
- *held*: when the token bucket held the streams in a window at its rate (``pulls.rate``, the
  slow path's backoff) and the window carried at least ``HELD_SHARE`` of that rate, the link
  is not what limits the pull: one stream fewer per window,
  kept while goodput stays within ``KEEP``, down to ``HELD_FEWEST``, and no probing up while
  it holds. The fast path's cuts (``TokenBucket.rate_binds`` leaves them out) don't count:
  they last a burst, and the streams are wanted the moment it ends.

Behind a cap of 5 MB/s per connection on a 120 MB/s link (24 streams fill it), then on a link
that two streams fill:

>>> def pull(c, rate_of, seconds, dt=0.25):
...     t = got = 0.0
...     while t < seconds:
...         t, got = t + dt, got + rate_of(c.count) * dt
...         c.step(t, got, held=False)
...     return c.count
>>> pull(StreamCount(most=32), lambda n: min(5e6 * n, 120e6), 30)
24
>>> c = StreamCount(most=8)
>>> pull(c, lambda n: 100e6, 30), c.reason
(2, '1 more stream grew goodput by 0% (95.4 MiB/s): given back')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.units import format_size

START = 2            # streams a pull starts with
HELD_SHARE = 0.97    # a window carrying this share of the bucket's rate, a stream waiting for it:
                     # the cap binds (goodput over 0.5 s under a bucket is within 1-2% of it)
HELD_FEWEST = 2      # streams a held pull keeps: the backoff lets go when training stops, and
                     # the pull must be back within seconds; one stream then stalls whenever its
                     # reader is late (hashing a chunk) on windows sized for a 1 ms queue (the
                     # yield bench: 5.9 s back to 80% of the link, 3.5 s with 8 streams)
SETTLE = 0.15        # s after a change before goodput is measured (new connections on a
                     # long round trip are still ramping then: RISING waits for them)
WINDOW = 0.5         # s of goodput in one window, at least...
RAMP_WINDOW = 0.15   # ...while the ramp grows by GROW (its judgements see large effects)
GRAINS = 16          # ...and this many of the pull's receives (``grain``): bytes are counted a
                     # receive at a time, so a shorter window is off by a receive's share
LONGEST = 3.0        # s a window lasts at most, however few reads it took
RISING = 0.05        # a window this much above the one before: still ramping, measure again
WINDOWS = 4          # windows at most before a judgement
GROW = 4             # the count's factor per step while every added stream carries its share
LINEAR = 0.75        # added streams carrying this share of an average one: keep growing
MIN_GROWTH = 0.03    # an added step must grow the aggregate by this share (a window's noise)
KEEP = 0.95          # fewer streams are kept if goodput stays within this share
MOVED = 0.25         # settled goodput rising by this share: the path changed, ramp again
REPROBE = 30.0       # s between probes while settled


@dataclass(frozen=True)
class _Probe:
    before: int          # the count the probe started from
    goodput: float       # bytes/s at that count
    up: bool


class StreamCount:
    """The count now (``count``) and why (``reason``); ``step`` moves it."""

    def __init__(self, most: int, start: int = START, grain: int = 0) -> None:
        """``grain``: the bytes the pull reads (and counts) at a time."""
        self.most = max(1, most)
        self.grain = grain
        self.count = min(self.most, max(1, start))
        self.reason = f"starting with {self.count}"
        self._probe: _Probe | None = _Probe(0, 0.0, True)   # growing from nothing
        self._fine = False                                  # growing by quarters, not by GROW
        self._changed_at: float | None = None
        self._mark: tuple[float, float] | None = None       # (time, bytes) the window began
        self._windows: list[float] = []                     # goodput of this count's windows
        self._held = False
        self._settled: tuple[float, float] | None = None    # (goodput, since)
        self._up_next = True

    def step(self, now: float, received: float, held: bool, starved: bool = False,
             cap: float | None = None) -> int:
        """``received``: the pull's bytes so far; ``held``: its token bucket held a stream
        at its rate since the last call; ``cap``: that rate (bytes/s; None: unlimited);
        ``starved``: goodput says nothing of the path now, and the window is dropped: some
        streams may have no work (the pull's last requests), or the pull yielded (its
        bucket's rate moved, the fast path cut it). Returns the count to run now."""
        if starved:
            self._mark, self._windows = None, []
            return self.count
        if self._changed_at is None:
            self._changed_at = now
        if now - self._changed_at < SETTLE:
            return self.count
        if self._mark is None:
            self._mark, self._held = (now, received), False    # a hold while settling is past
            return self.count
        self._held = self._held or held
        start, before = self._mark
        took = now - start
        window = RAMP_WINDOW if self._ramping else WINDOW
        if took < window or (received - before < GRAINS * self.grain and took < LONGEST):
            return self.count
        goodput = (received - before) / took
        self._mark = (now, received)
        self._windows.append(goodput)
        w = self._windows
        if len(w) < 2 or (w[-1] > (1 + RISING) * w[-2] and len(w) < WINDOWS):
            return self.count              # one window proves nothing; a rising one is early
        # Held means the cap is what limits the pull: a stream waited for the bucket, and the
        # window carried nearly the cap. A bucket whose rate is the link's lets the streams'
        # chunks through in clumps, so some stream waits now and then while the link, not the
        # cap, limits the pull (alone on the yield bench's 1 Gbit/s link the pull carried 91%
        # of the bucket's rate; taken for held, it gave back every stream it added, and two
        # streams carried 5% less than four or eight).
        held = self._held and cap is not None and goodput >= HELD_SHARE * cap
        self._held = False
        self._judge(now, goodput, held)
        return self.count

    @property
    def _ramping(self) -> bool:
        """Growing by ``GROW`` (or from nothing): the next judgement tells a stream's share
        from none, not a few percent."""
        p = self._probe
        return p is not None and p.up and not self._fine

    def _change(self, now: float, count: int, reason: str) -> None:
        self.count = max(1, min(self.most, count))
        self.reason = reason
        self._changed_at = now
        self._mark = None
        self._windows = []

    def _settle(self, now: float, goodput: float, reason: str) -> None:
        self._probe = None
        self._fine = False
        self._settled = (goodput, now)
        self.reason = reason

    def _judge(self, now: float, goodput: float, held: bool) -> None:
        self._windows = []
        p = self._probe
        grew = ""
        if p is not None and p.up and p.before:
            if self._judge_up(now, p, goodput, held):
                return
            grew = self.reason
            p = self._probe
        if p is not None and not p.up:
            if goodput < KEEP * p.goodput:
                self._change(now, p.before, f"{self.count} streams carried {_rate(goodput)}, "
                             f"{p.before} carried {_rate(p.goodput)}: back to {p.before}")
                self._settle(now, p.goodput, self.reason)
                return
            if not held:
                self._settle(now, goodput, f"{self.count} streams carry as much as "
                             f"{p.before} did ({_rate(goodput)})")
                return
        if held:
            # The bucket (a rate cap, the backoff) is the limit: fewer streams fill it as well.
            fewest = min(self.most, HELD_FEWEST)
            if self.count > fewest:
                self._probe = _Probe(self.count, goodput, False)
                self._change(now, self.count - 1, f"the pull's rate cap or backoff holds it at "
                             f"{_rate(goodput)}: one stream fewer")
            else:
                self._settle(now, goodput, f"{self.count} stream{'s' * (self.count > 1)}: the "
                             f"pull's rate cap or backoff holds it at {_rate(goodput)}")
            return
        if p is not None:                     # growing
            if self.count >= self.most:
                self._settle(now, goodput, f"{self.count} streams, the most the policy allows"
                             + (f": {grew}" if grew else ""))
                return
            if self._fine:
                more = max(1, self.count // 4)
            else:
                more = 1 if self.count < 3 else (GROW - 1) * self.count
            self._probe = _Probe(self.count, goodput, True)
            self._change(now, self.count + more,
                         f"growing: {grew}" if grew else f"growing from {self.count}")
            return
        assert self._settled is not None
        settled, since = self._settled
        moved = settled > 0 and goodput > (1 + MOVED) * settled
        if not moved and now - since < REPROBE:
            return
        if moved and self.count < self.most:
            # Another path (a cap per connection lifted, a faster source): ramp again, twice
            # as many and then by GROW, rather than a quarter at a time.
            self._probe = _Probe(self.count, goodput, True)
            self._change(now, self.count * 2, f"goodput rose ({_rate(settled)} -> "
                         f"{_rate(goodput)}): growing from {self.count}")
            return
        step = max(1, self.count // 4)
        why = "goodput rose" if moved else "probing"
        if self._up_next and self.count < self.most:
            self._probe = _Probe(self.count, goodput, True)
            self._fine = True
            self._change(now, self.count + step, f"{why}: {step} more")
        elif self.count > 1:
            self._probe = _Probe(self.count, goodput, False)
            self._change(now, self.count - step, f"{why}: {step} fewer")
        else:
            self._settled = (goodput, now)
        self._up_next = not self._up_next

    def _judge_up(self, now: float, p: _Probe, goodput: float, held: bool) -> bool:
        """Judges ``p.before`` -> ``count`` streams. True when it decided the next count;
        False when the step was worth it and growing goes on (``reason`` says what it grew)."""
        added = self.count - p.before
        each = (goodput - p.goodput) / added
        average = p.goodput / p.before
        share = each / average if average > 0 else 0.0
        growth = goodput / p.goodput - 1 if p.goodput > 0 else 1.0
        what = (f"{added} more stream{'s' * (added > 1)} grew goodput by {growth:.0%} "
                f"({_rate(goodput)})")
        if held or growth < MIN_GROWTH:
            self._change(now, p.before, f"{what}: given back")
            self._settle(now, p.goodput, self.reason)
            return True
        what += f", {share:.0%} of an average stream's each"
        if share < LINEAR:
            # Past the path's limit: the added streams shared what was left of it. Where they
            # would have carried an average share each is where the limit is.
            knee = p.before + max(1, math.ceil(added * share))
            if knee < self.count:
                self._probe = _Probe(self.count, goodput, False)
                self._change(now, knee, f"{what}: the path's limit is near {knee}: trying "
                             f"{knee}")
                return True
            self._fine = True
        self.reason = what
        self._probe = _Probe(0, 0.0, True)
        return False


def _rate(bytes_per_s: float) -> str:
    return f"{format_size(int(bytes_per_s))}/s"
