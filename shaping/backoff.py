"""The backoff loop: every tick, read the detectors, run the controller, apply its rate.

The rate goes to three places at once, through callbacks, the fastest first: the pull sockets'
receive windows (``agent.pull.sockets.PullSockets.set_rate``: the sender slows within one round
trip, and the pull's share of the upstream queue stays small), the pulls' token bucket
(``agent.ratelimit.TokenBucket.set_rate``) and the kernel's HTB ceil of the distribution class
(``shaping.shaper.Shaper.set_ceil``), the hard cap. Any may be None (no shaping on this node; a
daemon with nothing pulling). The clock and the sleep are passed in, so a test drives ticks by
hand with ``tick()``; ``start()`` runs them on a thread.

    loop = BackoffLoop(Controller(policy.backoff, cap_for(policy)),
                       Detectors.from_policy(policy.backoff, policy.shaping.interfaces),
                       set_windows=REGISTRY.set_rate, set_kernel_ceil=shaper.set_ceil,
                       set_pull_rate=BucketRate(bucket), distribution=shaper.counters,
                       streams=REGISTRY.sample, tick=policy.backoff.tick)
    loop.start() ... loop.update(new_policy) ... loop.stop()
    loop.decision   # Decision(rate_bps=10000000, state="backed_off", reason="...", ...)
    loop.status()   # plain values for status --json and metrics

``start_for_pull`` and ``pull_backoff`` build exactly that around one ``wagent pull``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from agent.policy.model import Backoff, Policy, Source
from agent.pull.sockets import REGISTRY, PullSockets, StreamsSample
from agent.units import format_rate
from shaping.controller import Controller, Decision
from shaping.detect import Detectors
from shaping.detect.link import Counters
from shaping.detect.readings import Readings

log = logging.getLogger("wagent.backoff")

RateSink = Callable[[int], Any]
DistributionSource = Callable[[], Mapping[str, Counters] | None]
MIN_TICK = 0.01
HISTORY = 600  # decisions kept for status and benchmarks (1 min at the default 100 ms)


@dataclass(frozen=True)
class Applied:
    """One tick as it happened, for status, metrics and the yield benchmark."""

    at: float
    rate_bps: int
    state: str
    reason: str
    signals: tuple[str, ...] = ()


class BackoffLoop:
    def __init__(self, controller: Controller, detectors: Detectors, *,
                 set_kernel_ceil: RateSink | None = None, set_pull_rate: RateSink | None = None,
                 set_windows: RateSink | None = None,
                 distribution: DistributionSource | None = None,
                 streams: Callable[[], StreamsSample] | None = None, tick: float = 0.1,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] | None = None) -> None:
        self.controller = controller
        self.detectors = detectors
        self.sinks: dict[str, RateSink] = {}
        # The windows first: they act within a round trip; the bucket next; the ceil (the hard
        # cap, a netlink request) last.
        if set_windows is not None:
            self.sinks["receive windows"] = set_windows
        if set_pull_rate is not None:
            self.sinks["pull rate"] = set_pull_rate
        if set_kernel_ceil is not None:
            self.sinks["kernel ceil"] = set_kernel_ceil
        self.distribution = distribution
        self.streams_source = streams
        self.streams: StreamsSample | None = None
        self.tick_s = max(MIN_TICK, float(tick))
        self._clock = clock
        self._stop = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop.wait
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._applied: dict[str, int] = {}    # what each sink last accepted
        self.decision: Decision | None = None
        self.readings: Readings | None = None
        self.history: deque[Applied] = deque(maxlen=HISTORY)
        self.ticks = 0
        self.apply_errors = 0
        self.last_error: str | None = None

    @property
    def events(self) -> int:
        """How many times training traffic made the loop back off."""
        return self.controller.events

    def tick(self) -> Decision:
        """One tick: sample, decide, apply (sinks that failed last time are retried)."""
        now = self._clock()
        # The link detector calls the distribution counters itself, between two reads of the
        # interface counters; a failure there is reported like any detector's.
        readings = self.detectors.sample(now, self.distribution)
        decision = self.controller.step(readings, now)
        for name, sink in self.sinks.items():
            # A sink that can say what it holds is trusted over our memory of it: someone else
            # (a --rate given at start, a reload) may have moved it since.
            current = getattr(sink, "current", None)
            try:
                held = current() if callable(current) else self._applied.get(name)
                if held == decision.rate_bps:
                    continue
                sink(decision.rate_bps)
            except Exception as e:  # keep the other side moving; retried next tick
                self.apply_errors += 1
                self._note_error(f"setting {name} to {format_rate(decision.rate_bps)}: {e}")
                self._applied.pop(name, None)
            else:
                self._applied[name] = decision.rate_bps
        if decision.changed:
            log.info("distribution rate %s (%s): %s", format_rate(decision.rate_bps),
                     decision.state, decision.reason)
        for err in readings.errors:
            self._note_error(err)
        streams = None
        if self.streams_source is not None:
            try:   # the pull sockets' RTTs and windows, for status (and the windows' RTT)
                streams = self.streams_source()
            except Exception as e:
                self._note_error(f"reading the pull sockets: {e}")
        with self._lock:
            self.decision, self.readings, self.streams = decision, readings, streams
            self.history.append(Applied(now, decision.rate_bps, decision.state, decision.reason,
                                        decision.signals))
            self.ticks += 1
        return decision

    def run(self) -> None:
        """Tick until ``stop()``; ticks keep to a grid so a slow tick doesn't drift the rest."""
        next_at = self._clock()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # never let the loop die: distribution would stay where it is
                log.exception("backoff tick failed")
            next_at += self.tick_s
            now = self._clock()
            if next_at < now:
                next_at = now  # fell behind (a suspended VM, a busy host): don't burst to catch up
            self._sleep(next_at - now)

    def update(self, policy: Policy, rate: int | None = None) -> None:
        """A reloaded policy: new thresholds, cap, tick and detectors; the state carries on
        (a node backed off for training stays backed off)."""
        with self._lock:
            self.controller.link = policy.shaping.link_rate
            self.controller.backoff = policy.backoff
            self.controller.set_cap(cap_for(policy, rate))
            self.detectors = Detectors.from_policy(policy.backoff, policy.shaping.interfaces,
                                                   link=self.detectors.link is not None)
            self.tick_s = max(MIN_TICK, float(policy.backoff.tick))

    def start(self) -> BackoffLoop:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="wagent-backoff", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        """The thread is running (for the daemon's health check)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> dict[str, Any]:
        """Plain values for ``wagent status --json`` and the metrics."""
        with self._lock:
            d, r, st = self.decision, self.readings, self.streams
        return {
            "state": d.state if d else "full",
            "rate_bps": d.rate_bps if d else self.controller.cap,
            "reason": d.reason if d else "not started",
            "since": d.since if d else None,
            "events": self.events,
            "events_by_signal": dict(self.controller.events_by_signal),
            "ticks": self.ticks,
            "cap_bps": self.controller.cap,
            "floor_bps": self.controller.floor,
            "apply_errors": self.apply_errors,
            "last_error": self.last_error,
            "training_connections": r.training_connections if r else 0,
            "other_bps": max((x.other_bps for x in r.links), default=0.0) if r else 0.0,
            "rdma_bps": max((x.bps for x in r.rdma), default=0.0) if r else 0.0,
            "nccl_processes": len(r.nccl) if r else 0,
            "pull_streams": st.streams if st else 0,
            "pull_min_rtt_us": st.min_rtt_us if st else None,
            "pull_rtt_us": st.rtt_us if st else None,
            "pull_window_bytes": st.window if st else None,
        }

    def _note_error(self, text: str) -> None:
        if text != self.last_error:
            log.warning("backoff: %s", text)
        self.last_error = text


def cap_for(policy: Policy, rate: int | None = None) -> int:
    """The rate the loop climbs back to: ``backoff.cap``, else ``shaping.ceil``; never above an
    explicit ``rate`` (``wagent pull --rate``) or the static ``pulls.rate``."""
    cap = policy.backoff.cap if policy.backoff.cap is not None else policy.shaping.ceil
    for limit in (rate, policy.pulls.rate):
        if limit is not None:
            cap = min(cap, limit)
    return cap


class BucketRate:
    """The pulls' token bucket as a rate sink that can say what it holds (see ``tick``)."""

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket

    def __call__(self, bits_per_s: int) -> None:
        self.bucket.set_rate(bits_per_s)

    def current(self) -> int | None:
        return self.bucket.rate


