"""systemd's notify protocol (sd_notify), through sdnotify, behind one small class.

The unit is ``Type=notify`` with ``WatchdogSec=``: systemd waits for READY=1 before it calls the
start done (wagent sends it only once its caps are in the kernel, so "started" means "shaped"),
and restarts the daemon if WATCHDOG=1 stops coming. The daemon's main loop sends WATCHDOG=1 only
while its worker threads are alive: a daemon whose scheduler or backoff thread died is restarted
rather than left looking healthy.

systemd's file descriptor store keeps what the daemon hands it across a restart: the lazy
mount's /dev/fuse descriptor (``agent.mount``), without which the mount dies with the process
("transport endpoint is not connected"). sdnotify sends text only, so that one message (FDSTORE=1
with the descriptor, SCM_RIGHTS) goes out on a socket of its own (:func:`store_fd`); the next
process gets it back as LISTEN_FDS (:func:`inherited_fds`).

The sender is a callable taking the message, so tests record the sequence without a socket:

>>> sent = []
>>> n = Notifier(sent.append)
>>> n.status("idle"); n.status("idle"); n.ready()
>>> sent
['STATUS=idle', 'READY=1']
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import sdnotify

SD_LISTEN_FDS_START = 3


def inherited_fds(env: Mapping[str, str], pid: int) -> dict[str, int]:
    """The descriptors systemd passed to this process (its fd store after a restart), by name
    (sd_listen_fds_with_names(3)); none unless LISTEN_PID is this process.

    >>> inherited_fds({"LISTEN_PID": "7", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}, 7)
    {'a': 3, 'b': 4}
    >>> inherited_fds({"LISTEN_PID": "8", "LISTEN_FDS": "1"}, 7)
    {}
    """
    if env.get("LISTEN_PID", "") != str(pid):
        return {}
    try:
        n = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":")
    return {(names[i] if i < len(names) and names[i] else "unknown"): SD_LISTEN_FDS_START + i
            for i in range(max(0, n))}


def store_fd(fd: int, name: str, env: Mapping[str, str]) -> bool:
    """Hands ``fd`` to systemd's fd store under ``name`` (``FileDescriptorStoreMax=`` in the
    unit); False when no service manager listens (not under systemd), so the caller can say
    what a restart will lose."""
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]                 # an abstract socket
    message = f"FDSTORE=1\nFDNAME={name}".encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(path)
        socket.send_fds(s, [message], [fd])
    return True


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 messages: half of WATCHDOG_USEC, as sd_watchdog_enabled(3)
    advises; None when systemd doesn't watch this process."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(pid):
        return None     # the variable was meant for another process (e.g. a wrapper)
    return int(usec) / 2 / 1e6


class WatchdogGate:
    """Decides when the main loop pings: every ``interval`` seconds, and only while every
    worker is alive. Pure; the clock is the caller's."""

    # After a look that found a worker dead, the next look waits this long (at most an interval):
    # a ping that stays due would otherwise make the main loop spin until systemd restarts it.
    RECHECK = 1.0

    def __init__(self, interval: float | None) -> None:
        self.interval = interval
        self._last: float | None = None
        self._withheld: float | None = None     # when a look last found a worker dead

    def due(self, now: float, workers_alive: bool) -> bool:
        if self.interval is None:
            return False
        if not workers_alive:
            self._withheld = now
            return False
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True

    def next_in(self, now: float) -> float | None:
        """Seconds until the next ping is due, for the main loop's wait."""
        if self.interval is None:
            return None
        at = 0.0 if self._last is None else self._last + self.interval
        if self._withheld is not None:
            at = max(at, self._withheld + min(self.interval, self.RECHECK))
        return max(0.0, at - now)


def _sdnotify_sender() -> Callable[[str], None]:
    notifier = sdnotify.SystemdNotifier()
    return notifier.notify


class Notifier:
    """READY, STATUS, WATCHDOG, RELOADING and STOPPING, with STATUS sent only when it changes."""

    def __init__(self, send: Callable[[str], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._send = send if send is not None else (
            _sdnotify_sender() if os.environ.get("NOTIFY_SOCKET") else (lambda _msg: None))
        self._monotonic = monotonic
        self._status: str | None = None

    def ready(self) -> None:
        self._send("READY=1")

    def status(self, line: str) -> None:
        line = line.replace("\n", " ")
        if line != self._status:
            self._status = line
            self._send(f"STATUS={line}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def reloading(self) -> None:
        # systemd >= 253 (Type=notify-reload) wants the monotonic timestamp with RELOADING=1.
        usec = int(self._monotonic() * 1e6)
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        self._send("STOPPING=1")
