"""Builds the daemon's parts from a Policy and passes them in; nothing reaches for globals.

:class:`Application` is the one place that knows which module does what: the store, the
token bucket, the shaper (when the policy enables shaping), the backoff loop, the pull worker,
the scheduler (APScheduler: every timed job of the daemon), the control socket and the metrics.
:class:`agent.daemon.Daemon` drives it: ``start``, ``reconcile`` on reload, ``snapshot`` for
status (built by ``agent.snapshot``), ``stop``.

Reload is mark-and-sweep (fail2ban's model): every part is marked, the new policy is replayed
part by part (shaping re-applied in place, so the kernel never goes unshaped; the backoff loop
restarted with the new thresholds; the models' jobs rescheduled), and what the new policy no longer
declares is swept: interfaces dropped from ``shaping.interfaces`` get their caps cleared, models
dropped from ``models`` stop pulling, a moved control socket or metrics port is re-opened.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent import announce, schedule
from agent.control import ControlServer, prepare_socket_dir, trusted_uids
from agent.hooks import run_hook
from agent.identity import ROLE_OVERRIDE, Identity, identify
from agent.manifest import MAX_MANIFEST_BYTES, published_ts
from agent.metrics import Metrics, MetricsError
from agent.policy import load_policy
from agent.policy.model import Model, Policy
from agent.pull.worker import Progress, WindowState, Worker, WorkerDeps
from agent.ratelimit import TokenBucket
from agent.scheduler import Scheduler
from agent.snapshot import snapshot
from agent.status import DaemonState
from agent.store import Store, StoreError, pointers, space

log = logging.getLogger(__name__)

VERIFY_EVERY = 5.0      # seconds between re-applies of the shaping plan (see _verify_shaping)
CLEAN_EVERY = 3600.0    # seconds between the store's cleanings and evictions (also after pulls)
METRICS_EVERY = 5.0     # seconds between metrics updates (the textfile, the exporter's gauges)
# The state dir holds what to restore on `shaping clear`: no one else writes or reads it. The
# store is read by nginx on a cache node (its models/ tree is served as is), so others may read.
STATE_MODE = 0o750
STORE_MODE = 0o755


def make_private_dir(path: str, mode: int) -> None:
    """Creates ``path`` (and missing parents) with ``mode`` whatever the umask; refuses an
    existing one that other users may write to (they could swap its files under the daemon)."""
    if not os.path.isdir(path):
        old = os.umask(0o022)
        try:
            os.makedirs(path, mode=mode, exist_ok=True)
        finally:
            os.umask(old)
        os.chmod(path, mode)
    st = os.stat(path)
    if st.st_mode & 0o002 and not st.st_mode & 0o1000:
        raise StoreError(f"{path} is writable by every user (mode {st.st_mode & 0o7777:o}); "
                         f"chmod o-w {path}, or point the policy at a directory of its own")


@dataclass
class Parts:
    """Everything the daemon runs for one policy. Mutable: reconcile updates it in place, and
    the worker's functions read ``parts.policy`` at call time, so they follow reloads."""

    policy: Policy
    identity: Identity
    store: Store
    bucket: TokenBucket
    worker: Worker
    scheduler: Scheduler
    shaper: Any | None = None
    backoff: Any | None = None
    control: ControlServer | None = None
    metrics: Metrics | None = None
    ceil_bps: int | None = None          # what the kernel's distribution ceil was set to last
    shaping_notes: tuple[str, ...] = ()  # what the last apply said
    metrics_error: str | None = None
    metrics_failures: int = 0            # metrics updates that failed (a new reason each)
    shaping_error: str | None = None     # the last periodic re-apply failed (status: degraded)
    shaping_repairs: int = 0             # times the periodic re-apply found the kernel changed
    # The shaper's netlink socket is used from the backoff thread, the main loop and control
    # threads: one at a time.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


HORIZON = 366 * 86400.0  # how far ahead a window's closing is looked for