def start_for_pull(policy: Policy, bucket: Any, shaper: Any | None = None, *,
                   rate: int | None = None, bytes_read: Callable[[], int] | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   sockets: PullSockets | None = REGISTRY) -> BackoffLoop | None:
    """Run the policy's backoff beside a pull (``wagent pull --policy`` and the daemon alike);
    None when backoff is disabled (then the pull sockets' windows are left to the kernel).

    ``bucket`` is the pull's ``TokenBucket`` (``set_rate(bits_per_s)``, ``rate``); ``shaper`` the
    applied ``shaping.shaper.Shaper`` (``set_ceil``, ``counters``) or None without kernel
    shaping; ``sockets`` the registry of the pull's sockets, whose receive windows follow the
    rate. The link detector needs the distribution's own bytes to tell other traffic from ours:
    the shaper's ingress counters (exact), else the pull sockets' received bytes, else
    ``bytes_read()`` (the pull's bytes as read), on a single interface; without any it stays
    off, and the ports, RDMA and NCCL detectors still count.
    """
    backoff: Backoff = policy.backoff
    if not backoff.enabled:
        if sockets is not None:
            sockets.set_rate(None)
        return None
    interfaces = tuple(policy.shaping.interfaces)
    distribution: DistributionSource | None = None
    if shaper is not None:
        distribution = shaper_distribution(shaper, interfaces)
    elif len(interfaces) == 1 and (sockets is not None or bytes_read is not None):
        ifname = interfaces[0]

        def distribution() -> Mapping[str, Counters]:
            # Payload bytes against the link's rx_bytes (headers included): the ACK share
            # allowance and the thresholds absorb the difference.
            if sockets is not None:
                return {ifname: (sockets.sample().bytes_received, 0)}
            assert bytes_read is not None
            return {ifname: (int(bytes_read()), 0)}

    if sockets is not None:
        sockets.budget_s = backoff.queue_budget
    detectors = Detectors.from_policy(backoff, interfaces, link=distribution is not None)
    controller = Controller(backoff, cap_for(policy, rate), link_bps=policy.shaping.link_rate)
    loop = BackoffLoop(controller, detectors,
                       set_kernel_ceil=shaper.set_ceil if shaper is not None else None,
                       set_pull_rate=BucketRate(bucket) if bucket is not None else None,
                       set_windows=sockets.set_rate if sockets is not None else None,
                       distribution=distribution,
                       streams=sockets.sample if sockets is not None else None,
                       tick=backoff.tick, clock=clock)
    return loop.start()


