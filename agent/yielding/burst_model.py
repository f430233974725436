"""What the pull does to training bursts, and what it makes of the gaps between them: a model of
one bottleneck, for link rates this machine can't reach. Pure: numbers in, numbers out.

The bottleneck is a FIFO queue draining at the link's rate ``C``, upstream of the node (a switch
port). Two senders share it, both at line rate when they may send:

- training: bursts of ``size`` bytes every ``every`` seconds (an all-reduce step), which never back
  off; a burst's time is from its first byte sent to its last byte out of the queue, and its
  slowdown that time over the burst alone (``size / C``);
- the pull: window-limited, as wagent's receive windows make it. Its sender may have ``W`` bytes
  in flight, less what waits unread in the receive buffer, so it sends at
  ``min(C, (W - unread) / (RTT + queue / C))`` (the ACK clock: a queue that builds slows it at
  once). ``W`` is the windows of the pull's sockets, sized from the controller's rate exactly as
  ``agent.yielding.sockets.window_for`` sizes them; the pull reads at that rate (its token
  bucket), so at a low rate the buffer fills and the window closes, whatever the round trip. A
  window cut reaches the sender only as what it was granted drains (Linux never retracts a
  window it advertised), over about one round trip; a window raised is used at once.

The controller is wagent's own (``agent.yielding.controller.Controller``, fed the same readings the
link detector makes): each ``tick`` it reads the training bytes that left the queue over the tick,
as other traffic on the link, and sets the rate. So the model runs the shipped parameters, not a
copy of them.

The fast path (``backoff.burst_hold``, ``agent.yielding.bursts``) is modelled as shipped: the
kernel's leaky bucket (``settings_for``: drained at ``link_threshold``, 64 KiB deep) fed the
training bytes as they leave the queue (they reach the node's ingress then); a full bucket cuts
until ``burst_hold`` after the last byte that found it full; a cut stops the pull's reads, so what
its windows granted still arrives and fills its buffers, then nothing (the windows are not
changed: when the cut ends, reading resumes and they reopen in one step); the controller judges
the bursts only when cuts hold most of every tick for a second (``Sustained``). ``FastPath``
(issue 23's sketch: bins, a cut to the floor) replaces it when given; ``burst_hold: null`` models
the ticks alone.

The fluid approximation: bytes are continuous, time is stepped finely around each burst (at
least ``FINE_STEPS`` steps in a burst's own time) and coarsely in the gaps. It ignores losses
(a deep-buffer switch), the senders' own congestion control (the pull's window, not its cwnd,
bounds it; a burst is at line rate), and the receiver's ACK delays.

>>> from agent.policy.model import Backoff
>>> r = simulate(Link(10**9, 50e-6), Bursts(24 * 10**6, 0.5, 10), Backoff(burst_hold=None))
>>> round(r.slowdowns[0], 2) > 1.0, r.idle_used < 0.01    # ticks alone: the floor between bursts
(True, True)
>>> r = simulate(Link(10**9, 50e-6), Bursts(24 * 10**6, 0.5, 10), Backoff())
>>> r.p99 < 1.02, r.idle_used > 0.95                       # the fast path: the gaps are the pull's
(True, True)
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

from agent.policy.model import Backoff
from agent.yielding.bursts import BurstState, Sustained, rhythm_for, settings_for
from agent.yielding.controller import Controller
from agent.yielding.detect.readings import LinkReading, Readings
from agent.yielding.sockets import (
    most_in_flight,
    most_unannounced,
    stall_cap,
    window_for,
)

FINE_STEPS = 400          # steps over a burst's own time (size / C)
COARSE_PER_TICK = 10      # steps per controller tick in the gaps
STREAMS = 8               # the pull's sockets: the chosen count settles at 2-3 where no
                          # per-connection cap binds; the total is the same for any count
                          # until each socket's floor of four segments binds (low rates, or
                          # 32 sockets behind a cap), where 8 is the middle of the range


@dataclass(frozen=True)
class Link:
    """The bottleneck: its rate (bits/s) and the base round trip of the pull's path (s)."""

    rate_bps: int
    base_rtt: float


@dataclass(frozen=True)
class Bursts:
    size: int                 # bytes
    every: float              # seconds from one burst's start to the next's
    count: int


@dataclass(frozen=True)
class FastPath:
    """A yield at the timescale of a burst (issue 23): training bytes over ``threshold`` (a share
    of the link) within a ``bin`` cut the windows and the bucket to their floor, ``reaction``
    seconds later; ``hold`` seconds without any restore what the controller set, in one step."""

    bin: float
    hold: float
    reaction: float = 0.0
    threshold: float = 0.05


