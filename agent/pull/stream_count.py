"""How many streams a pull runs: chosen by measuring what each one adds, at most the policy's
``pulls.streams``. Pure: the pull (``agent.pull.transfer``) feeds it its byte count and whether
its token bucket held it, a few times a second, and starts or ends streams as it says.

Why measure: a path wants about (link rate / one connection's rate) streams. Fewer leave the
link idle behind a per-connection cap (an origin's or a CDN's, a proxy's, a long round trip's
window); more only add queues (which the yielding then has to fight), connections on the
server, and CPU. On the testbed, 8 streams gave 38.5 MiB/s where 24 gave 69.9 behind a 5 MB/s
cap per connection; one or two fill a path with no such cap. Neither number can be known
ahead.

The rule, judged over ``WINDOW`` s of goodput after ``SETTLE`` s for a change to take (new
connections, slow start):

- start with ``START`` streams (the maximum if lower);
- *growing*: add half as many again (at least one) while each added stream carries at least
  ``GAIN`` of what an average stream carried before (and the aggregate grows by
  ``MIN_GROWTH``, more than a window's noise); else try half the step, and once a single
  added stream adds too little, give it back: the count settles;
- *settled*: every ``REPROBE`` s, or at once when goodput moved by more than ``MOVED`` (a cap
  lifted, a source dropped), probe: alternately a quarter more (kept if each added one carries
  ``GAIN`` of an average one, then growing again) and a quarter fewer (kept if goodput stays
  within ``KEEP``);
- *held*: when the token bucket held the streams in a window (``pulls.rate``, the backoff), the
  link is not what limits the pull: one stream fewer per window, kept while goodput stays
  within ``KEEP``, and no probing up while it holds.

Behind a cap of 5 MB/s per connection on a 120 MB/s link (24 streams fill it), then on a link
that two streams fill:

>>> def pull(c, rate_of, seconds, dt=0.25):
...     t = got = 0.0
...     while t < seconds:
...         t, got = t + dt, got + rate_of(c.count) * dt
...         c.step(t, got, held=False)
...     return c.count
>>> pull(StreamCount(most=32), lambda n: min(5e6 * n, 120e6), 30)
28
>>> c = StreamCount(most=8)
>>> pull(c, lambda n: 100e6, 30), c.reason
(2, '1 more stream added 0 B/s each (an average one carried 47.7 MiB/s): given back')
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.units import format_size

START = 2            # streams a pull starts with
SETTLE = 1.0         # s after a change before goodput is measured
WINDOW = 1.0         # s of goodput a judgement takes
GAIN = 0.25          # an added stream must carry this share of an average stream's goodput
MIN_GROWTH = 0.03    # ...and the aggregate grow by this share at least (a window's noise)
KEEP = 0.95          # fewer streams are kept if goodput stays within this share
MOVED = 0.25         # settled goodput moving by this share: the path changed, probe again
REPROBE = 30.0       # s between probes while settled


@dataclass(frozen=True)
class _Probe:
    before: int          # the count the probe started from
    goodput: float       # bytes/s at that count
    up: bool


class StreamCount:
    """The count now (``count``) and why (``reason``); ``step`` moves it."""

    def __init__(self, most: int, start: int = START) -> None:
        self.most = max(1, most)
        self.count = min(self.most, max(1, start))
        self.reason = f"starting with {self.count}"
        self._probe: _Probe | None = _Probe(0, 0.0, True)   # growing from nothing
        self._changed_at: float | None = None
        self._mark: tuple[float, float] | None = None       # (time, bytes) the window began
        self._held = False
        self._settled: tuple[float, float] | None = None    # (goodput, since)
        self._up_next = True

    def step(self, now: float, received: float, held: bool) -> int:
        """``received``: the pull's bytes so far; ``held``: its token bucket held a stream
        since the last call. Returns the count to run now."""
        if self._changed_at is None:
            self._changed_at = now
        if now - self._changed_at < SETTLE:
            return self.count
        if self._mark is None:
            self._mark, self._held = (now, received), False
            return self.count
        self._held = self._held or held
        start, before = self._mark
        if now - start < WINDOW:
            return self.count
        goodput = (received - before) / (now - start)
        self._mark = None
        self._judge(now, goodput, self._held)
        return self.count

    def _change(self, now: float, count: int, reason: str) -> None:
        self.count = max(1, min(self.most, count))
        self.reason = reason
        self._changed_at = now
        self._mark = None

    def _settle(self, now: float, goodput: float, reason: str) -> None:
        self._probe = None
        self._settled = (goodput, now)
        self.reason = reason

    def _judge(self, now: float, goodput: float, held: bool) -> None:
        p = self._probe
        if p is not None and p.up and p.before:
            added = self.count - p.before
            each = (goodput - p.goodput) / added
            average = p.goodput / p.before
            if each < GAIN * average or goodput < (1 + MIN_GROWTH) * p.goodput or held:
                why = (f"{added} more stream{'s' * (added > 1)} added {_rate(each)} each (an "
                       f"average one carried {_rate(average)})")
                if added > 1 and not held:
                    # the step may have overshot where streams stop adding: half of it
                    self._probe = p
                    self._change(now, p.before + added // 2, f"{why}: trying {added // 2}")
                    return
                self._change(now, p.before, f"{why}: given back")
                self._settle(now, p.goodput, self.reason)
                return
            p = _Probe(0, 0.0, True)          # worth it: on growing from here
            grew = (f"{added} more stream{'s' * (added > 1)} added {_rate(each)} each (an "
                    f"average one carried {_rate(average)})")
        else:
            grew = ""
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
            if self.count > 1:
                self._probe = _Probe(self.count, goodput, False)
                self._change(now, self.count - 1, f"the pull's rate cap or backoff holds it at "
                             f"{_rate(goodput)}: one stream fewer")
            else:
                self._settle(now, goodput, f"1 stream: the pull's rate cap or backoff holds it "
                             f"at {_rate(goodput)}")
            return
        if p is not None:                     # growing
            if self.count >= self.most:
                self._settle(now, goodput, f"{self.count} streams, the most the policy allows"
                             + (f": {grew}" if grew else ""))
                return
            self._probe = _Probe(self.count, goodput, True)
            self._change(now, self.count + max(1, self.count // 2),
                         f"growing: {grew}" if grew else f"growing from {self.count}")
            return
        assert self._settled is not None
        settled, since = self._settled
        moved = settled > 0 and abs(goodput - settled) > MOVED * settled
        if not moved and now - since < REPROBE:
            return
        step = max(1, self.count // 4)
        why = "goodput moved" if moved else "probing"
        if self._up_next and self.count < self.most:
            self._probe = _Probe(self.count, goodput, True)
            self._change(now, self.count + step, f"{why}: {step} more")
        elif self.count > 1:
            self._probe = _Probe(self.count, goodput, False)
            self._change(now, self.count - step, f"{why}: {step} fewer")
        else:
            self._settled = (goodput, now)
        self._up_next = not self._up_next


def _rate(bytes_per_s: float) -> str:
    return f"{format_size(int(bytes_per_s))}/s"
