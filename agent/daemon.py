"""The daemon: the main loop and the state, and the control methods (status, reload, pause, resume).

The main thread owns every change of state. Signals (SIGHUP reload, SIGTERM/SIGINT stop) and
control requests from the socket's threads only queue work and wake the loop through one pipe;
the loop then reloads, ticks and notifies systemd. So a reload never races a tick, and a slow
control client never holds the loop (it waits in its own thread for the loop's answer).

Every tick (1 s) the loop checks the worker threads (the scheduler, backoff, control):
WATCHDOG=1 goes out only while all of them live, so systemd restarts a daemon whose worker died;
and it sends STATUS= when the one-line summary changed. Both come from what the parts hold in
memory (``Daemon.tick_summary``), not from the status document, whose netlink dumps and store scan
are paid only when someone asks (``wagent status``, the metrics job). Everything else that is
timed (polls, slots, windows, the shaping re-apply, store cleaning, metrics) is a job on the
scheduler.

The control methods (:meth:`status`, :meth:`reload`, :meth:`pause`, :meth:`resume`) are the
same whatever the transport: ``agent.control`` calls them for the Unix socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from agent import __version__
from agent.control import ControlError
from agent.mount.service import Mounts
from agent.notify import Notifier, WatchdogGate
from agent.policy import PolicyError
from agent.policy.model import Policy
from agent.status import DaemonState, PolicyInfo, TickSummary, one_line, to_json

log = logging.getLogger(__name__)

TICK = 1.0
STOP_BUDGET = 4.0          # seconds for the workers to stop; systemd's default is 90, ours is 5
EXIT_DEADLINE = 4.8        # after SIGTERM the process exits by then, stopped cleanly or not
RELOAD_WAIT = 120.0        # a control client waits this long for a reload's answer


@dataclass
class _Request:
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: ControlError | None = None


class Daemon:
    """Runs one :class:`agent.application.Application` until stopped."""

    def __init__(self, app: Any, notifier: Notifier, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 watchdog_interval: float | None = None,
                 hard_exit: Callable[[int], Any] | None = os._exit) -> None:
        self.app = app
        self.notifier = notifier
        self.clock = clock
        self.monotonic = monotonic
        self.gate = WatchdogGate(watchdog_interval)
        self.started_at = clock()
        self.parts: Any = None
        self.policy_info = PolicyInfo()
        # kind -> message, while that part of the tick keeps failing: status is degraded
        # for as long as it lasts, not forever after one bad tick (error_counts keep history)
        self.errors: dict[str, str] = {}
        self.error_counts: Counter[str] = Counter()
        self._requests: deque[_Request] = deque()
        self._stop = False
        self._stop_at: float | None = None
        self._hup_pending = False
        self._exit_timer: threading.Timer | None = None
        self.hard_exit = hard_exit
        self._rfd, self._wfd = os.pipe()
        for fd in (self._rfd, self._wfd):
            fl = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        self._dead_reported: set[str] = set()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, policy: Policy) -> None:
        """Builds and starts everything; raises (PolicyError, ShapingError, ControlError) when
        the daemon can't run, before READY, so systemd sees a failed start."""
        self.notifier.status("starting: applying shaping")
        self.parts = self.app.start(policy, self)
        self.policy_info = PolicyInfo(path=policy.path, sha256=policy.sha256,
                                      loaded_at=self.clock())

    def run(self, policy: Policy) -> int:
        # Signals first: a SIGHUP while shaping is applied must not kill the daemon (its
        # default action), and a SIGTERM then stops it right after start.
        previous = self._install_signals()
        try:
            self.start(policy)
            if not self._stop:
                self.tick()
                self.notifier.ready()
                log.info("wagent %s running, policy %s (sha256 %s)", __version__,
                         policy.path, policy.sha256[:12])
                self._loop()
        finally:
            self.notifier.stopping()
            self.notifier.status("stopping")
            self.app.stop(self.parts, self._stop_budget())
            if self._exit_timer is not None:
                self._exit_timer.cancel()       # stopped in time: a normal exit
            self._restore_signals(previous)
            os.close(self._rfd)
            os.close(self._wfd)
        log.info("stopped; caps left in place (`wagent shaping clear` removes them)")
        return 0

    def request_stop(self) -> None:
        """Ends the loop: SIGTERM and SIGINT call it, as may whoever runs the daemon in a thread
        of their own (where the signals stay with the main thread). Safe in a signal handler:
        it only sets flags and writes to the wake-up pipe."""
        if self._stop_at is None:
            self._stop_at = self.monotonic()
        self._stop = True
        self._wake()

    def _stop_budget(self) -> float:
        """What is left of STOP_BUDGET since the stop was asked for: a SIGTERM that came in
        the middle of a reload has already waited for it."""
        if self._stop_at is None:
            return STOP_BUDGET
        return max(0.5, STOP_BUDGET - (self.monotonic() - self._stop_at))

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._rfd, selectors.EVENT_READ)
        next_tick = self.monotonic()
        try:
            while not self._stop:
                now = self.monotonic()
                timeout = max(0.0, next_tick - now)
                wd = self.gate.next_in(now)
                if wd is not None:
                    timeout = min(timeout, wd)
                if sel.select(timeout):
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._rfd, 512):
                            pass
                while self._requests and not self._stop:
                    self._handle(self._requests.popleft())
                if self._stop:
                    break
                if self.monotonic() >= next_tick:
                    self.tick()
                    next_tick = self.monotonic() + TICK
                self._watchdog()
        finally:
            sel.close()
            for req in self._requests:   # nobody waits forever on a stopping daemon
                req.error = ControlError("the daemon is stopping", "stopping")
                req.done.set()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wfd, b"\0")

    # -- signals ----------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous   # embedded (tests): signals stay with the main thread's owner
        for sig, handler in ((signal.SIGHUP, self._on_sighup), (signal.SIGTERM, self._on_stop),
                             (signal.SIGINT, self._on_stop)):
            previous[sig] = signal.signal(sig, handler)
        previous[-1] = signal.set_wakeup_fd(self._wfd)
        return previous

    def _restore_signals(self, previous: dict[int, Any]) -> None:
        if not previous:
            return
        signal.set_wakeup_fd(previous.pop(-1))
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_sighup(self, signum: int, frame: object) -> None:
        # A storm of SIGHUPs is one reload: any reload not yet started reads the file as it
        # is when it runs, so a second queued one would only repeat it.
        if not self._hup_pending:
            self._hup_pending = True
            self._requests.append(_Request("reload"))

    def _on_stop(self, signum: int, frame: object) -> None:
        first = not self._stop
        self.request_stop()
        if first and self.hard_exit is not None:
            # Whatever the main thread is stuck in (a reload, a kernel call), the process is
            # gone within EXIT_DEADLINE: systemd and the issue ask for 5 s.
            self._exit_timer = threading.Timer(EXIT_DEADLINE, self._exit_now)
            self._exit_timer.daemon = True
            self._exit_timer.start()

    def _exit_now(self) -> None:
        log.error("not stopped within %g s of SIGTERM; exiting now (partials are kept, caps "
                  "stay in place)", EXIT_DEADLINE)
        assert self.hard_exit is not None
        self.hard_exit(0)

    # -- the tick ---------------------------------------------------------------------------
    def workers(self) -> dict[str, bool]:
        return self.app.workers(self.parts) if self.parts is not None else {}

    def tick(self) -> None:
        """The workers' liveness and the STATUS= line, from the cheap :meth:`tick_summary`:
        never the whole status document (netlink dumps, a store scan), which waits for someone
        to ask."""
        try:
            s = self.tick_summary()
            self._ok("status")
        except Exception as e:  # a bad read must not stop the daemon; the watchdog still runs
            log.exception("reading the daemon's summary failed")
            self._error("status", f"reading the daemon's summary failed: {e}")
            return
        self.notifier.status(one_line(s))
        for name, alive in s.workers.items():
            if not alive and name not in self._dead_reported:
                self._dead_reported.add(name)
                log.error("worker thread %s died; withholding the watchdog so systemd "
                          "restarts the daemon", name)

    def _watchdog(self) -> None:
        if self.gate.due(self.monotonic(), all(self.workers().values())):
            self.notifier.watchdog()

    def _error(self, kind: str, message: str) -> None:
        self.error_counts[kind] += 1
        if self.errors.get(kind) != message:
            log.warning("%s", message)
            self.errors[kind] = message

    def _ok(self, kind: str) -> None:
        if self.errors.pop(kind, None) is not None:
            log.info("%s works again", kind)

    # -- requests (main thread) -------------------------------------------------------------
    def _handle(self, req: _Request) -> None:
        if req.kind == "reload":
            self._hup_pending = False   # a SIGHUP from now on may find a newer file: queue it
        try:
            if req.kind == "reload":
                req.result = self._reload()
        except ControlError as e:
            req.error = e
        finally:
            req.done.set()

    def _reload(self) -> dict[str, Any]:
        self.notifier.reloading()
        self.notifier.status("reloading the policy")
        now = self.clock()
        try:
            try:
                new = self.app.load()
            except PolicyError as e:
                self._refuse(str(e), now)
            try:
                self.parts = self.app.reconcile(self.parts, new)
            except Exception as e:
                log.exception("applying the new policy failed")
                self._refuse(f"{new.path}: applying the new policy failed: {e}", now)
        finally:
            self.notifier.ready()
        self.policy_info = PolicyInfo(path=new.path, sha256=new.sha256, loaded_at=now,
                                      reloads=self.policy_info.reloads + 1)
        log.info("reloaded policy %s (sha256 %s)", new.path, new.sha256[:12])
        self.tick()
        return {"reloaded": True, "path": new.path, "sha256": new.sha256}

    def _refuse(self, message: str, now: float) -> NoReturn:
        self.error_counts["reload"] += 1
        self.policy_info = PolicyInfo(
            path=self.policy_info.path, sha256=self.policy_info.sha256,
            loaded_at=self.policy_info.loaded_at, last_error=message, last_error_at=now,
            reloads=self.policy_info.reloads)
        log.error("reload refused, the previous policy stays in force:\n%s", message)
        raise ControlError(f"reload refused; the previous policy stays in force:\n{message}",
                           "refused")

    # -- the control methods (any thread) ---------------------------------------------------
    def state(self) -> DaemonState:
        return self.app.snapshot(self.parts, DaemonState(
            pid=os.getpid(), started_at=self.started_at, version=__version__,
            workers=self.workers(), policy=self.policy_info, errors=tuple(self.errors.values()),
            error_counts=dict(self.error_counts + Counter(self.app.error_counts(self.parts)))))

    def status(self) -> dict[str, Any]:
        return to_json(self.state(), self.clock())

    def tick_summary(self) -> TickSummary:
        """What the tick reads (:class:`agent.status.TickSummary`)."""
        return self.app.tick_summary(self.parts, TickSummary(
            workers=self.workers(), reload_refused=self.policy_info.last_error is not None))

    def reload(self) -> dict[str, Any]:
        req = _Request("reload")
        self._requests.append(req)
        self._wake()
        if not req.done.wait(RELOAD_WAIT):
            raise ControlError(f"no answer from the main loop within {RELOAD_WAIT:g} s",
                               "timeout")
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def pause(self) -> dict[str, Any]:
        self.app.pause(self.parts)
        log.info("pulls paused")
        self._wake()
        return {"paused": True}

    def resume(self) -> dict[str, Any]:
        self.app.resume(self.parts)
        log.info("pulls resumed")
        self._wake()
        return {"paused": False}

    # -- lazy mounts (``wagent mount``: root's, agent.mount.service) --------------------------
    def _mounts(self) -> Mounts:
        if self.parts is None:
            raise ControlError("the daemon is starting; try again in a moment", "busy")
        return self.parts.mounts

    def mount(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._mounts().mount(args)

    def umount(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._mounts().umount(args)

    def serve_fuse(self, fds: list[int]) -> dict[str, Any]:
        if self.parts is None:
            for fd in fds:
                os.close(fd)
        return self._mounts().serve_fuse(fds)