@dataclass(frozen=True)
class Outcome:
    slowdowns: tuple[float, ...]      # each burst's time over its time alone
    idle_used: float                  # the pull's bytes over the idle capacity between bursts
    pull_bps: float                   # the pull's mean goodput over the bursts

    @property
    def first(self) -> float:
        return self.slowdowns[0]

    @property
    def p50(self) -> float:
        return statistics.median(self.slowdowns[1:] or self.slowdowns)

    @property
    def p99(self) -> float:
        rest = sorted(self.slowdowns[1:] or self.slowdowns)
        return rest[min(len(rest) - 1, math.ceil(0.99 * len(rest)) - 1)]


def window_total(rate_bps: int | None, path: Link, backoff: Backoff,
                 bucket: int | None = None, announced: bool = True) -> float:
    """The bytes the pull's sockets may have in flight together (``window_for`` per socket;
    a node with training bursts trains, so their bound holds: ``PullSockets.guard``, the
    tighter one while the bursts come unannounced and the fast path's ``bucket`` cuts)."""
    most = most_in_flight(backoff)
    per = window_for(rate_bps, path.base_rtt, STREAMS, budget_s=backoff.queue_budget,
                     most=most if announced else most_unannounced(most, bucket),
                     least=stall_cap(most))
    return math.inf if per is None else float(per * STREAMS)


