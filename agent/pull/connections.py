"""The pulls' connections of one owner: the deadline watchdog and the pull sockets' registry.

No process globals: :class:`agent.application.Application` makes one ``Connections`` for the
daemon, ``wagent pull`` and ``wagent store verify --repair`` one for their pulls, and each hands
it to every ``Client`` it makes (through the pull engine). Its ``sockets`` is the registry the
backoff loop clamps (``agent.yielding.sockets.PullSockets``), so the daemon passes the same one
to its ``ShapingRuntime``.

    connections = Connections()                     # or Connections(PullSockets(), Watchdog())
    runtime = ShapingRuntime(policy, bucket, sockets=connections.sockets)
    pull_version(sources, model, version, store, connections=connections)

Every session a client mounts ``adapter()`` on: its pools tell the watch of the request being made
in that thread (``requesting``) which connection it got, before any header arrives, and register
each socket once connected.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agent.pull import urllib3_adapter
from agent.pull.deadlines import Watch, Watchdog
from agent.s3.auth import S3Auths
from agent.yielding.sockets import PullSockets


class Connections:
    def __init__(self, sockets: PullSockets | None = None,
                 watchdog: Watchdog | None = None) -> None:
        """``sockets``, ``watchdog``: new ones unless given."""
        self.sockets = sockets if sockets is not None else PullSockets()
        self.watchdog = watchdog if watchdog is not None else Watchdog()
        self._current = threading.local()   # .watch: the request this thread is making, if any
        self._pools = urllib3_adapter.pool_classes(self._handed_out, self.sockets.register)
        # s3:// sources' credentials, resolved once for all of the owner's streams
        self.s3 = S3Auths()

    def side(self) -> Connections:
        """The same watchdog and credentials, with sockets that no backoff clamps: for what a
        pull reads beside its bytes (a neighbour's have-map, a line at each change). A socket
        that carries a trickle must not count among those the pull's window is shared by: six
        of them beside three streams cut each stream's window to a third."""
        side = Connections(PullSockets(), self.watchdog)
        side.s3 = self.s3
        return side

    def adapter(self) -> urllib3_adapter.PoolsAdapter:
        """A requests adapter for one session: one connection, requests' own retries off (the
        engine retries, across sources, with backoff)."""
        return urllib3_adapter.PoolsAdapter(self._pools, pool_connections=1, pool_maxsize=1,
                                            max_retries=0)

    @contextmanager
    def requesting(self, w: Watch) -> Iterator[None]:
        """While this thread makes the request ``w`` watches: the connection its pool hands out
        becomes ``w.conn``."""
        self._current.watch = w
        try:
            yield
        finally:
            self._current.watch = None

    def _handed_out(self, conn: Any) -> None:
        w = getattr(self._current, "watch", None)
        if w is not None:
            w.conn = conn
