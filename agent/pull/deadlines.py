"""Deadlines and stop events of requests in flight, enforced by shutting their sockets down.

A read timeout bounds each read, not a whole wait: a server trickling its headers a byte per read
timeout would hold a request for ever. So every request also has deadlines: its response headers
within ``Timeouts.headers_deadline`` of its start, and a small document's body (manifest,
``latest``) within a bound scaled by its size. One :class:`Watchdog` thread per ``Connections``
(``agent.pull.connections``) enforces them, and each client's stop event, by shutting the
request's socket down: a blocked read then ends at once (EOF or an error). The thread runs while
a request is watched and ends when none is.

    dog = Watchdog()
    w = Watch(timeouts.headers_deadline, "the response headers", stop, dog.clock())
    dog.add(w)            # w.conn is set when a pool hands the request its connection
    dog.renew(w, None, "the body")      # the next phase: no deadline, the stop event still holds
    dog.remove(w)

No HTTP library here: a watch's ``conn`` is anything with a ``sock`` attribute once connected
(http.client's connections have one).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    read: float = 30.0
    # The whole wait for a response's headers, from the request's start. None: connect + read,
    # what a healthy server needs at worst.
    headers: float | None = None
    # A small document's body must arrive within one read timeout plus its size at this rate
    # (bytes/s): 256 KiB/s gives a 2 MB manifest 38 s and the largest one (64 MiB) under 5 min.
    small_rate: float = 256 * 1024

    @property
    def headers_deadline(self) -> float:
        return self.headers if self.headers is not None else self.connect + self.read

    def small_body_deadline(self, size: int) -> float:
        return self.read + size / self.small_rate


class Watch:
    """One request in flight as the watchdog sees it: when it must be done, the stop event that
    ends it early, and the connection it runs on (set when a pool hands it out)."""

    def __init__(self, limit: float | None, what: str, stop: threading.Event | None,
                 now: float) -> None:
        self.limit = limit                  # seconds, for the message
        self.what = what                    # what must arrive by then, for the message
        self.deadline = None if limit is None else now + limit
        self.stop = stop
        self.conn: Any = None
        self.cut: str | None = None         # "deadline" or "stopped", once cut
        self.shut = False                   # its socket is shut down

    def why(self) -> str:
        if self.cut == "stopped":
            return "stopped"
        return f"{self.what} did not arrive within {self.limit:g} s"


class Watchdog:
    """One thread cutting every watched request that passed its deadline or whose stop event is
    set; it runs while there is a watch, and is started again by the next one."""

    TICK = 0.1          # how soon a stop event is seen, and a socket not made yet retried

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None

    def add(self, w: Watch) -> None:
        with self._cond:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, w: Watch) -> None:
        with self._cond:
            self._watches.discard(w)
            if not self._watches:
                self._cond.notify()         # the thread ends

    def renew(self, w: Watch, limit: float | None, what: str) -> None:
        """The next phase of a request: ``limit`` seconds from now (None: no deadline)."""
        with self._cond:
            if w.cut is None:
                w.limit, w.what = limit, what
                w.deadline = None if limit is None else self.clock() + limit
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while self._watches:
                self._cond.wait(self._sweep(self.clock()))
            self._thread = None             # under the lock: the next add starts another

    def _sweep(self, now: float) -> float | None:
        """Cut what is due; seconds until the next look (None: until something changes)."""
        wait: float | None = None
        for w in self._watches:
            if w.cut is None:
                if w.stop is not None and w.stop.is_set():
                    w.cut = "stopped"
                elif w.deadline is not None and now >= w.deadline:
                    w.cut = "deadline"
            if w.cut is not None and not w.shut:
                w.shut = shut_socket(getattr(w.conn, "sock", None))
            for due in self._due(w, now):
                wait = due if wait is None else min(wait, due)
        return wait

    def _due(self, w: Watch, now: float) -> list[float]:
        if w.cut is not None:
            return [] if w.shut else [self.TICK]       # still connecting: no socket yet
        due = [self.TICK] if w.stop is not None else []
        if w.deadline is not None:
            due.append(w.deadline - now)
        return due


def shut_socket(sock: object) -> bool:
    """Shut a socket down for both directions; False if there is none (yet)."""
    if not isinstance(sock, socket.socket):
        return False
    with contextlib.suppress(OSError):
        # socket.socket's own shutdown, also for TLS: SSLSocket's drops its TLS state, which a
        # read in another thread may be using right now.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    return True
