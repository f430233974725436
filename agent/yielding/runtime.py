"""The node's shaping while wagent runs: the kernel's caps and the backoff loop that moves them.

One module for the daemon and ``wagent pull --policy`` alike:

    runtime = ShapingRuntime(policy, bucket, sockets=sockets).start()   # caps applied, loop on
    runtime.reconcile(new_policy)     # a reload: caps changed in place, loop retuned
    runtime.verify()                  # the daemon's periodic check that the kernel kept them
    runtime.ceil                      # the kernel's distribution ceil now (None: no shaping)
    runtime.stop()                    # the loop ends; the caps stay (a restart never opens them)

    with around_pull(policy, bucket, sockets=sockets, rate=rate) as loop: ...   # one CLI pull

``sockets``: the pull sockets' registry the pulls' connections fill (its owner's, made by
``agent.pull.connections.Connections``; None: no windows to clamp).

Who owns what: the kernel's distribution ceil is the Shaper's (``Shaper.ceil``, moved only by
``set_ceil`` and ``apply``), and status, metrics and reload read it there through ``ceil``; the
rate the controller wants is the loop's (a failed netlink call can leave the two apart for a
tick, and the loop tries again). The shaper's netlink socket is used from the backoff thread,
the scheduler's jobs and status readers: one at a time, under ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from agent.policy.model import Policy, Source
from agent.yielding.backoff import BackoffLoop, Knob, cap_for, read_floor_for
from agent.yielding.bursts import BurstGate, rhythm_for, settings_for
from agent.yielding.controller import Controller
from agent.yielding.detect import Detectors
from agent.yielding.ratelimit import TokenBucket
from agent.yielding.sockets import PullSockets, most_in_flight
from shaping import state
from shaping.bpf import Detector
from shaping.errors import ShapingError
from shaping.observed import ClassStats, LinkCounters
from shaping.plan import TcPlan

if TYPE_CHECKING:
    from shaping.shaper import Shaper

log = logging.getLogger(__name__)

ShaperFactory = Callable[[Policy, Sequence[Source]], "Shaper"]


def _shaper(policy: Policy, sources: Sequence[Source]) -> Shaper:
    # Imported here: it brings pyroute2 (85 ms of a `wagent pull`'s 270 ms of imports), which
    # a pull without shaping never needs.
    from shaping.shaper import Shaper
    return Shaper(policy.shaping, sources, policy.state_dir)


class ShapingRuntime:
    def __init__(self, policy: Policy, bucket: TokenBucket | None, *,
                 sockets: PullSockets | None,
                 rate: int | None = None, sources: Sequence[Source] = (),
                 bytes_read: Callable[[], int] | None = None,
                 readers_waiting: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 make_shaper: ShaperFactory = _shaper) -> None:
        """``rate``: a bound on the loop's cap (``wagent pull --rate``); ``sources``: a CLI
        pull's own, matched by the ingress filters beside the policy's; ``bytes_read``: the
        pulls' bytes, the link detector's fallback without kernel counters or sockets;
        ``readers_waiting``: whether a reader of a lazy mount waits for bytes now
        (``mounts.read_floor``)."""
        self.policy = policy
        self.bucket = bucket
        self.rate = rate
        self.extra_sources = tuple(sources)
        self.sockets = sockets
        self.bytes_read = bytes_read
        self.readers_waiting = readers_waiting
        self.clock = clock
        self.make_shaper = make_shaper
        self.lock = threading.Lock()
        self.shaper: Shaper | None = None
        self.loop: BackoffLoop | None = None
        self.notes: tuple[str, ...] = ()   # what the last apply said
        self.error: str | None = None      # the last periodic re-apply failed (degraded)
        self.repairs = 0                   # times a re-apply found the kernel changed
        # the fast path (agent.yielding.bursts): the kernel's burst detector and the gate the
        # pull's readers wait on; ``fast_path`` says where it watches, or why it is off
        self.detector: Detector | None = None
        self.gate: BurstGate | None = None
        self.fast_path = "off: not started"

    # -- life ------------------------------------------------------------------------------
    def start(self) -> ShapingRuntime:
        """Apply the policy's caps (adopting wagent's tree from before) and start the loop.
        Raises ``ShapingError`` when the kernel refuses (e.g. no CAP_NET_ADMIN)."""
        with self.lock:
            self._apply(self.policy, None)
        self._start_loop()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """The loop ends; the caps stay in the kernel (``wagent shaping clear`` removes them)."""
        if self.loop is not None:
            self.loop.stop(timeout)
            self.loop = None
        with self.lock:
            self.stop_fast_path("off: stopped")
            if self.shaper is not None:
                self.shaper.close()

    def reconcile(self, new: Policy) -> None:
        """A reload: the caps are changed in place (never removed in between, and the ceil
        the loop set is kept), then the loop is retuned through its own ``update``, keeping
        its state: a node backed off for training stays backed off. Raises, having changed
        nothing, when the kernel refuses the new tree."""
        old = self.policy
        had_shaper = self.shaper is not None
        with self.lock:
            self._apply(new, old)
        self.policy = new
        same_shape = (had_shaper == (self.shaper is not None)
                      and new.shaping.interfaces == old.shaping.interfaces)
        if self.loop is not None and new.backoff.enabled and same_shape:
            self.loop.update(new, self.rate)
            if self.sockets is not None:
                self.sockets.configure(new.backoff)
            with self.lock:
                self._start_fast_path(self.loop)
            return
        if self.loop is not None:
            self.loop.stop(2.0)
            self.loop = None
        with self.lock:
            self.stop_fast_path("off: reloading")
        if self.bucket is not None:
            self.bucket.set_rate(new.pulls.rate)
        self._start_loop()

    def verify(self) -> None:
        """Reconcile the kernel with the plan again (the daemon does every few seconds). An
        interface that was removed and re-created (a driver reset, a bond rebuilt) comes back
        with the kernel's default qdisc and no ingress redirect: unshaped, while set_ceil on
        the IFB still succeeds. An unchanged kernel costs a few dumps and sends nothing."""
        if self.shaper is None:
            return
        try:
            with self.lock:
                report = self.shaper.apply(quiet=True)   # with the ceil the loop set last
        except Exception as e:
            message = f"re-applying the caps failed: {e}"
            if message != self.error:
                log.error("%s", message)
            self.error = message
            return
        self.error = None
        if self.detector is not None:
            try:
                with self.lock:
                    back = self.shaper.attach_detector(self.detector.fd, only_missing=True)
            except ShapingError as e:
                log.error("the burst detector is gone and can't be put back: %s", e)
            else:
                if back:
                    log.warning("the burst detector was gone from %s; put back", ", ".join(back))
        if report.changed:
            self.repairs += 1
            log.warning("the kernel no longer had wagent's caps as planned (an interface "
                        "re-created, tc or `wagent shaping clear` run by hand?); re-applied %d "
                        "change(s). To remove the caps, stop the daemon first",
                        len(report.actions))
        if tuple(report.notes) != self.notes:
            for note in report.notes:
                log.warning("%s", note)
            self.notes = tuple(report.notes)

    # -- what others read ------------------------------------------------------------------
    @property
    def ceil(self) -> int | None:
        """The kernel's distribution ceil now; None without shaping."""
        shaper = self.shaper
        return shaper.ceil if shaper is not None else None

    def stats(self) -> tuple[list[ClassStats], TcPlan]:
        """The classes' counters and the plan they belong to (with the live ceil)."""
        with self.lock:
            if self.shaper is None:
                raise LookupError("no shaping on this node")
            return self.shaper.stats(), self.shaper.plan()

    def set_ceil(self, bits_per_s: int) -> None:
        with self.lock:
            if self.shaper is not None:
                self.shaper.set_ceil(bits_per_s)

    def counters(self) -> Mapping[str, LinkCounters] | None:
        """The ingress hooks' exact counters of the distribution's own bytes."""
        with self.lock:
            return self.shaper.counters() if self.shaper is not None else None

    # -- inside ----------------------------------------------------------------------------
    def _sources(self, policy: Policy) -> tuple[Source, ...]:
        known = {s.url for s in policy.shaped_sources}
        return (*policy.shaped_sources, *(s for s in self.extra_sources if s.url not in known))

    def _apply(self, new: Policy, old: Policy | None) -> None:
        was = old.shaping if old is not None and old.shaping.enabled else None
        if new.shaping.enabled:
            shaper = self.make_shaper(new, self._sources(new))
            keep = None
            if self.shaper is not None:
                # keep the loop's ceil; it retunes from there on its next tick
                keep = min(self.shaper.ceil, new.shaping.ceil)
            report = shaper.apply(ceil=keep)   # adopts wagent's own tree, changes it in place
            if self.shaper is not None:
                self.shaper.close()
            self.shaper = shaper
            self.notes = tuple(report.notes)
            return
        if self.shaper is not None:
            self.shaper.close()
        self.shaper = None
        self.notes = ()
        if was is not None and old is not None:
            # Swept: shaping no longer declared at all. (Interfaces dropped from a policy that
            # still shapes are swept by Shaper.apply itself, from its state records.)
            self.make_shaper(old, self._sources(old)).clear()
            log.info("shaping disabled by the new policy: caps cleared on %s",
                     ", ".join(was.interfaces))

    def _start_loop(self) -> None:
        """The policy's backoff beside the pulls; none when backoff is disabled (the pull
        sockets' windows are then left to the kernel).

        The link detector needs the distribution's own bytes to tell other traffic from ours:
        the shaper's ingress counters (exact), else the pull sockets' received bytes, else
        ``bytes_read()``, on a single interface; without any it stays off, and the ports, RDMA
        and NCCL detectors still count."""
        policy, sockets, bucket = self.policy, self.sockets, self.bucket
        backoff = policy.backoff
        if not backoff.enabled:
            if sockets is not None:
                sockets.set_rate(None)
            with self.lock:
                self.stop_fast_path("off: backoff disabled")
            return
        interfaces = tuple(policy.shaping.interfaces)
        distribution: Callable[[], Mapping[str, LinkCounters] | None] | None = None
        if self.shaper is not None:
            distribution = self.counters
        elif len(interfaces) == 1 and (sockets is not None or self.bytes_read is not None):
            distribution = _pull_bytes(interfaces[0], sockets, self.bytes_read)
        if sockets is not None:
            sockets.configure(backoff)
        detectors = Detectors.from_policy(backoff, interfaces, link=distribution is not None)
        loop = BackoffLoop(Controller(backoff, cap_for(policy, self.rate),
                                      link_bps=policy.shaping.link_rate),
                           detectors,
                           # the kernel's ceil: whatever shaper there is now (a reload replaces
                           # it), what it holds read from the shaper itself
                           set_kernel_ceil=Knob(self.set_ceil, lambda: self.ceil)
                           if self.shaper is not None else None,
                           set_pull_rate=Knob(bucket.set_rate, lambda: bucket.rate)
                           if bucket is not None else None,
                           set_windows=sockets.set_rate if sockets is not None else None,
                           distribution=distribution,
                           streams=sockets.sample if sockets is not None else None,
                           training_present=sockets.guard if sockets is not None else None,
                           tick=backoff.tick, readers_waiting=self.readers_waiting,
                           read_floor=read_floor_for(policy), clock=self.clock)
        loop.watching = (backoff, interfaces)
        with self.lock:
            self._start_fast_path(loop)
        self.loop = loop.start()

    def _start_fast_path(self, loop: BackoffLoop) -> None:
        """The kernel's burst detector on the shaped links' ingress, its settings from the
        loop's (resolved) backoff, and the gate on the bucket; where it can't be (no ingress
        tree, no bucket, a kernel or a process without BPF), the slow path alone, and
        ``fast_path`` says why. Under ``lock``."""
        settings = settings_for(loop.controller.backoff)
        links = self.shaper.detector_links() if self.shaper is not None else []
        why = ("off: backoff.burst_hold is null" if settings is None
               else "off: no shaped ingress (shaping.interfaces, and sources to pull from)"
               if not links else "off: no pulls to hold" if self.bucket is None else None)
        if why is not None or settings is None or self.shaper is None:
            self.stop_fast_path(why or "off")
            loop.fast_path, loop.bursts = self.fast_path, None
            return
        try:
            if self.detector is None:
                self.detector = Detector(settings)
                self.shaper.attach_detector(self.detector.fd)
            else:
                self.detector.configure(settings)
        except ShapingError as e:
            self.stop_fast_path(f"off: {e}")
            log.warning("no fast path (the backoff loop's ticks alone yield to bursts): %s", e)
            loop.fast_path, loop.bursts = self.fast_path, None
            return
        link = loop.controller.link or loop.controller.cap
        most = most_in_flight(loop.controller.backoff)
        if self.gate is None or self.gate.values is not self.detector.values:
            self.gate = BurstGate(self.detector.values, floor=lambda: loop.hold_floor,
                                  rhythm=rhythm_for(settings, link, most))
        else:
            self.gate.floor = lambda: loop.hold_floor
            old = self.gate.rhythm
            self.gate.rhythm = rhythm_for(settings, link, most)
            if old is not None:     # a reload: the starts seen and the count carry on
                for start in old.starts:
                    self.gate.rhythm.see(start)
                self.gate.rhythm.anticipated = old.anticipated
        assert self.bucket is not None
        self.bucket.hold_on(self.gate.hold)
        if self.sockets is not None:
            self.sockets.expect_cuts(settings.threshold)
        loop.bursts = self.gate
        if self.fast_path != f"on: {', '.join(links)}":
            log.info("fast path on: the burst detector watches %s", ", ".join(links))
        self.fast_path = loop.fast_path = f"on: {', '.join(links)}"

    def stop_fast_path(self, why: str) -> None:
        """The gate off the bucket, the detector off the links and unloaded. Under ``lock``."""
        self.fast_path = why
        if self.loop is not None:
            self.loop.fast_path, self.loop.bursts = why, None
        if self.bucket is not None:
            self.bucket.hold_on(None)
        if self.sockets is not None:
            self.sockets.expect_cuts(None)
        self.gate = None
        if self.detector is None:
            return
        try:
            if self.shaper is not None:
                self.shaper.detach_detector()
        except ShapingError as e:   # the next start replaces it; it only counts meanwhile
            log.warning("the burst detector stays on the links until the next start: %s", e)
        self.detector.close()
        self.detector = None


