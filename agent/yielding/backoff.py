"""The backoff loop: every tick, read the detectors, run the controller, apply its rate.

The rate goes to three places at once, through callbacks, the fastest first: the pull sockets'
receive windows (``agent.yielding.sockets.PullSockets.set_rate``: the sender slows within one
round trip, and the pull's share of the upstream queue stays small), the pulls' token bucket
(``agent.yielding.ratelimit.TokenBucket.set_rate``) and the kernel's HTB ceil of the
distribution class (``shaping.shaper.Shaper.set_ceil``), the hard cap. Any may be None (no
shaping on this node; a daemon with nothing pulling). The clock and the sleep are passed in, so
a test drives ticks by hand with ``tick()``; ``start()`` runs them on a thread.

    loop = BackoffLoop(Controller(policy.backoff, cap_for(policy)),
                       Detectors.from_policy(policy.backoff, policy.shaping.interfaces),
                       set_windows=sockets.set_rate,
                       set_pull_rate=Knob(bucket.set_rate, lambda: bucket.rate),
                       set_kernel_ceil=Knob(shaper.set_ceil, lambda: shaper.ceil),
                       distribution=shaper.counters, streams=sockets.sample,
                       tick=policy.backoff.tick)
    loop.start() ... loop.update(new_policy) ... loop.stop()
    loop.decision   # Decision(rate_bps=10000000, state="backed_off", reason="...", ...)
    loop.status()   # BackoffStatus(state="backed_off", rate_bps=10000000, events=1, ...)

The loop holds the rate it wants (its controller's decision), never a copy of what a sink
holds: a sink that can say (``current()``) is asked, one that can't is called again whenever
the decision moves or its last call failed. ``agent.yielding.runtime`` builds the loop for the
daemon and for ``wagent pull --policy`` alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.policy.model import Policy
from agent.units import format_rate, resolve_rate
from agent.yielding.account import Account
from agent.yielding.bursts import BurstGate, BurstState, Sustained, slow_view
from agent.yielding.controller import FULL, Controller, Decision, for_readers
from agent.yielding.detect import Detectors
from agent.yielding.detect.readings import Readings
from agent.yielding.sockets import StreamsSample
from shaping.observed import LinkCounters

log = logging.getLogger("wagent.backoff")

RateSink = Callable[[int], Any]     # the receive windows' also takes None: no clamp
WINDOWS = "receive windows"
DistributionSource = Callable[[], Mapping[str, LinkCounters] | None]
MIN_TICK = 0.01
HISTORY = 600  # decisions kept for status and benchmarks (1 min at the default 100 ms)
# An engine's reads come one after another (a shard's header, then its tensors): between two,
# no reader waits for a tick or two. The lift stays that long after the last one waited, so the
# pull doesn't drop to the floor, its streams trickle and the next read start from there.
READERS_GRACE = 1.0


@dataclass(frozen=True)
class Applied:
    """One tick as it happened, for status, metrics and the yield benchmark."""

    at: float
    rate_bps: int
    state: str
    reason: str
    signals: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackoffStatus:
    """The loop as ``BackoffLoop.status()`` sees it, at one moment: its decision, its counts
    and the detectors' last readings. ``agent.snapshot`` turns it into status's ``BackoffInfo``
    (wall-clock times, the readings by their document names)."""

    state: str                          # the controller's: "full", "backed_off", "ramping"
    rate_bps: int                       # the rate it wants now (the cap before the first tick)
    reason: str
    since: float | None                 # the loop's clock (monotonic); None: not started
    events: int                         # times training traffic made it back off
    events_by_signal: Mapping[str, int]
    ticks: int
    cap_bps: int
    floor_bps: int
    apply_errors: int                   # sink calls that raised
    last_error: str | None
    # the detectors' last readings and the pull sockets' last sample
    training_connections: int = 0
    other_bps: float = 0.0              # the busiest interface's other traffic
    rdma_bps: float = 0.0               # the busiest RDMA device's
    nccl_processes: int = 0
    pull_streams: int = 0
    pull_min_rtt_us: int | None = None
    pull_rtt_us: int | None = None
    pull_window_bytes: int | None = None
    history: tuple[Applied, ...] = ()   # the last HISTORY decisions applied, oldest first
    account: Account = field(default_factory=Account)   # what yielding cost (a copy)
    # the fast path's detector at the last tick (None: no fast path), and the time then
    bursts: BurstState | None = None
    bursts_at_ns: int = 0
    fast_path: str = "off"
    anticipated: int = 0                # periodic bursts the readers were held for before they came


class BackoffLoop:
    def __init__(self, controller: Controller, detectors: Detectors, *,
                 set_kernel_ceil: RateSink | None = None, set_pull_rate: RateSink | None = None,
                 set_windows: RateSink | None = None,
                 distribution: DistributionSource | None = None,
                 streams: Callable[[], StreamsSample] | None = None,
                 training_present: Callable[[bool, bool], Any] | None = None,
                 bursts: BurstGate | None = None, tick: float = 0.1,
                 readers_waiting: Callable[[], bool] | None = None, read_floor: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] | None = None) -> None:
        """``readers_waiting``: whether a reader of a lazy mount waits for bytes now; while one
        does, the sinks get at least ``read_floor`` bits/s (``controller.for_readers``)."""
        self.controller = controller
        self.readers_waiting = readers_waiting
        self.read_floor = read_floor
        self._readers_at: float | None = None   # the last tick a reader waited
        self.detectors = detectors
        self.sinks: dict[str, RateSink] = {}
        # The windows first: they act within a round trip; the bucket next; the ceil (the hard
        # cap, a netlink request) last.
        if set_windows is not None:
            self.sinks[WINDOWS] = set_windows
        if set_pull_rate is not None:
            self.sinks["pull rate"] = set_pull_rate
        if set_kernel_ceil is not None:
            self.sinks["kernel ceil"] = set_kernel_ceil
        self.distribution = distribution
        self.streams_source = streams
        # told each tick whether training is on this node (the pull sockets bound their windows
        # only then) and whether its bursts come at a known rhythm; None until the first tick
        self.training_present = training_present
        self._present: tuple[bool, bool] | None = None
        # the fast path's detector (agent.yielding.bursts): with it, bursts are its and the
        # controller judges only sustained traffic and RDMA; None: the controller judges all
        self.bursts = bursts
        self.burst_state: BurstState | None = None
        self._sustained = Sustained()
        self.fast_path = "off"            # where the detector watches, or why it doesn't
        self._bursts_at = 0
        self.streams: StreamsSample | None = None
        self.tick_s = max(MIN_TICK, float(tick))
        self._clock = clock
        self._stop = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop.wait
        self._lock = threading.Lock()     # what status reads: decision, readings, history
        self._tune = threading.Lock()     # controller and detectors: a tick against update()
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()    # sinks whose last call raised: called again
        # (backoff, interfaces) the detectors were built for; None: unknown, rebuilt on update
        self.watching: tuple[Any, ...] | None = None
        self.decision: Decision | None = None
        self.readings: Readings | None = None
        self.history: deque[Applied] = deque(maxlen=HISTORY)
        self.ticks = 0
        self.apply_errors = 0
        self.last_error: str | None = None
        self.account = Account()
        self._last_tick: float | None = None

    @property
    def hold_floor(self) -> int:
        """The rate at and under which the fast path no longer holds the readers on a cut: the
        controller's floor, or the rate a waiting reader lifted the pull to (its bytes don't
        wait out the link's other traffic's bursts either)."""
        d = self.decision
        return d.rate_bps if d is not None and d.lifted else self.controller.floor

    @property
    def events(self) -> int:
        """How many times training traffic made the loop back off."""
        return self.controller.events

    def tick(self) -> Decision:
        """One tick: sample, decide, apply (sinks that failed last time are retried)."""
        now = self._clock()
        gate, bursts, now_ns = self.bursts, None, 0
        if gate is not None:
            try:
                bursts, now_ns = gate.state(), gate.clock_ns()
            except Exception as e:   # the map gone under us: the controller judges all
                self._note_error(f"reading the burst detector: {e}")
        with self._tune:
            # The link detector calls the distribution counters itself, between two reads of
            # the interface counters; a failure there is reported like any detector's.
            readings = self.detectors.sample(now, self.distribution)
            before = self.decision
            judged = readings if bursts is None else slow_view(
                readings, self._sustained.see(bursts, now_ns))
            decision = self.controller.step(judged, now)
            if self.readers_waiting is not None and self.readers_waiting():
                self._readers_at = now
            if self.read_floor and self._readers_at is not None \
                    and now - self._readers_at < READERS_GRACE:
                decision = for_readers(decision, self.read_floor, self.controller.cap)
        moved = before is None or (before.rate_bps, before.lifted) != (decision.rate_bps,
                                                                       decision.lifted)
        for name, sink in self.sinks.items():
            if name == WINDOWS and decision.lifted:
                # For a waiting reader the pull competes with the link's other traffic: windows
                # sized for the base RTT would leave it a trickle behind that traffic's queue.
                # The bucket holds it to the lifted rate.
                if moved or name in self._failed:
                    self._apply(name, sink, None)
                continue
            # A sink that can say what it holds is trusted over the decision's history: someone
            # else (a --rate given at start, a reload) may have moved it since.
            current = getattr(sink, "current", None)
            try:
                if callable(current):
                    if current() == decision.rate_bps:
                        continue
                elif not moved and name not in self._failed:
                    continue
            except Exception as e:  # keep the other side moving; retried next tick
                self.apply_errors += 1
                self._note_error(f"reading {name}: {e}")
                self._failed.add(name)
                continue
            self._apply(name, sink, decision.rate_bps)
        if decision.changed or (before is not None and before.lifted != decision.lifted):
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
        # what the tick that just ended ran under
        was_present = self._present is not None and self._present[0]
        present = (readings.training_connections > 0 or bool(readings.nccl)
                   or (not decision.lifted and (decision.state != FULL or (
                       bursts is not None and bursts.recent(now_ns)))))
        # the readers stop before its bursts now: they come at a rhythm (agent.yielding.rhythm).
        # The windows grow only between bursts: grown while the readers are held, they would
        # let the senders into the burst.
        was_announced = self._present is not None and self._present[1]
        announced = (present and gate is not None and gate.rhythm is not None
                     and gate.rhythm.period_ns() is not None
                     and (was_announced or gate.hold(None) == 0))
        if self.training_present is not None and (present, announced) != self._present:
            try:
                self.training_present(present, announced)
                self._present = (present, announced)
            except Exception as e:  # retried next tick
                on = "on" if present else "off"
                self._note_error(f"telling the pull sockets training is {on}: {e}")
        busiest = max(readings.links, key=lambda r: r.other_bps, default=None)
        with self._lock:
            self.decision, self.readings, self.streams = decision, readings, streams
            self.burst_state, self._bursts_at = bursts, now_ns
            self.history.append(Applied(now, decision.rate_bps, decision.state, decision.reason,
                                        decision.signals))
            self.ticks += 1
            # the tick that just ended was held at the rate the previous one set
            self.account.add(
                0.0 if self._last_tick is None else now - self._last_tick,
                link_bps=self.controller.link,
                other_bps=None if busiest is None else busiest.other_bps,
                distribution_bps=None if busiest is None else busiest.distribution_bps,
                yielded=before is not None and before.state != FULL,
                training=was_present,
                over=busiest is not None
                and busiest.other_bps >= self.controller.backoff.link_threshold)
            self._last_tick = now
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
        """A reloaded policy: new thresholds, cap and tick; the state carries on (a node backed
        off for training stays backed off). The detectors are rebuilt only when what they
        watch changed: a new one has no previous counters and reads nothing for a tick."""
        with self._tune:
            c = self.controller
            watching = (policy.backoff, tuple(policy.shaping.interfaces))
            rebuild, self.watching = watching != self.watching, watching
            c.link = policy.shaping.link_rate
            c.backoff = policy.backoff
            c.set_cap(cap_for(policy, rate))
            self.read_floor = read_floor_for(policy)
            if rebuild:
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

    def status(self) -> BackoffStatus:
        """What the loop says now, for ``wagent status`` and the daemon's STATUS= line."""
        with self._lock:
            d, r, st = self.decision, self.readings, self.streams
            history = tuple(self.history)
            account = replace(self.account)
            bursts, bursts_at = self.burst_state, self._bursts_at
        return BackoffStatus(
            state=d.state if d else "full",
            rate_bps=d.rate_bps if d else self.controller.cap,
            reason=d.reason if d else "not started",
            since=d.since if d else None,
            events=self.events,
            events_by_signal=dict(self.controller.events_by_signal),
            ticks=self.ticks,
            cap_bps=self.controller.cap,
            floor_bps=self.controller.floor,
            apply_errors=self.apply_errors,
            last_error=self.last_error,
            training_connections=r.training_connections if r else 0,
            other_bps=max((x.other_bps for x in r.links), default=0.0) if r else 0.0,
            rdma_bps=max((x.bps for x in r.rdma), default=0.0) if r else 0.0,
            nccl_processes=len(r.nccl) if r else 0,
            pull_streams=st.streams if st else 0,
            pull_min_rtt_us=st.min_rtt_us if st else None,
            pull_rtt_us=st.rtt_us if st else None,
            pull_window_bytes=st.window if st else None,
            history=history,
            account=account,
            bursts=bursts,
            bursts_at_ns=bursts_at,
            fast_path=self.fast_path,
            anticipated=self._anticipated(),
        )

    def _apply(self, name: str, sink: RateSink, rate: int | None) -> None:
        try:
            sink(rate)
        except Exception as e:  # keep the other side moving; retried next tick
            self.apply_errors += 1
            what = format_rate(rate) if rate is not None else "no limit"
            self._note_error(f"setting {name} to {what}: {e}")
            self._failed.add(name)
        else:
            self._failed.discard(name)

    def _anticipated(self) -> int:
        gate = self.bursts
        return gate.rhythm.anticipated if gate is not None and gate.rhythm is not None else 0

    def _note_error(self, text: str) -> None:
        if text != self.last_error:
            log.warning("backoff: %s", text)
        self.last_error = text


def read_floor_for(policy: Policy) -> int:
    """``mounts.read_floor`` in bits/s (a share of the link resolved by the ``Policy``); 0 for
    none."""
    return resolve_rate(policy.mounts.read_floor, policy.shaping.link_rate) or 0


def cap_for(policy: Policy, rate: int | None = None) -> int:
    """The rate the loop climbs back to: ``backoff.cap``, else ``shaping.ceil``; never above an
    explicit ``rate`` (``wagent pull --rate``) or the static ``pulls.rate``."""
    cap = policy.backoff.cap if policy.backoff.cap is not None else policy.shaping.ceil
    for limit in (rate, policy.pulls.rate):
        if limit is not None:
            cap = min(cap, limit)
    return cap


class Knob:
    """A rate sink that can say what it holds (see ``tick``), e.g. a token bucket:
    ``Knob(bucket.set_rate, lambda: bucket.rate)``."""

    def __init__(self, set_rate: Callable[[int], Any], current: Callable[[], int | None]) -> None:
        self._set = set_rate
        self.current = current

    def __call__(self, bits_per_s: int) -> None:
        self._set(bits_per_s)
