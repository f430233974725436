"""The daemon's pull worker: keeps this node's store at the versions the policy wants, at the
time its schedule allows, with up to ``pulls.concurrent_models`` models pulling at once.

Each model is one job on the daemon's scheduler (``agent.scheduler``, APScheduler). A run of the
job is one :meth:`Worker.step`, which moves the model on as far as it can now and says when it
wants its next look; the job is then armed for that time:

1. know the target version: the policy's, or ``{source}/{model}/latest`` polled at once at
   start, then at this node's poll times (``WorkerDeps.poll_after``: every ``poll_interval``, at
   a phase hashed from the node's id, so the plan knows them too); a failed poll keeps the last
   answer;
2. done if the store already has it (a version directory appears only once complete);
3. wait for this node's start: its wave slot (published + wave + per-node offset), at once if
   learned later, moved into its role's windows (``agent.schedule.start_at``): the job's next
   run *is* the slot, or the window's opening;
4. pull, with the shared token bucket and a stop event, once fewer than ``concurrent_models``
   models pull (else ``queued``, woken when one ends); a job armed at the window's closing
   stops it there. After publish: the current pointer, eviction.

Models don't wait for each other: a stuck source costs its own model a failure at the pull
engine's deadlines, and the other models' jobs run meanwhile. As a safety net, a pull that made
no progress (no byte moved) for longer than ``WorkerDeps.stall_after`` shows as ``stalled`` in its
model's status, which makes the daemon degraded.

The worker knows nothing of HTTP, the store's layout or the schedule's formula: it calls the
functions in :class:`WorkerDeps`, which ``agent.pull.node_pulls.NodePulls`` provides from the
real modules and tests build from fakes. Tests drive :meth:`step` by hand with a fake clock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agent.policy.model import Model, Policy
from agent.status import PullInfo, PullProgress

log = logging.getLogger(__name__)
# a model's figures while none of its pulls runs
NOT_PULLING: dict[str, Any] = {"streams": 0, "streams_chosen": 0, "streams_why": "",
                               "rate_bps": 0.0}

DEFAULT_STALL_AFTER = 600.0
QUEUED_RECHECK = 60.0          # a queued model looks again at least this often
MIN_POLL_WAIT = 0.1            # a poll_interval under this (0: every look) polls no more often
FAILED_STEP_RETRY = 10.0       # a step that raised (a bug) is tried again after this
# Polls of `latest` that failed in a row before the model shows as failed: one lost poll is a
# blip; three (15 min at the default interval) is a node that can't follow its model.
RESOLVE_FAILURES_FAILED = 3
# The longest a model's job sleeps: a slot or window years ahead (a publisher's far-future
# `published`) is looked at again daily, never handed to the scheduler as a time it can't hold.
MAX_WAIT = 86400.0


# (model, version, progress, stop) -> None; raises on failure (or on stop: partials are kept).
# ``progress`` gets the engine's reports as they are (agent.pull.engine.pull_version).
PullFn = Callable[[Model, str, Callable[[PullProgress], None], threading.Event], None]


@dataclass(frozen=True)
class WindowState:
    open: bool
    next_open: float | None = None
    closes_at: float | None = None


@dataclass
class WorkerDeps:
    clock: Callable[[], float]
    resolve: Callable[[Model], str]                         # "latest" -> a version
    published: Callable[[Model, str], float]                # the version's publication time
    # (model, version, published, now) -> (this node's wave slot, when it may start: the slot,
    # now if learned later, moved into the role's windows; None if no window ever opens)
    schedule: Callable[[Model, str, float, float], tuple[float, float | None]]
    window: Callable[[float], WindowState]                  # this node's role windows at a time
    have: Callable[[Model, str], bool]                     # version complete in the store?
    local_version: Callable[[Model], str | None]           # newest complete version in the store
    pull: PullFn
    evict: Callable[[], None]
    # (model, polled at, poll_interval) -> this node's next poll of the model's `latest`, the
    # first of its poll times after the poll at that time (agent.schedule.poll_after)
    poll_after: Callable[[Model, float, float], float]
    # The version complete in the store for a model: made current (the pointer an inference
    # server loads), its hook run. Returns the hook's outcome for status, if one ran; raises
    # on failure (shown, retried at the next step).
    ready: Callable[[Model, str], str | None] = field(default=lambda m, v: None)
    # Seconds without progress after which a pull shows as stalled: longer than any wait the
    # deadlines allow (agent.pull.node_pulls derives it from the pull options).
    stall_after: Callable[[], float] = field(default=lambda: DEFAULT_STALL_AFTER)
    # (model, version) -> a lazy mount shows it (agent.mount): an engine reads it now, so its
    # pull starts now, whatever the wave's slot or the role's windows say, and a closing window
    # doesn't stop it (its readers would wait for ever)
    mounted: Callable[[Model, str], bool] = field(default=lambda m, v: False)


class Jobs(Protocol):
    """What the worker needs of the scheduler (``agent.scheduler.Scheduler``)."""

    def at(self, when: float, func: Callable[..., object], *, job_id: str,
           args: tuple[object, ...] = ()) -> None: ...

    def cancel(self, job_id: str) -> bool: ...


@dataclass
class _Busy:
    """What a model's job is doing now, and its last sign of progress."""

    what: str                   # "resolving latest", "pulling v3", ...
    since: float                # start, or when bytes last moved
    moved: tuple[int, int] = (-1, -1)     # (done, fetched) at ``since``