class Application:
    def __init__(self, policy_path: str, *, state_dir: str | None = None,
                 socket: str | None = None, hostname: str | None = None,
                 node_id: str | None = None, role_override: Path = ROLE_OVERRIDE,
                 clock: Callable[[], float] = time.time) -> None:
        self.policy_path = policy_path
        self.state_dir = state_dir
        self.socket = socket
        self.hostname = hostname
        self.node_id = node_id
        self.role_override = role_override
        self.clock = clock

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
    def start(self, policy: Policy, controller: Any) -> Parts:
        """Control socket, store, shaping (READY waits for it), backoff, the pull worker on the
        scheduler, metrics.

        The control socket is bound first: its lock is what tells a second ``wagent run`` that
        a daemon is live, and that one must refuse before it touches the kernel or the store.
        It is served last, so ``wagent status`` answers only once the caps are in place."""
        control = ControlServer(policy.control.socket, controller, group=policy.control.group)
        control.bind()           # served from the end of start: status "running" means shaped
        try:
            store = Store(policy.store.path)
            make_private_dir(policy.store.path, STORE_MODE)
            store.ensure()
            # What a crash left (a version half built, partial files nobody resumes) goes now,
            # not at the next pull: a node with nothing to pull must not keep it for ever.
            space.clean(store, self.clock())
            make_private_dir(policy.state_dir, STATE_MODE)
        except BaseException:
            control.stop()
            raise
        bucket = TokenBucket(policy.pulls.rate)
        parts = Parts(policy=policy, identity=self.identify(policy), store=store, bucket=bucket,
                      worker=None, scheduler=Scheduler(),  # type: ignore[arg-type]
                      control=control)
        parts.worker = Worker(policy, self._worker_deps(parts))
        try:
            self._apply_shaping(parts, policy)
            self._start_backoff(parts)
            parts.scheduler.start()
            parts.worker.start(parts.scheduler)
            control.start()
            parts.metrics = self._start_metrics(parts, policy)
            self._schedule_housekeeping(parts, controller)
        except BaseException:
            self.stop(parts, 2.0)
            raise
        log.info("node %s (%s), role %s (%s)", parts.identity.node_id[:12],
                 parts.identity.hostname, parts.identity.role, parts.identity.role_source)
        return parts

    def stop(self, parts: Parts | None, budget: float) -> None:
        """Stops the workers within ``budget`` seconds. Caps stay in the kernel: a restart or an
        upgrade must not open an unshaped gap (``wagent shaping clear`` removes them)."""
        if parts is None:
            return
        deadline = time.monotonic() + budget
        if parts.worker is not None:
            parts.worker.stop()
        # The jobs end with their pulls (stopped just now); wait no longer than the budget.
        _join_within(parts.scheduler.shutdown, max(0.1, deadline - time.monotonic() - 0.5))
        if parts.backoff is not None:
            parts.backoff.stop(max(0.1, min(1.0, deadline - time.monotonic())))
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
            make_private_dir(new.store.path, STORE_MODE)
            store.ensure()
            parts.store = store
        make_private_dir(new.state_dir, STATE_MODE)
        # Shaping first: if the kernel refuses the new tree, nothing else has changed yet.
        had_shaper = parts.shaper is not None
        with parts.lock:
            self._apply_shaping(parts, new, old)
        parts.policy = new
        parts.identity = self.identify(new)
        self._reconcile_backoff(parts, old, had_shaper)
        parts.worker.update(new)
        if parts.control is not None:
            self._schedule_housekeeping(parts, parts.control.controller)
        if parts.control is not None and (new.control != old.control):
            controller = parts.control.controller
            parts.control.stop()
            parts.control = ControlServer(new.control.socket, controller,
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

    # -- shaping and backoff -----------------------------------------------------------------
    def _apply_shaping(self, parts: Parts, new: Policy, old: Policy | None = None) -> None:
        was = old.shaping if old is not None and old.shaping.enabled else None
        if new.shaping.enabled:
            from shaping.shaper import Shaper  # only nodes that shape need pyroute2

            shaper = Shaper(new.shaping, new.sources, new.state_dir)
            keep = None
            if parts.ceil_bps is not None and old is not None and old.shaping.enabled:
                # keep the backoff controller's ceil; it retunes from there on its next tick
                keep = min(parts.ceil_bps, new.shaping.ceil)
            report = shaper.apply(ceil=keep)   # adopts wagent's own tree, changes it in place
            if parts.shaper is not None:
                parts.shaper.close()
            parts.shaper = shaper
            parts.shaping_notes = tuple(report.notes)
            parts.verify_at = time.monotonic() + VERIFY_EVERY   # just reconciled
            parts.ceil_bps = keep if keep is not None else new.shaping.ceil
        else:
            if parts.shaper is not None:
                parts.shaper.close()
            parts.shaper = None
            parts.ceil_bps = None
            parts.shaping_notes = ()
        if was is not None and not new.shaping.enabled:
            # sweep: shaping no longer declared at all. (Interfaces dropped from a policy that
            # still shapes are swept by Shaper.apply itself, from its state records.)
            from shaping.shaper import Shaper

            assert old is not None
            Shaper(was, old.sources, old.state_dir).clear()
            log.info("shaping disabled by the new policy: caps cleared on %s",
                     ", ".join(was.interfaces))

    def _reconcile_backoff(self, parts: Parts, old: Policy, had_shaper: bool) -> None:
        """Retune the running loop in place where possible: restarting it would forget that
        training is on and open the ceil to the cap for a tick."""
        from shaping.backoff import cap_for
        from shaping.detect import Detectors

        new, loop = parts.policy, parts.backoff
        same_shape = (had_shaper == (parts.shaper is not None)
                      and new.shaping.interfaces == old.shaping.interfaces)
        if loop is not None and new.backoff.enabled and same_shape:
            if new.backoff != old.backoff or new.shaping.link_rate != old.shaping.link_rate:
                from agent.pull.sockets import REGISTRY

                loop.controller.link = new.shaping.link_rate
                loop.controller.backoff = new.backoff
                REGISTRY.budget_s = new.backoff.queue_budget
                loop.detectors = Detectors.from_policy(new.backoff, new.shaping.interfaces,
                                                       link=loop.distribution is not None)
                loop.tick_s = max(0.01, float(new.backoff.tick))
            loop.controller.set_cap(cap_for(new))
            return
        if loop is not None:
            loop.stop(2.0)
            parts.backoff = None
        parts.bucket.set_rate(new.pulls.rate)
        self._start_backoff(parts)

    def _start_backoff(self, parts: Parts) -> None:
        from shaping.backoff import start_for_pull

        def set_ceil(bps: int) -> None:
            with parts.lock:
                assert parts.shaper is not None
                parts.shaper.set_ceil(bps)
                parts.ceil_bps = bps

        def stats() -> Any:
            with parts.lock:
                assert parts.shaper is not None
                return parts.shaper.stats()

        def counters() -> Any:
            with parts.lock:
                assert parts.shaper is not None
                return parts.shaper.counters()

        class _Shaper:
            """The shaper the loop sees: always the current one (a reload replaces it), and
            the ceil it sets is recorded for status."""

            def __init__(self) -> None:
                self.set_ceil = set_ceil
                self.stats = stats
                self.counters = counters

        shaper = _Shaper() if parts.shaper is not None else None
        parts.backoff = start_for_pull(
            parts.policy, parts.bucket, shaper,
            bytes_read=lambda: sum(parts.worker.fetched_totals().values()))

    # -- the pull worker's view of the world----------------------------------------------------
    def _worker_deps(self, parts: Parts) -> WorkerDeps:
        from agent.pull import engine  # imports requests: only where pulls happen

        def options() -> Any:
            return engine.PullOptions.from_policy(parts.policy.pulls)

        def cache_node() -> bool:
            return parts.identity.role == parts.policy.cache_role

        def resolve(model: Model) -> str:
            # A cache node polls past the cache tier (sources marked `cache: true`): there it
            # would read its own announcement and never learn of a new version.
            sources = announce.latest_sources(parts.policy.sources, cache_node())
            return engine.resolve_latest(sources, model.name, options())

        def published(model: Model, version: str) -> float:
            _, manifest = engine.fetch_manifest(parts.policy.sources, model.name, version,
                                                options())
            try:
                return published_ts(manifest.published)
            except (ValueError, TypeError):
                return self._first_seen(parts, model.name, version)

        def plan(model: Model, version: str, pub: float, now: float
                 ) -> tuple[float, float | None]:
            p, ident = parts.policy, parts.identity
            return (schedule.slot(pub, ident.node_id, ident.role, model.name, version, p),
                    schedule.start_at(pub, now, ident.node_id, ident.role, model.name, version,
                                      p))

        def window(now: float) -> WindowState:
            windows = schedule.windows_for(parts.policy, parts.identity.role)
            if not windows:
                return WindowState(True)
            if schedule.is_open(windows, now):
                closes = schedule.open_until(windows, now, horizon=HORIZON)
                # windows that chain past the horizon never close: say so, not "in 400 days"
                return WindowState(True, closes_at=closes if closes < now + HORIZON else None)
            return WindowState(False, next_open=schedule.next_opening(windows, now))

        def have(model: Model, version: str) -> bool:
            return parts.store.installed(model.name, version) is not None

        def local_version(model: Model) -> str | None:
            versions = parts.store.versions(model.name)
            return versions[0].version if versions else None

        def pull(model: Model, version: str, progress: Callable[[Progress], None],
                 stop: threading.Event) -> None:
            def report(p: Any) -> None:
                progress(Progress(done=p.bytes_done, total=p.bytes_total, streams=p.streams,
                                  fetched=p.bytes_fetched, rate_bps=p.rate * 8))

            # Models pulling at once share the node's streams (and its token bucket).
            o = options()
            o = replace(o, streams=max(1, o.streams // max(1, parts.worker.pulling())))
            engine.pull_version(parts.policy.sources, model.name, version, parts.store,
                                options=o, bucket=parts.bucket, progress=report, stop=stop)
            # Issue 15: a cache node's nginx serves its store, so it now names the version in
            # {model}/latest (published and durable by now; never an older one): its cluster
            # polls it rather than the origin. The pull itself succeeded whatever happens here.
            if cache_node():
                try:
                    announce.announce(parts.store.root, model.name, version)
                except OSError as e:
                    log.error("announcing %s %s in %s failed: %s", model.name, version,
                              parts.store.root, e)

        def ready(model: Model, version: str) -> str | None:
            if not pointers.set_current(parts.store, model.name, version):
                return None                 # current already (a restart): nothing happened
            log.info("%s %s is current", model.name, version)
            if not model.on_ready:
                return None
            path = parts.store.version_dir(model.name, version)
            ok, what = run_hook(model.on_ready, {"WAGENT_MODEL": model.name,
                                                 "WAGENT_VERSION": version,
                                                 "WAGENT_PATH": str(path)},
                                model.on_ready_timeout)
            (log.info if ok else log.warning)("on_ready of %s %s: %s", model.name, version,
                                              what)
            return what

        def stall_after() -> float:
            # The longest wait the deadlines allow without a byte moving, and a minute more:
            # the largest manifest at its slowest, or a request cut at its headers deadline or
            # by the goodput floor followed by the longest backoff.
            o = options()
            t = o.timeouts
            return 60.0 + t.headers_deadline + max(
                t.small_body_deadline(MAX_MANIFEST_BYTES),
                o.goodput_grace + o.goodput_window + o.backoff_cap)

        return WorkerDeps(clock=self.clock, resolve=resolve, published=published,
                          schedule=plan, window=window, have=have,
                          local_version=local_version, pull=pull,
                          evict=lambda: self._evict(parts), ready=ready,
                          stall_after=stall_after)

    def _evict(self, parts: Parts) -> None:
        p = parts.policy
        removed = space.evict(
            parts.store, keep=p.store.keep_versions, pins={m.name: m.pin for m in p.models},
            max_size=p.store.max_size, now=self.clock(), evict_after=p.store.evict_after)
        for r in removed:
            log.info("evicted %s %s (%d bytes)", r.kind, r.name, r.size)

    def _first_seen(self, parts: Parts, model: str, version: str) -> float:
        """When this node first learned of a version, kept in the state directory so that the
        slot stays where it was after a restart (used when the manifest has no time)."""
        path = Path(parts.policy.state_dir) / "seen.json"
        try:
            seen = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            seen = {}
        key = f"{model}/{version}"
        if key not in seen:
            seen[key] = self.clock()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(seen, indent=1, sort_keys=True))
            os.replace(tmp, path)
        return float(seen[key])

    # -- the daemon's tick --------------------------------------------------------------------
    def workers(self, parts: Parts) -> dict[str, bool]:
        alive = {"scheduler": parts.scheduler.alive()}
        if parts.backoff is not None:
            probe = getattr(parts.backoff, "alive", None)   # BackoffLoop.alive(), once it lands
            if probe is not None:
                alive["backoff"] = bool(probe())
            else:
                t = getattr(parts.backoff, "_thread", None)
                alive["backoff"] = t is not None and t.is_alive()
        if parts.control is not None:
            alive["control"] = parts.control.alive()
        return alive

    def error_counts(self, parts: Parts | None) -> dict[str, int]:
        if parts is None:
            return {}
        counts = {"pull": parts.worker.failures_total, "metrics": parts.metrics_failures,
                  "shaping_repairs": parts.shaping_repairs}
        if parts.backoff is not None:
            counts["backoff_apply"] = parts.backoff.apply_errors
        return counts

    def _verify_shaping(self, parts: Parts) -> None:
        """Every VERIFY_EVERY seconds, reconcile the kernel with the plan again. An interface
        that was removed and re-created (a driver reset, a bond rebuilt) comes back with the
        kernel's default qdisc and no ingress redirect: unshaped, while set_ceil on the IFB
        still succeeds. An unchanged kernel costs a few dumps and sends nothing."""
        if parts.shaper is None:
            return
        try:
            with parts.lock:
                report = parts.shaper.apply(ceil=parts.ceil_bps, quiet=True)
        except Exception as e:
            message = f"re-applying the caps failed: {e}"
            if message != parts.shaping_error:
                log.error("%s", message)
            parts.shaping_error = message
            return
        parts.shaping_error = None
        if report.changed:
            parts.shaping_repairs += 1
            log.warning("the kernel no longer had wagent's caps as planned (an interface "
                        "re-created, tc or `wagent shaping clear` run by hand?); re-applied %d "
                        "change(s). To remove the caps, stop the daemon first", len(report.actions))
        if tuple(report.notes) != parts.shaping_notes:
            for note in report.notes:
                log.warning("%s", note)
            parts.shaping_notes = tuple(report.notes)

    def pause(self, parts: Parts) -> None:
        parts.worker.pause()

    def resume(self, parts: Parts) -> None:
        parts.worker.resume()

    def export_metrics(self, parts: Parts, doc: dict[str, Any]) -> None:
        if parts.metrics is not None:
            parts.metrics.update(doc, parts.worker.fetched_totals())

    def _schedule_housekeeping(self, parts: Parts, controller: Any) -> None:
        """The periodic jobs beside the models' own (re-added on reload: their ids replace)."""
        s = parts.scheduler
        s.every(VERIFY_EVERY, lambda: self._verify_shaping(parts), job_id="shaping-verify")
        s.every(CLEAN_EVERY, lambda: self._evict(parts), job_id="store-clean")

        def metrics() -> None:
            try:
                self.export_metrics(parts, controller.status())
            except Exception as e:
                message = f"writing metrics failed: {e}"
                if message != parts.metrics_error:
                    log.warning("%s", message)
                    parts.metrics_failures += 1
                parts.metrics_error = message
            else:
                if parts.metrics_error is not None and parts.metrics_error.startswith("writing"):
                    parts.metrics_error = None

        s.every(METRICS_EVERY, metrics, job_id="metrics", first=time.time())

    # -- status ---------------------------------------------------------------------------
    def snapshot(self, parts: Parts | None, base: DaemonState) -> DaemonState:
        return snapshot(parts, base, self.clock)


def _join_within(stop: Callable[[bool], None], seconds: float) -> None:
    """Run ``stop(wait=True)`` but return after ``seconds`` whatever it waits for (a pull's
    thread that ignores its stop event must not hold the daemon's exit)."""
    t = threading.Thread(target=stop, args=(True,), name="scheduler-stop", daemon=True)
    t.start()
    t.join(seconds)
