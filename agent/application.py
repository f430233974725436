"""Builds the daemon's parts from a Policy and passes them in; nothing reaches for globals.

:class:`Application` is the one place that knows which module does what: the store, the
token bucket, the shaper (when the policy enables shaping), the backoff loop, the pull worker,
the scheduler (APScheduler: every timed job of the daemon), the control socket and the metrics.
:class:`agent.daemon.Daemon` drives it: ``start``, ``reconcile`` on reload, ``snapshot`` for
status (built by ``agent.snapshot``), ``stop``.

What the pull worker's steps do on this node (resolve, the publication time, the schedule, the
pull and what follows it) is :class:`agent.pull.node_pulls.NodePulls`; the worker gets its bound
methods (:func:`worker_deps`).

Reload is mark-and-sweep (fail2ban's model): every part is marked, the new policy is replayed
part by part (shaping re-applied in place, so the kernel never goes unshaped; the backoff loop
updated in place with the new thresholds; the models' jobs rescheduled), and what the new
policy no longer declares is swept: interfaces dropped from ``shaping.interfaces`` get their
caps cleared, models dropped from ``models`` stop pulling, a moved control socket or metrics
port is re-opened.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol, cast

from agent.control import Controls, ControlServer, prepare_socket_dir, trusted_uids
from agent.identity import ROLE_OVERRIDE, Identity, identify
from agent.metrics import Metrics, MetricsError
from agent.mount.service import FD_NAME, MountDeps, Mounts
from agent.mount.service import warm as warm_fuse
from agent.notify import inherited_fds, store_fd
from agent.ownership import dir_problem, make_missing
from agent.parts import Parts
from agent.peers.service import PeerService
from agent.policy import load_policy
from agent.policy.model import Policy
from agent.pull.connections import Connections
from agent.pull.demand import Demand
from agent.pull.node_pulls import NodePulls
from agent.pull.worker import Worker, WorkerDeps
from agent.scheduler import Scheduler
from agent.snapshot import snapshot, tick_summary
from agent.status import DaemonState, TickSummary
from agent.store import Store, StoreError, space
from agent.yielding.ratelimit import TokenBucket
from agent.yielding.runtime import ShapingRuntime

log = logging.getLogger(__name__)

VERIFY_EVERY = 5.0      # seconds between re-applies of the shaping plan (ShapingRuntime.verify)
EVICT_EVERY = 3600.0    # seconds between the store's evictions and cleanings (also after pulls)
METRICS_EVERY = 5.0     # seconds between metrics updates (the textfile, the exporter's gauges)
# The state dir holds what to restore on `shaping clear`: no one else writes or reads it. The
# store is read by nginx on a cache node (its models/ tree is served as is), so others may read.
STATE_MODE = 0o750
STORE_MODE = 0o755


def make_private_dir(path: str, mode: int, what: str) -> None:
    """Creates ``path`` (and missing parents, 0755) with ``mode`` whatever the umask; refuses,
    before making anything, a path someone untrusted could change (``agent.ownership``: the
    directory and each one above it owned by root, this user or the service's user, writable
    by no one else): they could swap its files under the daemon. ``what`` names it."""
    def check(missing_ok: bool) -> None:
        try:
            problem = dir_problem(path, trusted_uids(), risk="swap its files under the daemon",
                                  also=f", or point the policy's {what} at a directory of its "
                                       "own", missing_ok=missing_ok)
        except OSError as e:
            raise StoreError(f"can't check who may change the {what} {path}: {e}") from None
        if problem is not None:
            raise StoreError(f"the {what} {path} is not safe: {problem}")

    check(missing_ok=True)
    make_missing(path, mode)
    check(missing_ok=False)


def worker_deps(pulls: NodePulls) -> WorkerDeps:
    """The pull worker's functions: each the method of ``pulls`` of the same name."""
    return WorkerDeps(clock=pulls.clock, resolve=pulls.resolve, published=pulls.published,
                      schedule=pulls.schedule, window=pulls.window, have=pulls.have,
                      local_version=pulls.local_version, pull=pulls.pull, evict=pulls.evict,
                      poll_after=pulls.poll_after, ready=pulls.ready,
                      stall_after=pulls.stall_after, mounted=pulls.is_mounted)