@dataclass
class _ModelState:
    info: PullInfo
    resolved_at: float | None = None
    resolve_failures: int = 0       # polls of `latest` failed in a row
    retry_at: float | None = None
    failures: int = 0
    published: tuple[str, float] | None = None   # (version, its publication time)
    fetched_total: int = 0          # bytes counted by progress, across pulls (for metrics)
    current: tuple[str, threading.Event] | None = None   # the pull running: version, stop
    busy: _Busy | None = None
    ready: str | None = None        # the version last handed to deps.ready
    step_error: str | None = None   # the model's last step raised (status: degraded)


class Worker:
    def __init__(self, policy: Policy, deps: WorkerDeps) -> None:
        self.policy = policy
        self.deps = deps
        self._lock = threading.Lock()
        self._states: dict[str, _ModelState] = {}
        self._jobs: Jobs | None = None
        self._running: set[str] = set()       # models whose step runs now
        self._rerun: set[str] = set()         # woken while running: look again at once
        self._pulling: set[str] = set()       # models pulling now (at most concurrent_models)
        self._stopped = False
        self._paused = False
        self.failures_total = 0               # failed pulls since start (metrics)
        self._sync_models()

    # -- lifecycle, called from the daemon ----------------------------------------------------
    def start(self, jobs: Jobs) -> None:
        """Arm every model's job to run now."""
        self._jobs = jobs
        self.wake()

    def stop(self) -> None:
        """Cancel the jobs and stop the pulls (the scheduler's shutdown then joins them)."""
        with self._lock:
            self._stopped = True
            names = list(self._states)
        for name in names:
            self._cancel(name)
        self._interrupt_all("stopping")

    def pause(self) -> None:
        self._paused = True
        self._interrupt_all("paused")
        self.wake()

    def resume(self) -> None:
        self._paused = False
        self.wake()

    @property
    def paused(self) -> bool:
        return self._paused

    def update(self, policy: Policy) -> None:
        """Reload, mark and sweep: a model gone loses its job (its pull stops), a new one gets
        one, every kept model looks again at once (its slot may have moved)."""
        with self._lock:
            old = set(self._states)
            self.policy = policy
            self._sync_models()
            for st in self._states.values():
                st.resolved_at = None
                st.retry_at = None
            gone = old - set(self._states)
        for name in gone:
            self._cancel(name)
        self.supervise()
        self.wake()

    def wake(self, name: str | None = None) -> None:
        """Have a model (every model) look again now."""
        with self._lock:
            names = [name] if name is not None else list(self._states)
            for n in names:
                if n in self._running:
                    self._rerun.add(n)
                elif n in self._states:
                    self._arm(n, self.deps.clock())

    def poll_now(self, name: str) -> None:
        """Have a model poll ``latest`` now, not at its next poll time: the cluster's cache
        started a version (``agent.pull.tell``), or a node asked this cache for one it hasn't
        seen (pull-through). A wait before retrying a failed step still holds."""
        with self._lock:
            st = self._states.get(name)
            if st is not None:
                st.resolved_at = None
        self.wake(name)

    def supervise(self) -> None:
        """Stop each running pull that may no longer run: its model left the policy or wants
        another version, or the window closed. Armed at each window's closing; also on reload."""
        with self._lock:
            running = [(name, st.current) for name, st in self._states.items()
                       if st.current is not None]
        models = {m.name: m for m in self.policy.models}
        window_open = self.deps.window(self.deps.clock()).open
        for name, (version, stop) in running:
            model = models.get(name)
            if model is None:
                why = f"model {name} left the policy"
            elif model.version not in ("latest", version):
                why = f"policy now wants {name} {model.version}"
            elif not window_open and not self.deps.mounted(model, version):
                why = "window closed"
            else:
                continue
            self._interrupt(name, version, stop, why)

    def snapshot(self) -> tuple[PullInfo, ...]:
        with self._lock:
            now = self.deps.clock()
            limit = self.deps.stall_after()
            return tuple(replace(st.info, stalled=_stalled(st.busy, now, limit))
                         for st in self._states.values())

    def fetched_totals(self) -> dict[str, int]:
        with self._lock:
            return {name: st.fetched_total for name, st in self._states.items()}

    def window(self) -> WindowState:
        return self.deps.window(self.deps.clock())

    def errors(self) -> tuple[str, ...]:
        """Each model whose last step failed, and why (status is degraded meanwhile)."""
        with self._lock:
            return tuple(st.step_error for _, st in sorted(self._states.items())
                         if st.step_error)

    def pulling(self) -> int:
        """How many models pull now (they share the node's streams)."""
        with self._lock:
            return len(self._pulling)

    # -- the jobs -------------------------------------------------------------------------------
    def _job(self, name: str) -> None:
        """One run of a model's job: a step, then the job armed for the next look."""
        with self._lock:
            if self._stopped or name not in self._states:
                return
            self._running.add(name)
            self._rerun.discard(name)
        error = None
        try:
            wait = self.step(name)
        except Exception as e:  # one bad step must not end the model's job; status shows it
            log.exception("pull worker step for %s failed", name)
            error = f"the pull worker failed a step for {name} (retrying): {e}"
            wait = FAILED_STEP_RETRY
        with self._lock:
            st = self._states.get(name)
            if st is not None:
                st.step_error = error
            self._running.discard(name)
            if name in self._rerun:
                self._rerun.discard(name)
                wait = 0.0
            if not self._stopped and name in self._states:
                try:
                    self._arm(name, self.deps.clock() + min(max(0.0, wait), MAX_WAIT))
                except Exception as e:
                    # A job that can't be armed is a model that never looks again: keep it
                    # (a retry), and say why in status, which makes the daemon degraded.
                    log.exception("arming the job of %s failed", name)
                    if st is not None:
                        st.step_error = f"scheduling the next look at {name} failed " \
                                        f"(retrying): {e}"
                    self._arm(name, self.deps.clock() + FAILED_STEP_RETRY)

    def _arm(self, name: str, when: float) -> None:
        """(Under self._lock.) The model's job runs next at ``when``."""
        if self._jobs is not None and not self._stopped:
            self._jobs.at(when, self._job, job_id=f"model:{name}", args=(name,))

    def _cancel(self, name: str) -> None:
        if self._jobs is not None:
            self._jobs.cancel(f"model:{name}")
            self._jobs.cancel(f"window-close:{name}")

    # -- one step -------------------------------------------------------------------------------
    def step(self, name: str) -> float:
        """Moves one model on as far as it can now; returns seconds until it wants a look."""
        model = next((m for m in self.policy.models if m.name == name), None)
        st = self._states.get(name)
        if model is None or st is None:
            return self.policy.poll_interval
        d = self.deps
        now = d.clock()
        if st.retry_at is not None and now < st.retry_at:
            return st.retry_at - now
        version = model.version if model.version != "latest" else st.info.version
        if model.version == "latest" and self._poll_due(model, st, now):
            try:
                with self._working(st, "resolving latest"):
                    version = d.resolve(model)
            except Exception as e:
                st.resolved_at = now  # keep the last answer; poll again at the next poll time
                st.resolve_failures += 1
                error = f"resolving latest: {e}"
                if error != st.info.error:   # once per new error, not at every poll
                    log.warning("%s: %s", name, error)
                if st.resolve_failures >= RESOLVE_FAILURES_FAILED:
                    # No source answered (or each named a version that can't be one, like
                    # `current`) poll after poll: the node can't follow the model any more, which
                    # status must show (degraded), not a blip to ride out.
                    self._set(st, error=error, state="failed")
                else:
                    self._set(st, error=error)
                return self._until_poll(model, st, now)
            st.resolved_at = now
            st.resolve_failures = 0
            if st.info.error and st.info.error.startswith("resolving latest"):
                self._set(st, error=None)
        if version is None:
            return self._until_poll(model, st, now)
        local = d.local_version(model)
        if d.have(model, version):
            self._set(st, version=version, state="done", local_version=local, **NOT_PULLING)
            return self._made_ready(model, st, version, now)
        if st.published is None or st.published[0] != version:
            try:
                with self._working(st, f"reading the manifest of {version}"):
                    st.published = (version, d.published(model, version))
            except Exception as e:
                log.warning("publication time of %s %s unknown: %s", name, version, e)
                self._set(st, version=version, error=f"reading the manifest: {e}")
                st.retry_at = now + min(60.0, self.policy.poll_interval)
                return min(60.0, self.policy.poll_interval)
        slot_at, start_at = d.schedule(model, version, st.published[1], now)
        mounted = d.mounted(model, version)
        if mounted:
            start_at = now
        if start_at is None or now < start_at:
            window = d.window(now)
            state = "waiting_slot" if now < slot_at or window.open else "waiting_window"
            self._set(st, version=version, state=state, slot_at=slot_at, starts_at=start_at,
                      local_version=local)
            # A model that follows `latest` keeps polling while it waits: a version published
            # for a far future (or with a slot behind a window that never opens) must not hide
            # the next one `latest` names.
            wait = (start_at - now) if start_at is not None else MAX_WAIT
            if model.version == "latest":
                wait = min(wait, self._until_poll(model, st, now))
            return min(wait, MAX_WAIT)
        if not mounted and not d.window(now).open:   # start_at is in a window: a clock jump
            self._set(st, version=version, state="waiting_window", slot_at=slot_at,
                      starts_at=start_at, local_version=local)
            return 60.0
        if self._paused:
            self._set(st, version=version, state="paused", slot_at=slot_at, starts_at=start_at,
                      local_version=local)
            return self._until_poll(model, st, now)
        with self._lock:
            if len(self._pulling) >= self.policy.pulls.concurrent_models:
                queued = True
            else:
                queued = False
                self._pulling.add(name)
        if queued:
            self._set(st, version=version, state="queued", slot_at=slot_at, starts_at=start_at,
                      local_version=local)
            return QUEUED_RECHECK
        try:
            return self._pull(model, st, version, slot_at)
        finally:
            with self._lock:
                self._pulling.discard(name)
                waiting = [n for n, s in self._states.items() if s.info.state == "queued"]
            for n in waiting:
                self.wake(n)

    def _pull(self, model: Model, st: _ModelState, version: str, slot_at: float) -> float:
        d = self.deps
        stop = threading.Event()
        started = d.clock()
        with self._lock:
            st.current = (version, stop)
        self._set(st, version=version, state="pulling", slot_at=slot_at, started_at=started,
                  bytes_done=0, bytes_total=None, rate_bps=0.0, error=None, finished_at=None)
        closes_at = d.window(started).closes_at
        if closes_at is not None and self._jobs is not None:
            self._jobs.at(closes_at, self.supervise, job_id=f"window-close:{model.name}")
        last_fetched = [0]

        def progress(p: PullProgress) -> None:
            with self._lock:
                st.fetched_total += max(0, p.bytes_fetched - last_fetched[0])
                last_fetched[0] = p.bytes_fetched
                _moved(st.busy, p.bytes_done, p.bytes_fetched, d.clock())
                st.info = st.info.progressed(p)

        try:
            with self._working(st, f"pulling {version}"):
                d.pull(model, version, progress, stop)
        except Exception as e:
            if stop.is_set():
                # stopped on purpose (pause, window, reload, shutdown): partials are kept
                self._set(st, state="paused" if self._paused else "idle", **NOT_PULLING)
                return 0.1
            self.failures_total += 1
            st.failures += 1
            delay = min(self.policy.poll_interval, 10.0 * 2 ** min(st.failures - 1, 6))
            st.retry_at = d.clock() + delay
            log.warning("pull %s %s failed (retry in %.0f s): %s", model.name, version, delay, e)
            self._set(st, state="failed", error=str(e), **NOT_PULLING)
            return delay
        finally:
            with self._lock:
                st.current = None
            if self._jobs is not None:
                self._jobs.cancel(f"window-close:{model.name}")
        if stop.is_set() and not d.have(model, version):
            self._set(st, state="paused" if self._paused else "idle", **NOT_PULLING)
            return 0.1
        st.failures = 0
        self._set(st, state="done", finished_at=d.clock(), **NOT_PULLING,
                  error=None, local_version=version)
        log.info("pulled %s %s", model.name, version)
        wait = self._made_ready(model, st, version, d.clock())
        try:
            d.evict()
        except Exception as e:
            log.warning("eviction after %s %s failed: %s", model.name, version, e)
            self._set(st, error=f"eviction: {e}")
        return wait

    def _made_ready(self, model: Model, st: _ModelState, version: str, now: float) -> float:
        """The version is complete: hand it to ``deps.ready`` once (current pointer, hook).
        Returns seconds until the model's next look."""
        if st.ready == version:
            return self._until_poll(model, st, now)
        try:
            hook = self.deps.ready(model, version)
        except Exception as e:
            log.warning("%s %s is complete but making it current failed: %s", model.name,
                        version, e)
            self._set(st, error=f"making {version} current: {e}")
            return min(60.0, self.policy.poll_interval)
        st.ready = version
        if hook is not None:
            self._set(st, on_ready=hook)
        if st.info.error and st.info.error.startswith("making "):
            self._set(st, error=None)
        return self._until_poll(model, st, now)

    # -- polls ----------------------------------------------------------------------------------
    def _poll_due(self, model: Model, st: _ModelState, now: float) -> bool:
        """Whether to poll ``latest`` now: at once after a start or a reload (a restarted
        daemon doesn't wait up to an interval), then once one of this node's poll times has
        come since the last poll."""
        return st.resolved_at is None or self._poll_after(model, st.resolved_at) <= now

    def _poll_after(self, model: Model, polled: float) -> float:
        return self.deps.poll_after(model, polled, self.policy.poll_interval)

    def _until_poll(self, model: Model, st: _ModelState, now: float) -> float:
        """Seconds until the model's next look: its next poll time (a pinned model, which
        doesn't poll, looks again every poll interval). Never negative, and at least
        ``MIN_POLL_WAIT`` when the interval is shorter: an interval of 0 must not spin."""
        interval = self.policy.poll_interval
        if model.version != "latest" or st.resolved_at is None:
            return max(interval, MIN_POLL_WAIT)
        wait = max(0.0, self._poll_after(model, st.resolved_at) - now)
        return max(wait, MIN_POLL_WAIT) if interval < MIN_POLL_WAIT else wait

    # -- state ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _working(self, st: _ModelState, what: str) -> Iterator[None]:
        with self._lock:
            st.busy = _Busy(what, self.deps.clock())
        try:
            yield
        finally:
            with self._lock:
                st.busy = None

    def _interrupt(self, name: str, version: str, stop: threading.Event, why: str) -> None:
        if not stop.is_set():
            log.info("stopping pull of %s %s: %s", name, version, why)
            stop.set()

    def _interrupt_all(self, why: str) -> None:
        with self._lock:
            running = [(name, st.current) for name, st in self._states.items()
                       if st.current is not None]
        for name, (version, stop) in running:
            self._interrupt(name, version, stop, why)

    def _sync_models(self) -> None:
        names = [m.name for m in self.policy.models]
        for name in list(self._states):
            if name not in names:
                del self._states[name]      # sweep: not re-declared
        for name in names:
            self._states.setdefault(name, _ModelState(PullInfo(model=name)))

    def _set(self, st: _ModelState, **changes: object) -> None:
        with self._lock:
            st.info = replace(st.info, **changes)  # type: ignore[arg-type]


def _moved(busy: _Busy | None, done: int, fetched: int, now: float) -> None:
    """Progress: bytes present or received changed."""
    if busy is not None and busy.moved != (done, fetched):
        busy.since, busy.moved = now, (done, fetched)


def _stalled(busy: _Busy | None, now: float, limit: float) -> str | None:
    """Why a model's job counts as stuck: no progress for longer than it may."""
    if busy is None:
        return None
    idle = now - busy.since
    if idle <= limit:
        return None
    return (f"no progress for {idle:.0f} s while {busy.what} (the deadlines allow {limit:.0f} s): "
            "the pull worker is stuck")