def _pull_bytes(ifname: str, sockets: PullSockets | None, bytes_read: Callable[[], int] | None
                ) -> Callable[[], Mapping[str, LinkCounters]]:
    def read() -> Mapping[str, LinkCounters]:
        # Payload bytes against the link's rx_bytes (headers included): the ACK share
        # allowance and the thresholds absorb the difference.
        if sockets is not None:
            return {ifname: LinkCounters(sockets.sample().bytes_received, 0)}
        assert bytes_read is not None
        return {ifname: LinkCounters(int(bytes_read()), 0)}

    return read


@contextmanager
def around_pull(policy: Policy, bucket: Any, *, sockets: PullSockets | None,
                rate: int | None = None, sources: Sequence[Source] = ()
                ) -> Iterator[BackoffLoop | None]:
    """Shaping and backoff around one CLI pull (``wagent pull --policy P``).

    With ``shaping.enabled`` the policy's trees are applied first (wagent's existing tree is
    adopted), so the kernel's ceil backs off with the pull's bucket; a tree this pull made is
    cleared afterwards, one that was there before (the daemon's) gets its ceil back.
    Raises ``shaping.errors.ShapingError`` when shaping can't be applied (no CAP_NET_ADMIN).
    """
    made = False
    if policy.shaping.enabled:
        before = state.load(policy.state_dir)
        made = not any(i in before for i in policy.shaping.interfaces)
    runtime = ShapingRuntime(policy, bucket, sockets=sockets, rate=rate, sources=sources)
    runtime.start()
    try:
        yield runtime.loop
    finally:
        if runtime.loop is not None:
            runtime.loop.stop()
        with runtime.lock:
            runtime.stop_fast_path("off: the pull ended")
        shaper = runtime.shaper
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