@contextmanager
def pull_backoff(policy: Policy, bucket: Any, *, rate: int | None = None,
                 sources: Sequence[Source] = ()) -> Iterator[BackoffLoop | None]:
    """Shaping and backoff around one CLI pull (``wagent pull --policy P``).

    With ``shaping.enabled`` the policy's trees are applied first (wagent's existing tree is
    adopted), so the kernel's ceil backs off with the pull's bucket; a tree this pull made is
    cleared afterwards, one that was there before (the daemon's) gets its ceil back.
    ``sources`` are the pull's own, added to the policy's for the ingress match.
    Raises ``shaping.errors.ShapingError`` when shaping can't be applied (e.g. no CAP_NET_ADMIN).
    """
    shaper = None
    made = False
    if policy.shaping.enabled:
        from shaping import state
        from shaping.shaper import Shaper

        known = {s.url for s in policy.sources}
        shaper = Shaper(policy.shaping, (*policy.sources, *(s for s in sources
                                                             if s.url not in known)),
                        policy.state_dir)
        before = state.load(policy.state_dir)
        made = not any(i in before for i in policy.shaping.interfaces)
        shaper.apply()
    loop = None
    try:
        loop = start_for_pull(policy, bucket, shaper, rate=rate)
        yield loop
    finally:
        if loop is not None:
            loop.stop()
        if shaper is not None:
            try:
                if made:
                    shaper.clear()
                else:
                    shaper.set_ceil(policy.shaping.ceil)
            except Exception as e:  # the pull's own outcome matters more; say what is left
                log.warning("shaping left in place after the pull (%s); remove it with "
                            "`wagent shaping clear --policy %s`", e, policy.path or "POLICY")
            finally:
                shaper.close()


def shaper_distribution(shaper: Any, interfaces: Sequence[str]) -> DistributionSource:
    """The distribution's counters per interface: ``Shaper.counters()`` (the ingress hook's
    exact counters), else the classes' counters from ``Shaper.stats()``."""
    counters = getattr(shaper, "counters", None)
    if callable(counters):
        return counters

    def read() -> Mapping[str, Counters]:
        return distribution_bytes(shaper.stats(), interfaces)

    return read


def distribution_bytes(stats: Iterable[Any], interfaces: Sequence[str]) -> dict[str, tuple[int,
                                                                                         int]]:
    """The bytes that reached the distribution classes, per interface: an IFB's tree
    (``wg-eth0``) shapes what ``eth0`` receives, a tree on ``eth0`` itself what it sends.

    HTB counts a class's bytes when they leave it; the interface counted them on arrival. So the
    bytes queued in the class (backlog) and those it dropped (drops times the mean packet size)
    are added: without them a queue building up at the cap looks like other traffic.
    """
    from shaping.plan import ifb_name

    ifbs = {ifb_name(i): i for i in interfaces}
    out: dict[str, tuple[int, int]] = {}
    for st in stats:
        if st.name != "distribution":
            continue
        mean_packet = st.bytes // st.packets if st.packets else 1500
        arrived = st.bytes + st.backlog + st.drops * mean_packet
        if st.device in ifbs:
            name = ifbs[st.device]
            rx, tx = out.get(name, (0, 0))
            out[name] = (rx + arrived, tx)
        else:
            rx, tx = out.get(st.device, (0, 0))
            out[st.device] = (rx, tx + arrived)
    return out