def mounts_for(policy: Callable[[], Policy], store: Callable[[], Store], pulls: NodePulls,
               worker: Worker, demand: Demand, clock: Callable[[], float],
               monotonic: Callable[[], float]) -> Mounts:
    """The lazy mounts of a daemon: their readers wait on the pulls' pieces (a ``Demand`` the
    pulls share), their versions are pulled at once and never evicted. ``policy`` and ``store``
    are read late: a reload replaces the policy and may replace the store."""
    pulls.demand = demand
    mounts = Mounts(MountDeps(
        policy=policy, store=store, demand=demand,
        pull_info=lambda name: next((i for i in worker.snapshot() if i.model == name), None),
        resolve=pulls.resolve, manifest=pulls.manifest, wake=worker.wake, clock=clock,
        monotonic=monotonic))
    pulls.mounted = mounts.versions
    return mounts


class DaemonControls(Controls, Protocol):
    """The daemon as its parts see it: the control socket's methods, and its state, which the
    metrics job reads as values (never the JSON document parsed back)."""

    def state(self) -> DaemonState: ...


class Application:
    def __init__(self, policy_path: str, *, state_dir: str | None = None,
                 socket: str | None = None, hostname: str | None = None,
                 node_id: str | None = None, role_override: Path = ROLE_OVERRIDE,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 env: Mapping[str, str] | None = None) -> None:
        self.policy_path = policy_path
        self.state_dir = state_dir
        self.socket = socket
        self.hostname = hostname
        self.node_id = node_id
        self.role_override = role_override
        self.clock = clock            # wall clock: schedules, the store's times, status
        self.monotonic = monotonic    # intervals: the backoff loop's ticks, stop budgets
        # The pulls' HTTP deadline watchdog and the pull sockets' registry, made once: the
        # pulls' connections fill the registry, the backoff loop clamps what is in it.
        self.connections = Connections()
        # the service manager's word (NOTIFY_SOCKET, LISTEN_FDS): where the lazy mount's
        # descriptor is kept across restarts, and where it comes back from
        self.env = os.environ if env is None else env

    # -- policy -------------------------------------------------------------------------------
    def load(self) -> Policy:
        """The policy file with the command line's overrides; raises PolicyError."""
        policy = load_policy(self.policy_path)
        if self.state_dir:
            policy = replace(policy, state_dir=self.state_dir)
        if self.socket:
            policy = replace(policy, control=replace(policy.control, socket=self.socket))
        return policy

    def identify(self, policy: Policy) -> Identity:
        ident = identify(policy, hostname=self.hostname, override=self.role_override)
        return replace(ident, node_id=self.node_id) if self.node_id else ident

    # -- start / stop -------------------------------------------------------------------------
    def start(self, policy: Policy, controls: DaemonControls) -> Parts:
        """Control socket, store, shaping (READY waits for it), backoff, the pull worker on the
        scheduler, metrics.

        The control socket is bound first: its lock is what tells a second ``wagent run`` that
        a daemon is live, and that one must refuse before it touches the kernel or the store.
        It is served last, so ``wagent status`` answers only once the caps are in place."""
        control = ControlServer(policy.control.socket, controls, group=policy.control.group)
        control.bind()           # served from the end of start: status "running" means shaped
        try:
            store = Store(policy.store.path)
            make_private_dir(policy.store.path, STORE_MODE, "store")
            store.ensure()
            # What a crash left (a version half built, partial files nobody resumes) goes now,
            # not at the next pull: a node with nothing to pull must not keep it for ever.
            space.clean(store, self.clock())
            make_private_dir(policy.state_dir, STATE_MODE, "state_dir")
        except BaseException:
            control.stop()
            raise
        bucket = TokenBucket(policy.pulls.rate)
        # Models pulling at once share the streams: how many do is the worker's to say.
        pulls = NodePulls(policy, self.identify(policy), store, bucket, clock=self.clock,
                          pulling=lambda: worker.pulling(), connections=self.connections)
        worker = Worker(policy, worker_deps(pulls))
        # the lazy mounts' readers waiting on the pulls' pieces; the backoff lifts the pull for
        # them (mounts.read_floor)
        demand = Demand(self.monotonic)
        shaping = ShapingRuntime(policy, bucket, sockets=self.connections.sockets,
                                 clock=self.monotonic,
                                 bytes_read=lambda: sum(worker.fetched_totals().values()),
                                 readers_waiting=lambda: demand.waiting > 0)
        # Lazy mounts: their readers wait on the pulls' pieces (``demand``), their versions are
        # pulled at once and never evicted. The deps read ``parts`` late: a reload replaces the
        # policy and may replace the store.
        mounts = mounts_for(lambda: parts.policy, lambda: parts.store, pulls, worker, demand,
                            self.clock, self.monotonic)
        # The cluster's nodes serve each other (peers.enabled): a cache node also looks for a
        # version at once when a node asks it for one it hasn't seen (pull-through).
        pulls.poll_now = worker.poll_now
        peers = PeerService(policy, lambda: parts.store, demand, poke=pulls.look_now,
                            clock=self.monotonic, told=pulls.told)
        pulls.swarm = peers.swarm
        pulls.cluster = peers.cluster_urls
        pulls.offer = peers.catalog.offering
        parts = Parts(policy=policy, identity=pulls.identity, store=store, bucket=bucket,
                      pulls=pulls, worker=worker, scheduler=Scheduler(), shaping=shaping,
                      mounts=mounts, peers=peers, control=control)
        try:
            parts.shaping.start()
            parts.scheduler.start()
            parts.worker.start(parts.scheduler)
            parts.peers.start()
            control.start()
            parts.metrics = self._start_metrics(parts, policy)
            self._schedule_housekeeping(parts, controls)
        except BaseException:
            self.stop(parts, 2.0)
            raise
        # The lazy mount outlives this process in systemd's fd store, and comes back from it.
        mounts.keep_fd = lambda fd: store_fd(fd, FD_NAME, self.env)
        fuse_fd = None
        for name, fd in inherited_fds(self.env, os.getpid()).items():
            if name == FD_NAME and fuse_fd is None:
                fuse_fd = fd
            else:
                os.close(fd)
        # what the previous process showed: the store's views always, the FUSE mount's
        # versions when its descriptor came back
        mounts.adopt(fuse_fd)
        warm_fuse()
        pulls.announce_held()
        log.info("node %s (%s), role %s (%s)", parts.identity.node_id[:12],
                 parts.identity.hostname, parts.identity.role, parts.identity.role_source)
        return parts

    def stop(self, parts: Parts | None, budget: float) -> None:
        """Stops the workers within ``budget`` seconds. Caps stay in the kernel: a restart or an
        upgrade must not open an unshaped gap (``wagent shaping clear`` removes them)."""
        if parts is None:
            return
        deadline = self.monotonic() + budget
        if parts.worker is not None:
            parts.worker.stop()
        parts.mounts.stop()
        parts.peers.stop()
        # The jobs end with their pulls (stopped just now); wait no longer than the budget.
        _join_within(parts.scheduler.shutdown, max(0.1, deadline - self.monotonic() - 0.5))
        if parts.shaping is not None:
            parts.shaping.stop(max(0.1, min(1.0, deadline - self.monotonic())))
        if parts.control is not None:
            parts.control.stop()
        if parts.metrics is not None:
            parts.metrics.stop()

    # -- reload: mark and sweep ---------------------------------------------------------------
    def reconcile(self, parts: Parts, new: Policy) -> Parts:
        old = parts.policy
        if new.control != old.control:
            # Refused before anything changes: the old socket keeps serving.
            prepare_socket_dir(new.control.socket, trusted_uids())
        if new.store.path != old.store.path:
            store = Store(new.store.path)
            make_private_dir(new.store.path, STORE_MODE, "store")
            store.ensure()
            parts.store = store
        make_private_dir(new.state_dir, STATE_MODE, "state_dir")
        # Shaping first: if the kernel refuses the new tree, nothing else has changed yet.
        parts.shaping.reconcile(new)
        parts.policy = new
        parts.identity = self.identify(new)
        parts.pulls.update(new, parts.identity, parts.store)
        parts.pulls.announce_held()
        parts.worker.update(new)
        parts.peers.update(new)
        if parts.control is not None:
            # the control socket serves what start was given: the daemon
            self._schedule_housekeeping(parts, cast(DaemonControls, parts.control.controls))
        if parts.control is not None and (new.control != old.control):
            controls = parts.control.controls
            parts.control.stop()
            parts.control = ControlServer(new.control.socket, controls,
                                          group=new.control.group)
            parts.control.start()
        if parts.metrics is not None and new.metrics != old.metrics:
            parts.metrics.stop()
            parts.metrics = self._start_metrics(parts, new)
        return parts

    @staticmethod
    def _start_metrics(parts: Parts, policy: Policy) -> Metrics:
        """Metrics are worth a warning, not a node that stops pulling: a taken port leaves the
        daemon running, degraded, with the reason in status."""
        metrics = Metrics(policy.metrics)
        try:
            metrics.start()
            parts.metrics_error = None
        except MetricsError as e:
            log.error("%s", e)
            parts.metrics_error = str(e)
        return metrics

    # -- the daemon's tick --------------------------------------------------------------------
    def workers(self, parts: Parts) -> dict[str, bool]:
        alive = {"scheduler": parts.scheduler.alive()}
        if parts.shaping.loop is not None:
            alive["backoff"] = parts.shaping.loop.alive()
        if parts.control is not None:
            alive["control"] = parts.control.alive()
        if parts.peers.server is not None:
            alive["peers"] = parts.peers.server.alive()
        return alive

    def error_counts(self, parts: Parts | None) -> dict[str, int]:
        if parts is None:
            return {}
        counts = {"pull": parts.worker.failures_total, "metrics": parts.metrics_failures,
                  "shaping_repairs": parts.shaping.repairs}
        if parts.shaping.loop is not None:
            counts["backoff_apply"] = parts.shaping.loop.apply_errors
        return counts

    def pause(self, parts: Parts) -> None:
        parts.worker.pause()

    def resume(self, parts: Parts) -> None:
        parts.worker.resume()

    def export_metrics(self, parts: Parts, state: DaemonState) -> None:
        if parts.metrics is not None:
            parts.metrics.update(state, parts.worker.fetched_totals())

    def _schedule_housekeeping(self, parts: Parts, controls: DaemonControls) -> None:
        """The periodic jobs beside the models' own (re-added on reload: their ids replace)."""
        s = parts.scheduler
        s.every(VERIFY_EVERY, parts.shaping.verify, job_id="shaping-verify")
        s.every(EVICT_EVERY, parts.pulls.evict, job_id="store-evict")

        def metrics() -> None:
            try:
                self.export_metrics(parts, controls.state())
            except Exception as e:
                message = f"writing metrics failed: {e}"
                if message != parts.metrics_error:
                    log.warning("%s", message)
                    parts.metrics_failures += 1
                parts.metrics_error = message
            else:
                if parts.metrics_error is not None and parts.metrics_error.startswith("writing"):
                    parts.metrics_error = None

        s.every(METRICS_EVERY, metrics, job_id="metrics", first=self.clock())

    # -- status ---------------------------------------------------------------------------
    def snapshot(self, parts: Parts | None, base: DaemonState) -> DaemonState:
        return snapshot(parts, base, self.clock, self.monotonic)

    def tick_summary(self, parts: Parts | None, base: TickSummary) -> TickSummary:
        return tick_summary(parts, base)


def _join_within(stop: Callable[[bool], None], seconds: float) -> None:
    """Run ``stop(wait=True)`` but return after ``seconds`` whatever it waits for (a pull's
    thread that ignores its stop event must not hold the daemon's exit)."""
    t = threading.Thread(target=stop, args=(True,), name="scheduler-stop", daemon=True)
    t.start()
    t.join(seconds)
