"""The daemon's side of peers: its piece server, its catalog, and its place in the swarm.

Built by the application for every policy; runs a server only while ``peers.enabled``. A
reload that changes the peers' settings restarts the server (its port, its bounds); the
swarm (``peers.hosts`` resolved) is looked at again at most once a minute, so a DNS name that
lists a cluster's nodes follows the cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.peers import members
from agent.peers.catalog import Catalog
from agent.peers.server import PeerServer, Served
from agent.peers.swarm import Swarm, url
from agent.policy.model import Peers, Policy
from agent.pull.demand import Demand
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket

log = logging.getLogger(__name__)

RESOLVE_EVERY = 60.0


class PeerServiceError(Exception):
    """The server can't listen (a port taken): the message says which."""


class PeerService:
    def __init__(self, policy: Policy, store: Callable[[], Store], demand: Demand,
                 poke: Callable[[str], bool] | None,
                 clock: Callable[[], float] = time.monotonic,
                 told: Callable[[str], bool] | None = None) -> None:
        self.policy = policy
        self.store = store
        self.demand = demand
        self.clock = clock
        self.catalog = Catalog(store, poke, clock, told)
        self.upload = TokenBucket(policy.peers.upload if policy.peers.enabled else None)
        self.server: PeerServer | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._swarm: tuple[float, Swarm | None] | None = None
        self._peers: tuple[float, frozenset[str]] | None = None
        self._past = Served()          # what servers stopped by a reload had sent

    def start(self) -> None:
        p = self.policy.peers
        if not p.enabled:
            return
        self.upload.set_rate(p.upload)
        try:
            self.server = PeerServer(p.listen, p.port, self.catalog, self.demand, self.store,
                                     upload=self.upload, wait=lambda: self.policy.peers.wait,
                                     max_connections=p.connections, is_peer=self.is_peer,
                                     in_swarm=lambda: self.swarm() is not None,
                                     clock=self.clock)
        except OSError as e:
            self.error = f"peers: can't listen on {p.listen}:{p.port}: {e.strerror or e}"
            log.error("%s", self.error)
            return
        self.error = None
        self.server.start()
        log.info("serving peers on %s:%d", p.listen, self.server.port)

    def stop(self) -> None:
        if self.server is not None:
            s = self.server
            with s.lock:
                for k in ("bytes", "requests", "waited", "refused", "busy"):
                    setattr(self._past, k, getattr(self._past, k) + getattr(s.served, k))
            s.stop()
            self.server = None

    def update(self, policy: Policy) -> None:
        old: Peers = self.policy.peers
        self.policy = policy
        with self._lock:
            self._swarm = self._peers = None
        if policy.peers != old or self.server is None:
            self.stop()
            self.start()

    def swarm(self) -> Swarm | None:
        """Who this node asks for pieces now (None: peers are off, or it is not among them)."""
        p = self.policy.peers
        if not p.enabled:
            return None
        now = self.clock()
        with self._lock:
            if self._swarm is not None and now - self._swarm[0] < RESOLVE_EVERY:
                return self._swarm[1]
        s = members.swarm(p.hosts, p.port, p.neighbors)
        with self._lock:
            self._swarm = (now, s)
        return s

    def is_peer(self, address: str) -> bool:
        """``address`` is one of the cluster's peers (``peers.hosts`` resolved, at most once a
        minute): it gets one piece at a time from this node, and is never held."""
        return address.removeprefix("::ffff:") in self._resolved()

    def cluster_urls(self) -> tuple[str, ...]:
        """Every peer's piece server but this node's own (a cache tells them of a version it
        starts: ``agent.pull.tell``); none while peers are off."""
        p = self.policy.peers
        if not p.enabled:
            return ()
        return tuple(url(a, p.port) for a in sorted(self._resolved())
                     if not members.is_local(a))

    def _resolved(self) -> frozenset[str]:
        now = self.clock()
        with self._lock:
            known = self._peers
        if known is None or now - known[0] >= RESOLVE_EVERY:
            known = (now, frozenset(members.resolve(self.policy.peers.hosts)))
            with self._lock:
                self._peers = known
        return known[1]

    def served(self) -> Served:
        """What this node's servers sent since the daemon started."""
        out = Served(**self._past.__dict__)
        s = self.server
        if s is not None:
            with s.lock:
                for k in ("bytes", "requests", "waited", "refused", "busy"):
                    setattr(out, k, getattr(out, k) + getattr(s.served, k))
        return out

    def status(self) -> dict[str, object]:
        """The status document's ``peers`` (docs/status.md)."""
        p = self.policy.peers
        with self._lock:
            seen = self._swarm[1] if self._swarm is not None else None
        served = self.served()
        return {"enabled": p.enabled, "serving": self.server is not None,
                "port": self.server.port if self.server is not None else None,
                "peers": len(seen.peers) if seen is not None else 0,
                "in_swarm": seen is not None, "served_bytes": served.bytes,
                "served_requests": served.requests, "served_waited": served.waited,
                "refused": served.refused, "busy": served.busy, "error": self.error}
