"""The fast path: yield to a training burst within a packet of the kernel seeing it, and take the
gap after it at once.

The slow path (the controller, ``agent.yielding.controller``) works on 100 ms ticks: a burst of
24 MB lasts 0.2 s at 1 Gbit/s and 2 ms at 100 Gbit/s, so a tick either sees it late or averages it
away, and once it has seen one it holds the pull at its floor for ``quiet`` (3 s), which bursts
every half second make forever. Here the kernel does the seeing (``shaping.bpf``: a leaky bucket
of the link's foreign bytes, per packet, on the ingress hook), and the pull's readers do the
yielding: each reader, between two receives into its chunk (``TokenBucket.paused``) and before
it books it (``TokenBucket.consume``), reads the detector's map (memory shared with the kernel:
no system call) and, while a cut lasts, hands over what it has and waits. Bursts that come at a
steady period are waited for too, from just before the next is due (``agent.yielding.rhythm``).

Why stopping the readers is a cut that holds within a round trip: the pull sockets' receive
buffers are sized to their windows (``agent.yielding.sockets``), so a reader that stops leaves
a buffer that fills with what was already granted, and the window it advertises falls to zero:
the sender stops. What was granted still arrives (Linux never retracts a window), which is why
the windows together stay under 3% of the smallest burst while the node trains. When the cut
ends the readers read again, the windows open in one step, and the sender, its congestion
window intact, is back at its rate within a round trip: nothing to ramp.

What stays with the slow path: sustained traffic (cuts that held the pull for most of every
tick over ``SUSTAINED``: a flow, not bursts; a flow's own gaps, a busy CPU's, may end one cut
and start the next) goes to the controller as before (floor, ``quiet``, ramp, the HTB ceil),
and the readers stop waiting for the cut once the bucket is at the floor, so the floor flows;
RDMA, which never passes tc. Presence alone (a training port's connection, a process mapping
libnccl) no longer holds the pull at its floor: it bounds the windows (``PullSockets.guard``)
and the fast path yields to what that training actually sends.

>>> s = BurstState(level=0, cut_until_ns=2_000_000, cut_start_ns=1_000_000, bursts=1,
...                foreign_bytes=300_000, held_ns=0)
>>> s.wait_s(1_500_000), s.held_s(9_000_000)
(0.0005, 0.001)
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from agent.policy.model import Backoff
from agent.yielding.detect.readings import Readings
from agent.yielding.rhythm import Rhythm
from shaping.bpf import BURSTS, CUT_START, CUT_UNTIL, FOREIGN, HELD, LEVEL, Settings

# Cuts that held the pull for at least SUSTAINED_SHARE of every tick over this long are a flow,
# not bursts: the controller takes it (floor, quiet, ramp) and the readers stop waiting on the
# fast path once the bucket is at the floor. Bursts every 0.5 s at 1 Gbit/s (0.2 s each) hold
# one tick in two or three; a flow with gaps (CPU, pacing) longer than the hold, nearly all.
SUSTAINED = 1.0
SUSTAINED_SHARE = 0.5
# The detector's bucket must hold this much before it cuts: more than one GRO aggregate of
# someone's background flow (GRO keeps an aggregate under 64 KiB, gro_max_size's default), as
# little as that next to a burst: while it fills, the pull shares the link with the burst and
# takes about half of it (``sockets.most_unannounced``). 128 KiB cost a 6 MB burst at 1 Gbit/s
# a millisecond more than this.
THRESHOLD_MIN = 64 * 1024
# A cut that starts within this many holds of the last one's end is the same burst: its sender
# paused mid-burst (seen: a Python sender stalled over 5 ms on a busy machine, 4 cuts counted
# for 3 bursts), and a burst counted twice breaks the rhythm read from the cuts' starts. The
# readers still read in the pause; only the count and the start merge.
MERGE_HOLDS = 2
# Training that burst within this long is still training: the windows stay bounded.
RECENT = 10.0

_U64 = struct.Struct("=Q")


def settings_for(backoff: Backoff) -> Settings | None:
    """The detector's settings under a (resolved) ``backoff``: foreign traffic under its
    ``link_threshold`` never fills the bucket; None: no fast path (``burst_hold: null``, or
    backoff off).

    >>> from agent.policy.model import Backoff
    >>> settings_for(Backoff().resolved(10**9))
    Settings(drain=6250000, threshold=65536, hold_ns=5000000, merge_ns=10000000)
    """
    if not backoff.enabled or backoff.burst_hold is None:
        return None
    threshold = backoff.link_threshold
    assert isinstance(threshold, int), "a resolved Backoff"
    hold_ns = int(backoff.burst_hold * 1e9)
    return Settings(drain=max(1, threshold // 8), threshold=THRESHOLD_MIN, hold_ns=hold_ns,
                    merge_ns=MERGE_HOLDS * hold_ns)


@dataclass(frozen=True)
class BurstState:
    """The detector's map at one instant (times: CLOCK_MONOTONIC ns, as ``time.monotonic_ns``)."""

    level: int
    cut_until_ns: int
    cut_start_ns: int
    bursts: int                  # cuts since the detector was loaded
    foreign_bytes: int           # every foreign byte it saw
    held_ns: int                 # how long the cuts before the last one lasted

    def wait_s(self, now_ns: int) -> float:
        """Seconds until the cut ends (0: no cut now)."""
        return max(0, self.cut_until_ns - now_ns) / 1e9

    def held_s(self, now_ns: int) -> float:
        """Seconds the cuts held the pull, the one going on included."""
        last = max(0, min(now_ns, self.cut_until_ns) - self.cut_start_ns) if self.bursts else 0
        return (self.held_ns + last) / 1e9

    def recent(self, now_ns: int, within: float = RECENT) -> bool:
        """A burst was cut for within the last ``within`` seconds (or is now)."""
        return self.bursts > 0 and now_ns - self.cut_until_ns < within * 1e9


