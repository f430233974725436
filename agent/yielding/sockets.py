"""The pull streams' own sockets: their receive windows (a lever) and their TCP_INFO (a signal).

The bottleneck a pull crosses is upstream of this node (a switch or router queue). A cap on this
node (the IFB's HTB ceil, the token bucket) acts only on packets that already crossed it: the
sender slows after losses or a full receive buffer, many round trips later, and meanwhile the
pull's data fills the upstream queue, where a new training flow waits behind it and starts
starved. What the receiver does control, within one round trip, is the window it advertises:
a sender never has more than that in flight. So every pull socket's window is clamped
(``TCP_WINDOW_CLAMP``) to its share of what the controller allows over one round trip plus a
small queue budget: the pull then holds at most ``rate x budget`` bytes in any queue on its path,
however deep, and a new flow gets through at once (the receiver-driven LEDBAT idea, without its
delay controller: the clamp follows the backoff controller's rate). The round trip is the base
RTT of the path to the socket's peer, remembered across connections (``agent.yielding.base_rtt``):
a socket's own minimum includes any queue that was standing when it opened.

Linux never retracts a window it advertised: a lower clamp takes effect as the data already
allowed drains (one round trip). Two knobs set the window, because kernels differ:
``TCP_WINDOW_CLAMP`` bounds it exactly, but receive autotuning sets the clamp again from the
buffer's size whenever it grows the buffer (6.1 too), and newer kernels also whenever the
measured payload/truesize ratio changes, undoing ours within milliseconds (measured on 6.18: a
clamp of 5792 read back 11267); ``SO_RCVBUF`` bounds the window on every kernel (a window never
exceeds the free buffer), and fixing it also turns autotuning off. So each socket gets the
clamp ``w`` and a buffer that gives a window of ``w``: twice ``w`` on 6.1 (half of a buffer is
window there), about ``w`` on kernels that measure the ratio, learned from the clamp they set
back (``sample``). The buffer is
set with SO_RCVBUFFORCE where the process may (CAP_NET_ADMIN, which shaping needs anyway), else
SO_RCVBUF up to ``net.core.rmem_max``. A buffer that small also couples the window to the
reader: a pull held by its token bucket reads slowly, its buffer stays full and its sender is
held within a round trip too, not after the ingress cap has dropped what crossed the
bottleneck; a reader that falls behind (GIL, hashing, a disk) costs throughput, which the
budget covers. See docs/design.md, "Yielding to training traffic", for the measurements.

One registry per owner of pulls (the daemon's ``Application``, a ``wagent pull``), no process
global: the pulls' connections (``agent.pull.connections``) call ``register`` with each socket
once connected; the backoff loop, handed the same registry, calls ``set_rate`` and ``sample``.

    sockets = PullSockets()
    sockets.register(sock)         # the HTTP layer, each new connection
    sockets.set_rate(10**7)        # every live pull socket: window for 10 Mbit/s
    sockets.sample()               # -> StreamsSample(streams=8, min_rtt_us=31, ...)

The arithmetic is pure (``window_for``); the class is the thin adapter around setsockopt and
getsockopt.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.policy.model import Backoff
from agent.yielding.base_rtt import BaseRtts
from agent.yielding.bursts import THRESHOLD_MIN

log = logging.getLogger(__name__)

TCP_WINDOW_CLAMP = getattr(socket, "TCP_WINDOW_CLAMP", 10)
TCP_INFO = getattr(socket, "TCP_INFO", 11)
TCP_INFO_LEN = 256               # more than any kernel's struct tcp_info; it copies what it has
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)   # SO_RCVBUF past rmem_max (CAP_NET_ADMIN)
TCP_RMEM = "/proc/sys/net/ipv4/tcp_rmem"
# Bytes of window per byte of receive buffer: half (tcp_adv_win_scale = 1) until Linux 6.6; since
# then the kernel measures it (payload / truesize, near 1 with GRO) and says so by setting the
# clamp from the buffer, which ``sample`` learns from.
DEFAULT_SCALE = 0.5
LEARN_EVERY = 10                 # samples between looks at what the kernel did with the clamp
# A socket that received nothing for this long no longer counts among those the windows share
# the rate by; one that starts again holds its last window (a share among one more socket) until
# the next sample, a backoff tick later.
ACTIVE_FOR = 1.0

DEFAULT_MSS = 1448               # 1500-byte MTU, IPv4, TCP timestamps
MIN_SEGMENTS = 4                 # never clamp below this many segments: fewer stalls on a loss
# The queue budget: how much standing queue (in seconds at the allowed rate) the pull may keep at
# the bottleneck on top of one round trip in flight. It also covers what the base RTT leaves
# out: the receiver's own delay in sending ACKs (softirq, GRO batches, a busy CPU). See
# docs/design.md, "Yielding to training traffic", for how it was chosen.
QUEUE_BUDGET = 0.001             # the policy's default (backoff.queue_budget)
# What the windows cover at least, on any link: on a slow one the budget's millisecond is a few
# segments, and a reader that stalls for longer (a busy CPU, the GIL: a Python thread's wake-ups
# came late by p99 2.4 ms alone and 22 ms behind another thread of the process) leaves the link
# idle. So the queue they may keep is at least READER_STALL of the allowed rate, up to the
# larger of LEAST_TOTAL (what the fast path's detector lets through before it cuts anyway: its
# bucket, 64 KiB) and what the burst rule allows the windows together (``most_in_flight``:
# BURST_SHARE of the policy's smallest burst, 120 kB for the default 4 MB): a floor that slows
# the smallest burst no more than the windows of a 1 Gbit/s link already may. From about
# 1 Gbit/s the budget gives more; the burst bounds (``most``) cap it like the rest while the
# node trains. Measured on the peers bench (40 Mbit/s links, where a millisecond is 4
# segments; 25 daemons on 2 cores): 64 KiB took the last node at 24 nodes from 2.79-3.04 S/B
# to 2.32-2.49; 100 kB (issue 27, 2026-12-07) from 2.09-2.32 to 1.90-1.97, the same session;
# at 8 and 16 nodes no change.
READER_STALL = 0.020
LEAST_TOTAL = THRESHOLD_MIN
# What a window granted still arrives after a cut (Linux never retracts one; 6.5's
# tcp_shrink_window is off by default): a burst that starts then waits behind it. So what the
# pull's windows put in a burst's way stays under this share of the smallest burst the policy
# protects (backoff.smallest_burst): a burst is slowed by at most about that much.
BURST_SHARE = 0.03

# struct tcp_info offsets (include/uapi/linux/tcp.h); fields past the end of what an older
# kernel returns read as None.
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_FIELDS = {
    "rcv_mss": (20, _U32),
    "rtt_us": (68, _U32),            # smoothed RTT of what this end sent (the requests)
    "advmss": (84, _U32),            # the MSS this end advertised: its path's MTU
    "rcv_rtt_us": (92, _U32),        # the receiver's own estimate (timestamps, ms granularity)
    "bytes_received": (128, _U64),   # Linux 4.1
    "min_rtt_us": (148, _U32),       # Linux 4.10; windowed minimum (tcp_min_rtt_wlen)
}


@dataclass(frozen=True)
class TcpInfo:
    """What one pull socket's TCP_INFO says (None: this kernel doesn't report it)."""

    rcv_mss: int | None = None
    rtt_us: int | None = None
    advmss: int | None = None
    rcv_rtt_us: int | None = None
    bytes_received: int | None = None
    min_rtt_us: int | None = None


def parse_tcp_info(raw: bytes) -> TcpInfo:
    values: dict[str, int | None] = {}
    for name, (off, st) in _FIELDS.items():
        values[name] = st.unpack_from(raw, off)[0] if len(raw) >= off + st.size else None
    return TcpInfo(**values)


@dataclass(frozen=True)
class StreamsSample:
    """The live pull sockets at one instant."""

    streams: int = 0
    min_rtt_us: int | None = None        # lowest tcpi_min_rtt among them
    rtt_us: int | None = None            # median smoothed RTT
    rcv_rtt_us: int | None = None        # median receiver-side RTT estimate
    bytes_received: int = 0              # cumulative, every socket ever registered
    window: int | None = None            # the largest clamp a socket has now (bytes), None: none


def window_for(rate_bps: int | None, base_rtt_s: float | None, streams: int,
               mss: int = DEFAULT_MSS, budget_s: float = QUEUE_BUDGET,
               most: int | None = None, least: int = LEAST_TOTAL) -> int | None:
    """Bytes each of ``streams`` sockets may have in flight so that together they carry
    ``rate_bps`` over ``base_rtt_s`` while queueing at most ``budget_s`` of it (or
    ``READER_STALL`` of it, up to ``least`` bytes, when that is more), and together
    hold at most ``most`` bytes (``BURST_SHARE`` of the smallest burst); at least
    ``MIN_SEGMENTS`` segments each. None: no rate, no clamp.

    >>> window_for(10**9, 50e-6, 8)       # 1 Gbit/s, 50 us: 1.05 ms x 125 MB/s over 8 streams
    16407
    >>> window_for(4 * 10**7, 50e-6, 2)   # 40 Mbit/s: 50 us + 64 KiB (a reader's stall), not 1 ms
    32893
    >>> window_for(4 * 10**7, 50e-6, 2, least=120_000)   # 20 ms, under 3% of a 4 MB burst
    50125
    >>> window_for(10**7, 50e-6, 8)       # 10 Mbit/s: the floor of four segments
    5792
    >>> window_for(10**11, 50e-6, 8, most=120_000)   # 100 Gbit/s, 3% of a 4 MB burst in all
    15000
    """
    if rate_bps is None:
        return None
    rtt = max(0.0, base_rtt_s or 0.0)
    queue = max(rate_bps / 8 * budget_s, min(least, rate_bps / 8 * READER_STALL))
    total = rate_bps / 8 * rtt + queue
    if most:
        total = min(total, most)
    return max(MIN_SEGMENTS * mss, math.ceil(total / max(1, streams)))


class _Entry:
    __slots__ = ("ref", "peer", "base", "applied", "received", "mss", "active_until")

    def __init__(self, ref: weakref.ref[socket.socket], peer: str, now: float) -> None:
        self.ref = ref
        # until when it counts among the sockets the rate is shared by: a new one, and one
        # that received bytes within ACTIVE_FOR (sampled each backoff tick)
        self.active_until = now + ACTIVE_FOR
        self.peer = peer                 # the remote address ("" if unknown)
        self.base: float | None = None   # the base RTT its window was sized for (seconds)
        self.applied: int | None = None  # the window set on it (None: the kernel's own)
        self.received = 0                # bytes_received when last sampled
        # its segments' size (TCP_INFO advmss, from the route's MTU): a window is never under
        # MIN_SEGMENTS of them. With a 1500-byte MTU's 1448 assumed, a 9000-byte (jumbo) or
        # loopback path got windows under two segments, and the sender's silly-window
        # avoidance then waits for delayed ACKs: measured on loopback, 8 streams from a
        # limit_rate 1m nginx pulled 0.5 MB/s in all instead of 8.
        self.mss: int | None = None


class PullSockets:
    """The registry: sockets come and go with the HTTP connections (weakly held, so a socket
    dropped by its pool is forgotten, its bytes still counted); the clamp follows
    ``set_rate``. ``clock``: monotonic seconds, for the base RTT history."""

    def __init__(self, budget_s: float = QUEUE_BUDGET,
                 clock: Callable[[], float] = time.monotonic,
                 bases: BaseRtts | None = None, most: int | None = None) -> None:
        self.budget_s = budget_s
        self.most = most                 # bytes the windows may hold together (None: no bound)
        self._bucket: int | None = None  # the fast path's bucket (``expect_cuts``)
        # whether training's bursts come at a rhythm the readers stop before (``guard``)
        self._announced = False
        # whether training is on this node (the backoff loop says, each tick): the bound on
        # what the windows hold together protects bursts, and a node without training has none
        self._guarded = True
        self.clock = clock
        self.bases = bases if bases is not None else BaseRtts()
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._dead: collections.deque[int] = collections.deque()  # filled by weakref callbacks
        self._keys = itertools.count()
        self._rate: int | None = None
        self._gone_bytes = 0             # bytes of sockets no longer registered
        self._window: int | None = None
        self._unclamped = tcp_rmem_max()
        self._scale = DEFAULT_SCALE
        self._samples = 0
        self._dirty = False              # the windows must be worked out again (RTT, scale)
        self._applied_n = 0              # sockets the windows were last shared among
        self.errors = 0

    def configure(self, backoff: Backoff) -> None:
        """The policy's queue budget and smallest burst; the windows follow at the next sample."""
        with self._lock:
            self.budget_s = backoff.queue_budget
            self.most = most_in_flight(backoff)
            self._dirty = True

    def expect_cuts(self, bucket: int | None) -> None:
        """The fast path's detector cuts once its bucket holds ``bucket`` foreign bytes (None:
        no fast path): while bursts come unannounced the windows hold less
        (``most_unannounced``)."""
        with self._lock:
            self._bucket = bucket
            self._dirty = True

    # -- the HTTP layer's side ---------------------------------------------------------------
    def register(self, sock: socket.socket) -> None:
        """A new pull connection: it gets the current clamp before its first request, sized
        by what is known of the path to its peer (its handshake's RTT, at least)."""
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
            return
        key = next(self._keys)
        # The callback may run in any thread, at any time (garbage collection): it only queues.
        ref = weakref.ref(sock, lambda _r, key=key: self._dead.append(key))
        try:
            peer = str(sock.getpeername()[0])
        except (OSError, IndexError):
            peer = ""
        info = _tcp_info(sock)
        with self._lock:
            if any(e.ref() is sock for e in self._entries.values()):
                return                           # already known (a connect() called twice)
            if info is not None and info.min_rtt_us:
                self.bases.observe(peer, info.min_rtt_us / 1e6, self.clock())
            self._entries[key] = _Entry(ref, peer, self.clock())
            self._apply_locked()

    # -- the backoff loop's side ---------------------------------------------------------------
    def guard(self, training: bool, announced: bool = False) -> None:
        """Whether training is on this node now (a training port, a process mapping libnccl,
        or the controller backed off or ramping): the windows are bounded only then, so a node
        that never trains pulls at the link's rate on any path. ``announced``: its bursts come
        at a rhythm the readers stop before (``agent.yielding.rhythm``): ``most`` together;
        else ``most_unannounced``."""
        with self._lock:
            if (training, announced) != (self._guarded, self._announced):
                self._guarded, self._announced = training, announced
                self._apply_locked()

    def set_rate(self, rate_bps: int | None) -> None:
        """What the controller allows now (None: no limit); every live socket's clamp follows."""
        with self._lock:
            self._rate = rate_bps
            self._apply_locked()

    @property
    def rate(self) -> int | None:
        return self._rate

    def sample(self) -> StreamsSample:
        """TCP_INFO of every live socket (one getsockopt each); also re-sizes a socket's clamp
        when the base RTT of the path to its peer changed."""
        infos: list[TcpInfo] = []
        with self._lock:
            self._samples += 1
            now = self.clock()
            live = self._live_locked()
            for sock, entry in live:
                info = _tcp_info(sock)
                if info is None:
                    continue
                infos.append(info)
                if info.bytes_received is not None:
                    if info.bytes_received > entry.received:
                        entry.active_until = now + ACTIVE_FOR
                    entry.received = info.bytes_received
                if info.min_rtt_us:
                    self.bases.observe(entry.peer, info.min_rtt_us / 1e6, now)
                if (entry.applied is not None and self._rate is not None
                        and self._samples % LEARN_EVERY == 0):
                    self._learn_scale_locked(sock, entry)
            total = self._gone_bytes + sum(e.received for _, e in live)
            for _, entry in live:
                self._dirty |= self._rebase_locked(entry, now)
            if self._dirty or _active(live, now) != self._applied_n:
                self._apply_locked(live)
            window = self._window
        return StreamsSample(len(infos), _min_of(i.min_rtt_us for i in infos),
                             _median(i.rtt_us for i in infos),
                             _median(i.rcv_rtt_us for i in infos), total, window)

    # -- internals ---------------------------------------------------------------------------
    def _live_locked(self) -> list[tuple[socket.socket, _Entry]]:
        while self._dead:
            entry = self._entries.pop(self._dead.popleft(), None)
            if entry is not None:
                self._gone_bytes += entry.received
        live = []
        for key, entry in list(self._entries.items()):
            sock = entry.ref()
            if sock is None or sock.fileno() < 0:   # closed: its bytes stay counted
                self._gone_bytes += entry.received
                del self._entries[key]
                continue
            live.append((sock, entry))
        return live

    def _rebase_locked(self, entry: _Entry, now: float) -> bool:
        """Takes the base RTT to the entry's peer if it moved by more than 10% (a window set
        again for every microsecond of jitter would be a setsockopt per tick); True if so."""
        base = self.bases.base(entry.peer, now)
        if base is None or (entry.base is not None and abs(base - entry.base) <= 0.1 * entry.base):
            return False
        entry.base = base
        return True

    def _learn_scale_locked(self, sock: socket.socket, entry: _Entry) -> None:
        """A kernel that set the clamp again from the buffer (6.x, see the docstring) says how
        much window a byte of buffer gives: the buffers are sized by that from then on."""
        try:
            clamp = sock.getsockopt(socket.IPPROTO_TCP, TCP_WINDOW_CLAMP)
            buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        except OSError:
            return
        if clamp == entry.applied or buffer <= 0 or clamp <= 0:
            return
        scale = min(1.0, clamp / buffer)
        if abs(scale - self._scale) > 0.1 * self._scale:
            self._scale = scale
            self._dirty = True
            for e in self._entries.values():
                e.applied = None                 # every buffer again, with the new scale

    def _apply_locked(self, live: list[tuple[socket.socket, _Entry]] | None = None) -> None:
        self._dirty = False
        live = self._live_locked() if live is None else live
        now = self.clock()
        # Shared among the sockets that carry bytes, not every one open: a pull's connection
        # pools keep idle sockets (one per source a stream has used; with peers, one per
        # neighbour, and the have-maps' long polls), and counting them cut each busy socket's
        # window to a fraction of its share.
        self._applied_n = _active(live, now)
        most = (None if not self._guarded else self.most if self._announced
                else most_unannounced(self.most, self._bucket))
        least = stall_cap(self.most)
        largest: int | None = None
        for sock, entry in live:
            if entry.base is None:
                self._rebase_locked(entry, now)
            if entry.mss is None:
                info = _tcp_info(sock)
                entry.mss = info.advmss if info is not None and info.advmss else DEFAULT_MSS
            # Each socket carries its share of the rate over its own path's round trip.
            window = window_for(self._rate, entry.base, self._applied_n, mss=entry.mss,
                                budget_s=self.budget_s, most=most, least=least)
            if window is not None:
                largest = max(largest or 0, window)
            # No rate: the window autotuning would reach at most (a fixed buffer can't be
            # handed back to autotuning once set).
            want = window if window is not None else (None if entry.applied is None
                                                      else self._unclamped // 2)
            if want == entry.applied:
                continue
            try:
                set_window(sock, want, self._scale)
            except OSError as e:   # closed under us, or a kernel without it: the caps still hold
                self.errors += 1
                if self.errors == 1:
                    log.warning("can't clamp a pull socket's receive window: %s", e)
                continue
            entry.applied = want
        self._window = largest if live else window_for(self._rate, None, 0,
                                                       budget_s=self.budget_s, most=most,
                                                       least=least)


def most_in_flight(backoff: Backoff) -> int | None:
    """What the pull's windows may hold together under ``backoff`` while the readers stop
    before each burst (its rhythm known: what the windows granted drains before the burst is
    due, ``agent.yielding.bursts.rhythm_for``); None: no bound."""
    if not backoff.smallest_burst:
        return None
    return max(1, int(BURST_SHARE * backoff.smallest_burst))


def stall_cap(most: int | None) -> int:
    """The most the reader-stall floor asks of the windows together (``window_for``'s
    ``least``): the detector's bucket, or the burst rule's share (``most_in_flight``) when
    that is more."""
    return max(LEAST_TOTAL, most or 0)


def most_unannounced(most: int | None, bucket: int | None) -> int | None:
    """What the windows may hold together while bursts come unannounced and the fast path's
    detector cuts once its bucket holds ``bucket`` foreign bytes (None: no fast path, ``most``).

    A burst the detector sees meets the windows twice: they stand in the bottleneck's queue
    when its first byte comes, and what they granted before the cut still arrives after it.
    And while the bucket fills the FIFO shares the link, so the pull takes about as much as
    half the bucket. So ``2 x windows + bucket / 2`` stays under ``most`` (``BURST_SHARE`` of
    the smallest burst). Traced at 1 Gbit/s (6 MB bursts, 2 streams of 60 kB): 4 windows' worth
    met each burst, 2 before the cut and 2 after.

    >>> most_unannounced(120_000, 65_536)
    43616
    """
    if most is None or bucket is None:
        return most
    return max(1, (most - bucket // 2) // 2)


def buffer_for(window: int, scale: float = DEFAULT_SCALE) -> int:
    """The SO_RCVBUF value that gives a window of ``window`` bytes when a byte of buffer gives
    ``scale`` bytes of window (the kernel doubles the value it is given).

    >>> buffer_for(5792), buffer_for(5792, 0.97)
    (5792, 2986)
    """
    return max(1, math.ceil(window / (2 * scale)))


def set_window(sock: socket.socket, window: int, scale: float = DEFAULT_SCALE) -> None:
    """Clamp one socket's receive window to ``window`` bytes (see the module's docstring)."""
    value = buffer_for(window, scale)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, value)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, value)  # capped at rmem_max
    sock.setsockopt(socket.IPPROTO_TCP, TCP_WINDOW_CLAMP, window)


def tcp_rmem_max(path: str = TCP_RMEM) -> int:
    """The largest receive buffer TCP autotuning may grow to (bytes); 6 MiB if unreadable."""
    try:
        with open(path) as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 6 << 20


def _tcp_info(sock: socket.socket) -> TcpInfo | None:
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_LEN))
    except OSError:
        return None


def _min_of(values: Iterable[int | None]) -> int | None:
    vals = [v for v in values if v]
    return min(vals) if vals else None


def _median(values: Iterable[int | None]) -> int | None:
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else None


def _active(live: list[tuple[socket.socket, _Entry]], now: float) -> int:
    return max(1, sum(1 for _, e in live if e.active_until > now))
