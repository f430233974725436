"""The daemon's pull worker: one thread that keeps this node's store at the versions the policy
wants, at the time its schedule allows.

For each model, in policy order, every pass:

1. know the target version: the policy's, or ``{source}/{model}/latest`` polled every
   ``poll_interval`` (a failed poll keeps the last answer);
2. done if the store already has it (a version directory appears only once complete);
3. wait for this node's start: its wave slot (published + wave + per-node offset), at once if
   learned later, moved into its role's windows (``agent.schedule.start_at``);
4. pull, with the shared token bucket and a stop event; after publish, evict per policy.

The thread knows nothing of HTTP, the store's layout or the schedule's formula: it calls the
functions in :class:`PullerDeps`, which ``agent.application`` builds from the real modules and
tests build from fakes. The daemon's main loop calls :meth:`Puller.supervise` every tick, which
stops a running pull when the window closes, the daemon is paused, or a reload dropped or
changed the model (partials are kept; the next pull resumes them).

Every call that may wait on a source (resolve, the manifest, the pull) is bounded by the pull
engine's deadlines, so a stuck source costs one model a failure, never the others their turn. As
a safety net, a worker that has made no progress (no byte moved) for longer than
``PullerDeps.stall_after`` shows as ``stalled`` in its model's status, which makes the daemon
degraded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from agent.policy_model import Model, Policy
from agent.status import PullInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    done: int                   # bytes of the version present (resumed, copied, fetched)
    total: int | None
    streams: int                # connections with a request in flight
    fetched: int                # bytes received from the network in this pull
    rate_bps: float | None = None   # the engine's recent goodput; None: derived from samples


# (model, version, progress, stop) -> None; raises on failure (or on stop: partials are kept).
PullFn = Callable[[Model, str, Callable[[Progress], None], threading.Event], None]


@dataclass(frozen=True)
class Window:
    open: bool
    next_open: float | None = None
    closes_at: float | None = None


@dataclass
class PullerDeps:
    clock: Callable[[], float]
    resolve: Callable[[Model], str]                         # "latest" -> a version
    published: Callable[[Model, str], float]                # the version's publication time
    # (model, version, published, now) -> (this node's wave slot, when it may start: the slot,
    # now if learned later, moved into the role's windows; None if no window ever opens)
    schedule: Callable[[Model, str, float, float], tuple[float, float | None]]
    window: Callable[[float], Window]                       # this node's role windows at a time
    have: Callable[[Model, str], bool]                     # version complete in the store?
    local_version: Callable[[Model], str | None]           # newest complete version in the store
    pull: PullFn
    evict: Callable[[], None]
    # Seconds without progress after which the worker shows as stalled: longer than any wait
    # the deadlines allow (agent.application derives it from the pull options).
    stall_after: Callable[[], float] = field(default=lambda: DEFAULT_STALL_AFTER)


DEFAULT_STALL_AFTER = 600.0


@dataclass
class _Busy:
    """What the worker is doing now, and its last sign of progress."""

    model: str
    what: str                   # "resolving latest", "pulling v3", ...
    since: float                # start, or when bytes last moved
    moved: tuple[int, int] = (-1, -1)     # (done, fetched) at ``since``


@dataclass
class _ModelState:
    info: PullInfo
    resolved_at: float | None = None
    retry_at: float | None = None
    failures: int = 0
    published: tuple[str, float] | None = None   # (version, its publication time)
    fetched_total: int = 0          # bytes counted by progress, across pulls (for metrics)


class Puller:
    RATE_WINDOW = 5.0       # seconds of progress samples behind the rate shown

    def __init__(self, policy: Policy, deps: PullerDeps) -> None:
        self.policy = policy
        self.deps = deps
        self._lock = threading.Lock()
        self._states: dict[str, _ModelState] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._paused = False
        self._current: tuple[str, str, threading.Event] | None = None   # model, version, stop
        self._samples: deque[tuple[float, int]] = deque()
        self._engine_rate: float | None = None
        self.failures_total = 0         # failed pulls since start (metrics)
        self.pass_error: str | None = None
        self._busy: _Busy | None = None
        self._thread: threading.Thread | None = None
        self._sync_models()

    # -- lifecycle, called from the daemon ----------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="puller", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 4.0) -> None:
        self._stop.set()
        self._interrupt("stopping")
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause(self) -> None:
        self._paused = True
        self._interrupt("paused")
        self._wake.set()

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def update(self, policy: Policy) -> None:
        """Reload: take the new policy; the next pass reschedules every model (its slot may have
        moved), and a pull of a model that is gone or now pinned elsewhere stops."""
        with self._lock:
            self.policy = policy
            self._sync_models()
            for st in self._states.values():
                st.resolved_at = None
                st.retry_at = None

        self.supervise()
        self._wake.set()

    def supervise(self) -> None:
        """Called every main-loop tick: stop a pull that may no longer run."""
        cur = self._current
        if cur is None:
            return
        model_name, version, _ = cur
        model = next((m for m in self.policy.models if m.name == model_name), None)
        if model is None:
            self._interrupt(f"model {model_name} left the policy")
        elif model.version not in ("latest", version):
            self._interrupt(f"policy now wants {model_name} {model.version}")
        elif not self.deps.window(self.deps.clock()).open:
            self._interrupt("window closed")

    def snapshot(self) -> tuple[PullInfo, ...]:
        with self._lock:
            infos = [st.info for st in self._states.values()]
            rate = self._rate()
            stalled = self._stalled()
        return tuple(replace(i, rate_bps=rate if i.state == "pulling" else i.rate_bps,
                             stalled=stalled[1] if stalled and stalled[0] == i.model else None)
                     for i in infos)

    def _stalled(self) -> tuple[str, str] | None:
        """(model, why) when the worker made no progress for longer than it may."""
        busy, limit = self._busy, self.deps.stall_after()
        if busy is None:
            return None
        idle = self.deps.clock() - busy.since
        if idle <= limit:
            return None
        return busy.model, (f"no progress for {idle:.0f} s while {busy.what} (the deadlines "
                            f"allow {limit:.0f} s): the pull worker is stuck")

    @contextlib.contextmanager
    def _working(self, model: Model, what: str) -> Iterator[None]:
        with self._lock:
            self._busy = _Busy(model.name, what, self.deps.clock())
        try:
            yield
        finally:
            with self._lock:
                self._busy = None

    def _moved(self, done: int, fetched: int) -> None:
        """Progress: bytes present or received changed (under self._lock)."""
        busy = self._busy
        if busy is not None and busy.moved != (done, fetched):
            busy.since, busy.moved = self.deps.clock(), (done, fetched)

    def fetched_totals(self) -> dict[str, int]:
        with self._lock:
            return {name: st.fetched_total for name, st in self._states.items()}

    def window(self) -> Window:
        return self.deps.window(self.deps.clock())

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._pass()
                self.pass_error = None
            except Exception as e:  # one bad pass must not kill the worker; status shows it
                log.exception("puller pass failed")
                self.pass_error = f"the pull worker failed a pass (retrying): {e}"
                wait = 10.0
            self._wake.wait(max(0.05, wait))
            self._wake.clear()

    def _pass(self) -> float:
        waits = [self.policy.poll_interval]
        for model in self.policy.models:
            if self._stop.is_set():
                break
            waits.append(self._step(model))
        return min(waits)

    def _step(self, model: Model) -> float:
        """Moves one model on as far as it can now; returns seconds until it wants a look."""
        d = self.deps
        now = d.clock()
        st = self._states.get(model.name)
        if st is None:
            return self.policy.poll_interval
        if st.retry_at is not None and now < st.retry_at:
            return st.retry_at - now
        version = model.version if model.version != "latest" else st.info.version
        if model.version == "latest" and (st.resolved_at is None
                                          or now - st.resolved_at >= self.policy.poll_interval):
            try:
                with self._working(model, "resolving latest"):
                    version = d.resolve(model)
            except Exception as e:
                st.resolved_at = now  # keep the last answer; poll again next interval
                error = f"resolving latest: {e}"
                if error != st.info.error:   # once per new error, not at every poll
                    log.warning("%s: %s", model.name, error)
                self._set(model, error=error)
                return self.policy.poll_interval
            st.resolved_at = now
            if st.info.error and st.info.error.startswith("resolving latest"):
                self._set(model, error=None)
        if version is None:
            return self.policy.poll_interval
        local = d.local_version(model)
        if d.have(model, version):
            self._set(model, version=version, state="done", local_version=local, error=None,
                      streams=0)
            return self.policy.poll_interval
        if st.published is None or st.published[0] != version:
            try:
                with self._working(model, f"reading the manifest of {version}"):
                    st.published = (version, d.published(model, version))
            except Exception as e:
                log.warning("publication time of %s %s unknown: %s", model.name, version, e)
                self._set(model, version=version, error=f"reading the manifest: {e}")
                st.retry_at = now + min(60.0, self.policy.poll_interval)
                return min(60.0, self.policy.poll_interval)
        slot_at, start_at = d.schedule(model, version, st.published[1], now)
        if start_at is None or now < start_at:
            window = d.window(now)
            state = "waiting_slot" if now < slot_at or window.open else "waiting_window"
            self._set(model, version=version, state=state, slot_at=slot_at,
                      starts_at=start_at, local_version=local)
            return (start_at - now) if start_at is not None else 3600.0
        if not d.window(now).open:   # start_at is inside a window; this guards a clock jump
            self._set(model, version=version, state="waiting_window", slot_at=slot_at,
                      starts_at=start_at, local_version=local)
            return 60.0
        if self._paused:
            self._set(model, version=version, state="paused", slot_at=slot_at,
                      starts_at=start_at, local_version=local)
            return self.policy.poll_interval
        return self._pull(model, version, slot_at)

    def _pull(self, model: Model, version: str, slot_at: float) -> float:
        d = self.deps
        stop = threading.Event()
        self._current = (model.name, version, stop)
        started = d.clock()
        self._samples.clear()
        self._engine_rate = None
        self._set(model, version=version, state="pulling", slot_at=slot_at, started_at=started,
                  bytes_done=0, bytes_total=None, error=None, finished_at=None)
        last_fetched = [0]

        def progress(p: Progress) -> None:
            with self._lock:
                st = self._states.get(model.name)
                if st is None:
                    return
                st.fetched_total += max(0, p.fetched - last_fetched[0])
                last_fetched[0] = p.fetched
                self._samples.append((d.clock(), p.fetched))
                self._engine_rate = p.rate_bps
                self._moved(p.done, p.fetched)
                st.info = replace(st.info, bytes_done=p.done, bytes_total=p.total,
                                  streams=p.streams)

        try:
            with self._working(model, f"pulling {version}"):
                d.pull(model, version, progress, stop)
        except Exception as e:
            self._current = None
            if stop.is_set():
                # stopped on purpose (pause, window, reload, shutdown): partials are kept
                self._set(model, state="paused" if self._paused else "idle", streams=0)
                return 0.1
            self.failures_total += 1
            st = self._states.get(model.name)
            if st is None:               # dropped by a reload meanwhile: nothing to retry
                return 0.0
            st.failures += 1
            delay = min(self.policy.poll_interval, 10.0 * 2 ** min(st.failures - 1, 6))
            st.retry_at = d.clock() + delay
            log.warning("pull %s %s failed (retry in %.0f s): %s", model.name, version, delay, e)
            self._set(model, state="failed", error=str(e), streams=0)
            return delay
        self._current = None
        if stop.is_set() and not d.have(model, version):
            self._set(model, state="paused" if self._paused else "idle", streams=0)
            return 0.1
        st = self._states.get(model.name)
        if st is None:
            # A reload dropped the model as its last piece landed: the version is in the
            # store (eviction decides its fate under the new policy), nothing to report.
            log.info("pulled %s %s, no longer in the policy", model.name, version)
            return 0.0
        st.failures = 0
        self._set(model, state="done", finished_at=d.clock(), streams=0, error=None,
                  local_version=version)
        log.info("pulled %s %s", model.name, version)
        try:
            d.evict()
        except Exception as e:
            log.warning("eviction after %s %s failed: %s", model.name, version, e)
            self._set(model, error=f"eviction: {e}")
        return 0.0

    def _interrupt(self, why: str) -> None:
        cur = self._current
        if cur is not None and not cur[2].is_set():
            log.info("stopping pull of %s %s: %s", cur[0], cur[1], why)
            cur[2].set()

    # -- state ------------------------------------------------------------------------------
    def _sync_models(self) -> None:
        names = [m.name for m in self.policy.models]
        for name in list(self._states):
            if name not in names:
                del self._states[name]      # sweep: not re-declared
        for name in names:
            self._states.setdefault(name, _ModelState(PullInfo(model=name)))

    def _set(self, model: Model, **changes: object) -> None:
        with self._lock:
            st = self._states.get(model.name)
            if st is not None:
                st.info = replace(st.info, **changes)  # type: ignore[arg-type]

    def _rate(self) -> float:
        if self._engine_rate is not None:
            return self._engine_rate
        if len(self._samples) < 2:
            return 0.0
        now = self._samples[-1][0]
        while len(self._samples) > 2 and now - self._samples[0][0] > self.RATE_WINDOW:
            self._samples.popleft()
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) * 8 / (t1 - t0) if t1 > t0 else 0.0