def parse_state(values: bytes | memoryview) -> BurstState:
    """The map's memory (``shaping.bpf``'s layout) as a ``BurstState``."""
    def u64(at: int) -> int:
        return int(_U64.unpack_from(values, at)[0])

    return BurstState(u64(LEVEL), u64(CUT_UNTIL), u64(CUT_START), u64(BURSTS), u64(FOREIGN),
                      u64(HELD))


def rhythm_for(settings: Settings, link_bps: int, most: int | None) -> Rhythm:
    """The anticipation of periodic bursts (``agent.yielding.rhythm``) for a detector with
    ``settings`` on a link of ``link_bps`` whose pull windows hold at most ``most`` bytes: the
    readers stop early enough for what the windows granted to drain and for the bucket's
    filling (the cut's start lags the burst's first byte by it), plus a millisecond."""
    per_byte = 8e9 / link_bps                                  # ns per byte at the link's rate
    fill = int(settings.threshold * per_byte)
    drain = int((most or settings.threshold) * per_byte)
    return Rhythm(lead_ns=1_000_000 + fill + drain, grace_ns=1_000_000 + fill)


class BurstGate:
    """The readers' and the backoff loop's view of the detector's map.

    ``values``: the map's memory (``shaping.bpf.Detector.values``); ``floor``: the rate under
    which the readers no longer wait on a cut (the slow path took over, see the docstring);
    ``rhythm``: periodic bursts anticipated from the cuts' starts (None: never)."""

    def __init__(self, values: memoryview, floor: Callable[[], int],
                 clock_ns: Callable[[], int] = time.monotonic_ns,
                 rhythm: Rhythm | None = None) -> None:
        self.values = values
        self.floor = floor
        self.clock_ns = clock_ns
        self.rhythm = rhythm

    def state(self) -> BurstState:
        return parse_state(self.values)

    def hold(self, rate_bps: int | None) -> float:
        """For ``TokenBucket``: seconds a reader at ``rate_bps`` waits before its next chunk."""
        if rate_bps is not None and rate_bps <= self.floor():
            return 0.0
        # two fields of the map, read in place: no system call
        until = _U64.unpack_from(self.values, CUT_UNTIL)[0]
        now = self.clock_ns()
        wait = until - now
        if self.rhythm is not None:
            self.rhythm.see(_U64.unpack_from(self.values, CUT_START)[0])
            wait = max(wait, self.rhythm.wait_ns(now))
        return max(0, wait) / 1e9


class Sustained:
    """Whether the cuts have held the pull for most of every tick over ``SUSTAINED`` seconds:
    fed the detector's state once per tick (``see``), it says so (a flow: the slow path's)."""

    def __init__(self) -> None:
        self.run = 0.0                   # seconds of consecutive mostly-held ticks
        self._last: tuple[int, float] | None = None   # (ns, held_s) at the last tick

    def see(self, state: BurstState, now_ns: int) -> bool:
        held = state.held_s(now_ns)
        if self._last is not None and now_ns > self._last[0]:
            dt = (now_ns - self._last[0]) / 1e9
            mostly = held - self._last[1] >= SUSTAINED_SHARE * dt
            self.run = self.run + dt if mostly else 0.0
        self._last = (now_ns, held)
        return self.run + 1e-6 >= SUSTAINED


def slow_view(readings: Readings, sustained: bool) -> Readings:
    """What the controller judges when the fast path is on: the link's other traffic only
    when it is ``sustained`` (``Sustained``; shorter cuts are bursts, yielded to already), and
    no presence signals (training ports, NCCL: they bound the windows instead). RDMA stays:
    it never passes the detector."""
    links = readings.links if sustained else tuple(replace(r, other_bps=0.0)
                                                   for r in readings.links)
    return replace(readings, links=links, ports=(), nccl=())