def simulate(path: Link, bursts: Bursts, backoff: Backoff, *, cap_bps: int | None = None,
             fast: FastPath | None = None, warmup: float = 1.0,
             anticipate: bool = True) -> Outcome:
    """The pull beside ``bursts``, its controller having run ``warmup`` seconds without them
    (so it starts full, as a pull does when training begins). ``anticipate``: the shipped
    fast path holds the readers before a periodic burst is due (``agent.yielding.rhythm``)."""
    c = path.rate_bps / 8                              # bytes/s
    cap = cap_bps or path.rate_bps
    ctl = Controller(backoff, cap, link_bps=path.rate_bps)
    tick = backoff.tick
    alone = bursts.size / c
    fine = alone / FINE_STEPS
    coarse = tick / COARSE_PER_TICK
    rate = ctl.step(Readings(at=0.0), 0.0).rate_bps
    # the shipped fast path: the kernel's bucket (bytes), its depth, drain (bytes/s) and hold
    shipped = settings_for(ctl.backoff) if fast is None else None
    level, cut_held, held_total = 0.0, 0.0, 0.0
    sustained = Sustained()
    rhythm = (rhythm_for(shipped, path.rate_bps, most_in_flight(backoff))
              if shipped is not None and anticipate else None)
    bucket = shipped.threshold if shipped is not None else None

    announced = False

    def windows(rate_bps: int | None, held: bool = False) -> float:
        """What the receiver allows at ``rate_bps``: the bound is the looser one once the
        bursts' rhythm is known (the backoff loop tells the sockets at its tick, between two
        bursts: not while the readers are ``held``)."""
        nonlocal announced
        known = rhythm is not None and rhythm.period_ns() is not None
        announced = known and (announced or not held)
        return window_total(rate_bps, path, backoff, bucket, announced)

    w = windows(rate)                                  # what the receiver allows now
    w_eff = w                                          # what the sender may have in flight
    fast_cut = False
    floor_w = window_total(1, path, backoff)           # the fast path's cut: the windows' floor

    queue: collections.deque[list[float]] = collections.deque()   # [bytes, is_burst]
    qlen = 0.0
    t = 0.0
    next_tick = tick
    start0 = warmup
    starts = [start0 + i * bursts.every for i in range(bursts.count)]
    end = starts[-1] + bursts.every
    k = 0                                  # the next burst to start
    to_send = 0.0                          # bytes of the current burst not sent yet
    in_flight_burst = 0.0                  # its bytes sent, not out of the queue yet
    started_at = 0.0
    done: list[float] = []
    eps = 1e-6 + 1e-9 * bursts.size       # what float sums of a burst's steps leave over
    tick_burst_bytes = 0.0                 # training bytes out of the queue this tick
    bin_bytes, next_bin, hold_until, cut_at = 0.0, math.inf, -math.inf, math.inf
    if fast is not None:
        next_bin = fast.bin
    pull_bytes = 0.0                       # the pull's bytes out of the queue, in [start0, end)
    unread = 0.0                           # arrived at the node, not read by the pull yet

    while t < end:
        busy = to_send > 0 or in_flight_burst > 0
        detecting = fast is not None or shipped is not None
        dt = fine if busy or (detecting and fast_cut) else coarse
        if detecting and t < hold_until + fine:
            dt = fine
        early_at = math.inf            # the next anticipation begins (the step must stop there)
        if rhythm is not None:
            for a, _due, b in rhythm.windows():
                if a / 1e9 > t:
                    early_at = min(early_at, a / 1e9)
                elif t < b / 1e9:
                    dt = fine
        nxt = min(t + dt, next_tick, next_bin, starts[k] if k < len(starts) else math.inf,
                  cut_at, end, early_at)
        dt = nxt - t
        if dt <= 0:
            dt = 0.0
        # arrivals
        if to_send > 0 and dt > 0:
            sent = min(to_send, c * dt)
            to_send -= sent
            in_flight_burst += sent
            _push(queue, sent, True)
            qlen += sent
        if dt > 0:
            room = w_eff - unread
            a_p = min(c, room / (path.base_rtt + qlen / c)) if room > 0 else 0.0
            sent = a_p * dt
            if sent > 0:
                _push(queue, sent, False)
                qlen += sent
        # departures, in order
        serve = min(qlen, c * dt)
        qlen -= serve
        out_burst = out_pull = 0.0
        while serve > 1e-9 and queue:
            head = queue[0]
            take = min(head[0], serve)
            head[0] -= take
            serve -= take
            if head[1]:
                out_burst += take
            else:
                out_pull += take
            if head[0] <= 1e-9:
                queue.popleft()
        if in_flight_burst > 0 and out_burst > 0:
            in_flight_burst -= out_burst
            if in_flight_burst <= eps and to_send <= 0:
                # the burst's last byte left within this step: place it by the share it had
                frac = 1.0 if out_burst + out_pull <= 0 else out_burst / (out_burst + out_pull)
                finish = t + dt * min(1.0, frac)
                done.append((finish - started_at) / alone)
                in_flight_burst = 0.0
        early = rhythm is not None and not fast_cut and rhythm.wait_ns(int(t * 1e9)) > 0
        if shipped is not None and (fast_cut or early):
            reading = 0.0                               # the readers wait out the cut
            cut_held += dt if fast_cut else 0.0
        else:
            reading = ctl.floor if fast_cut else rate   # a cut holds the bucket too
        unread = max(0.0, unread + out_pull - reading / 8 * dt)
        if shipped is not None and dt > 0:
            level = min(float(shipped.threshold),
                        max(0.0, level - shipped.drain * dt) + out_burst)
            if out_burst > 0 and level >= shipped.threshold:
                # a cut within ``merge`` of the last one's end is that burst still (the kernel's
                # rule): no new start for the rhythm
                merged = t + dt <= hold_until + shipped.merge_ns / 1e9
                hold_until = t + dt + shipped.hold_ns / 1e9
                if not fast_cut and not merged and rhythm is not None:
                    rhythm.see(int((t + dt) * 1e9))
                fast_cut = True
        tick_burst_bytes += out_burst
        bin_bytes += out_burst
        if start0 <= t < end:
            pull_bytes += out_pull
        # the granted window drains toward a lower one over a round trip
        rtt_now = path.base_rtt + qlen / c
        target = floor_w if fast_cut and fast is not None else w
        if target >= w_eff:
            w_eff = target
        elif dt > 0:
            w_eff -= (w_eff - target) * min(1.0, dt / rtt_now)
        t = nxt
        # events at t
        if k < len(starts) and t >= starts[k] - 1e-12:
            to_send, started_at = float(bursts.size), t
            k += 1
        if t >= next_tick - 1e-12:
            # With a fast path, bursts are its business: the slow path sees only sustained
            # traffic (none here).
            other = tick_burst_bytes * 8 / tick if fast is None else 0.0
            if shipped is not None:
                held_total += cut_held
                cut_held = 0.0
                flow = sustained.see(BurstState(0, 0, 0, 1, 0, int(held_total * 1e9)),
                                     int(t * 1e9))
                other = other if flow else 0.0
            link = LinkReading("model", other, other, 0.0, 0.0)
            rate = ctl.step(Readings(at=t, links=(link,)), t).rate_bps
            w = windows(rate, held=fast_cut or (rhythm is not None
                                                 and rhythm.wait_ns(int(t * 1e9)) > 0))
            tick_burst_bytes = 0.0
            next_tick += tick
        if fast is not None:
            if t >= next_bin - 1e-12:
                if bin_bytes * 8 / fast.bin >= fast.threshold * path.rate_bps:
                    hold_until = t + fast.hold
                    if not fast_cut and cut_at == math.inf:
                        cut_at = t + fast.reaction
                bin_bytes = 0.0
                next_bin += fast.bin
            if t >= cut_at - 1e-12:
                fast_cut, cut_at = True, math.inf
        if detecting and fast_cut and t >= hold_until:
            fast_cut = False
    idle = c * (end - start0) - bursts.size * len(done)
    return Outcome(tuple(done), pull_bytes / idle if idle > 0 else 0.0,
                   pull_bytes * 8 / (end - start0))


def _push(queue: collections.deque[list[float]], n: float, is_burst: bool) -> None:
    if queue and queue[-1][1] == is_burst:
        queue[-1][0] += n
    else:
        queue.append([n, is_burst])
