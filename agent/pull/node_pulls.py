"""This node's pulls as the daemon's worker sees them: where a model's latest version is, when it
was published, when this node may pull it, the pull itself, and what follows it.

:class:`agent.pull.worker.Worker` decides *when* to call each of these; :class:`NodePulls` holds
the rules of *what* each does on this node, so that they can be read and tested in one place
(``tests/unit/test_node_pulls.py``, against loopback servers and a real store). The methods are
the :class:`agent.pull.worker.WorkerDeps` functions of the same names; ``agent.application``
builds one ``NodePulls`` and hands its bound methods to the worker.

The rules:

1. A cache node polls past the cache tier (``agent.announce.latest_sources``), and past any
   source whose ``latest`` it announced itself (said once per source, not at every poll).
2. The publication time is the manifest's; a manifest without one counts from when this node
   first learned of the version, kept in ``{state_dir}/seen.json`` so that a restart keeps the
   slot where it was.
3. The manifest fetched for the publication time is the one the pull of that version uses:
   one fetch per pull (a retry after a failed pull fetches it afresh).
4. Models pulling at once share the node's streams evenly (and its token bucket).
5. After a pull, a cache node names the version in ``{model}/latest``
   (:meth:`NodePulls.announce`, the same function that announces what the store holds at start
   and on reload): its cluster then polls it rather than the origin.
6. A complete version is made current, then its ``on_ready`` hook runs (once per switch).
7. A pull stalls after the longest wait its deadlines allow without a byte moving, and a minute.
8. A cache node, as it starts offering a version to its peers, tells them to look now
   (``agent.pull.tell``); a node told looks now for a model of its policy (:meth:`told`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path

from agent import announce, schedule
from agent.durable import write_atomic
from agent.hooks import run_hook
from agent.identity import Identity
from agent.manifest import MAX_MANIFEST_BYTES, Manifest, published_ts
from agent.policy.model import Model, Policy, Source
from agent.pull import engine, tell
from agent.pull.connections import Connections
from agent.pull.demand import Demand
from agent.pull.options import PullOptions
from agent.pull.swarm import Peers
from agent.pull.transfer import RETRY_AFTER_CAP
from agent.pull.worker import WindowState
from agent.status import PullProgress
from agent.store import Store, pointers, space
from agent.yielding.ratelimit import TokenBucket

log = logging.getLogger(__name__)

HORIZON = 366 * 86400.0  # how far ahead a window's closing is looked for
SEEN = "seen.json"       # in the state directory: when this node first learned of a version


class NodePulls:
    """The worker's functions for one node. ``pulling`` says how many models pull now (the
    worker's count); ``clock`` is the wall clock; ``connections`` the daemon's (its watchdog and
    the pull sockets' registry its backoff loop clamps). :meth:`update` follows a reload."""

    def __init__(self, policy: Policy, identity: Identity, store: Store, bucket: TokenBucket, *,
                 clock: Callable[[], float], pulling: Callable[[], int],
                 connections: Connections) -> None:
        self.connections = connections
        self.policy = policy
        self.identity = identity
        self.store = store
        self.bucket = bucket
        self.clock = clock
        self.pulling = pulling
        self._options = PullOptions.from_policy(policy.pulls)
        self._told: set[str] = set()        # own announcements already warned about
        self._lock = threading.Lock()
        # model -> (version, raw manifest, manifest) fetched by ``published``, for its pull
        self._manifests: dict[str, tuple[str, bytes, Manifest]] = {}
        # Lazy mounts (``agent.mount``): their readers wait on the pulls here, and the versions
        # they show are never evicted. Set by the application once the mounts exist.
        self.demand: Demand | None = None
        self.mounted: Callable[[], Mapping[str, Collection[str]]] = dict
        # The cluster's peers (``agent.peers``), set by the application when the policy has
        # them: who to ask for each piece, and what this node serves while it pulls.
        self.swarm: Callable[[], Peers | None] = lambda: None
        self.offer: Callable[[Manifest, bytes], AbstractContextManager[None]] | None = None
        self.poll_now: Callable[[str], None] = lambda model: None    # the worker's
        # Every peer's piece server (their base URLs), whom a cache tells of a version it starts
        self.cluster: Callable[[], Sequence[str]] = tuple

    def update(self, policy: Policy, identity: Identity, store: Store) -> None:
        """A reload: the calls from now on read the new policy, role and store."""
        self.policy, self.identity, self.store = policy, identity, store
        self._options = PullOptions.from_policy(policy.pulls)

    @property
    def cache_node(self) -> bool:
        return self.identity.role == self.policy.cache_role

    @property
    def sources(self) -> tuple[Source, ...]:
        """Where this node fetches manifests and pieces: the policy's sources, but a cache node
        fills the tier and never fetches from it (from itself, its piece server would hold the
        request for the very version it is about to look for)."""
        sources = self.policy.sources
        if self.cache_node:
            sources = tuple(s for s in sources if not s.cache) or sources
        return sources

    def look_now(self, model: str) -> bool:
        """Pull-through: a node asked this cache for a version of ``model`` it hasn't seen, so
        it polls now rather than at its next poll; False on a node that isn't a cache (it
        follows its own schedule, whoever asks)."""
        if not self.cache_node:
            return False
        self.poll_now(model)
        return True

    def told(self, model: str) -> bool:
        """The cluster's cache started a version of ``model`` (``agent.pull.tell``): look now,
        on any node. False: not a model of this node's policy."""
        if not any(m.name == model for m in self.policy.models):
            return False
        self.poll_now(model)
        return True

    def options(self) -> PullOptions:
        """The pulls' options, built from the policy's ``pulls`` once per policy."""
        return self._options

    # -- which version, published when ----------------------------------------------------------
    def resolve(self, model: Model) -> str:
        """The version ``latest`` names (rule 1)."""
        sources = announce.latest_sources(self.policy.sources, self.cache_node)
        return engine.resolve_latest(sources, model.name, self.options(),
                                     self_id=self.identity.node_id, on_self=self._own_latest,
                                     connections=self.connections)

    def _own_latest(self, why: str) -> None:
        with self._lock:
            if why in self._told:          # once per source, not at every poll
                return
            self._told.add(why)
        log.warning("%s", why)

    def published(self, model: Model, version: str) -> float:
        """The version's publication time (rules 2 and 3)."""
        raw, manifest = engine.fetch_manifest(self.sources, model.name, version,
                                              self.options(), connections=self.connections)
        with self._lock:
            self._manifests[model.name] = (version, raw, manifest)
        try:
            return published_ts(manifest.published)
        except (ValueError, TypeError):
            return self.first_seen(model.name, version)

    def first_seen(self, model: str, version: str) -> float:
        """When this node first learned of a version (now, the first time it is asked)."""
        path = Path(self.policy.state_dir) / SEEN
        with self._lock:
            try:
                seen = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                seen = {}
            key = f"{model}/{version}"
            if key not in seen:
                seen[key] = self.clock()
                write_atomic(path, json.dumps(seen, indent=1, sort_keys=True).encode(),
                             mode=0o600)
            return float(seen[key])

    # -- when ----------------------------------------------------------------------------------
    def schedule(self, model: Model, version: str, published: float, now: float
                 ) -> tuple[float, float | None]:
        """This node's wave slot, and when it may start (``agent.schedule``)."""
        p, ident = self.policy, self.identity
        return (schedule.slot(published, ident.node_id, ident.role, model.name, version, p),
                schedule.start_at(published, now, ident.node_id, ident.role, model.name,
                                  version, p))

    def poll_after(self, model: Model, polled: float, interval: float) -> float:
        return schedule.poll_after(polled, self.identity.node_id, model.name, interval)

    def window(self, now: float) -> WindowState:
        """Whether this node's role windows are open at ``now``, and until or from when."""
        windows = schedule.windows_for(self.policy, self.identity.role)
        if not windows:
            return WindowState(True)
        if schedule.is_open(windows, now):
            closes = schedule.open_until(windows, now, horizon=HORIZON)
            # windows that chain past the horizon never close: say so, not "in 400 days"
            return WindowState(True, closes_at=closes if closes < now + HORIZON else None)
        return WindowState(False, next_open=schedule.next_opening(windows, now))

    def stall_after(self) -> float:
        """Rule 7: the largest manifest at its slowest, or a request cut at its headers
        deadline or by the goodput floor followed by the longest backoff, or the longest
        Retry-After a busy source is granted; and a minute more."""
        o = self.options()
        t = o.timeouts
        return 60.0 + t.headers_deadline + max(
            t.small_body_deadline(MAX_MANIFEST_BYTES),
            o.goodput_grace + o.goodput_average_over + max(o.backoff_cap, RETRY_AFTER_CAP))

    # -- the store -----------------------------------------------------------------------------
    def have(self, model: Model, version: str) -> bool:
        return self.store.installed(model.name, version) is not None

    def is_mounted(self, model: Model, version: str) -> bool:
        return version in self.mounted().get(model.name, ())

    def manifest(self, model: Model, version: str) -> Manifest:
        """A version's manifest: the store's when it is there, else the sources'."""
        m = self.store.installed(model.name, version)
        if m is not None:
            return m
        return engine.fetch_manifest(self.sources, model.name, version, self.options(),
                                     connections=self.connections)[1]

    def local_version(self, model: Model) -> str | None:
        versions = self.store.versions(model.name)
        return versions[0].version if versions else None

    def evict(self) -> None:
        """The policy's eviction (with the store's cleaning): after each pull, and hourly."""
        p = self.policy
        pins: dict[str, set[str]] = {m.name: set(m.pin) for m in p.models}
        for model, versions in self.mounted().items():
            pins.setdefault(model, set()).update(versions)
        removed = space.evict(
            self.store, keep=p.store.keep_versions, pins=pins,
            max_size=p.store.max_size, now=self.clock(), evict_after=p.store.evict_after)
        for r in removed:
            log.info("evicted %s %s (%d bytes)", r.kind, r.name, r.size)

    # -- the pull and what follows it ----------------------------------------------------------
    def pull(self, model: Model, version: str, progress: Callable[[PullProgress], None],
             stop: threading.Event) -> None:
        """Pull the version (rules 3 and 4), then announce it on a cache node (rule 5)."""
        o = self.options()
        o = replace(o, streams=max(1, o.streams // max(1, self.pulling())),
                    peer_wait=self.policy.peers.wait)
        with self._lock:
            held = self._manifests.pop(model.name, None)
        fetched = held[1:] if held is not None and held[0] == version else None
        engine.pull_version(self.sources, model.name, version, self.store, options=o,
                            bucket=self.bucket, progress=progress, stop=stop, manifest=fetched,
                            connections=self.connections, demand=self.demand,
                            peers=None if self.cache_node else self.swarm(),
                            offer=self._telling(self.offer) if self.cache_node else self.offer)
        # The version is published and durable by now; the pull succeeded whatever happens in
        # the announcement.
        self.announce(model.name, version)

    def _telling(self, offer: Callable[[Manifest, bytes], AbstractContextManager[None]] | None
                 ) -> Callable[[Manifest, bytes], AbstractContextManager[None]] | None:
        """A cache's offer of a version in flight, and its cluster told of it at once (in a
        thread of its own: the pull doesn't wait on its peers)."""
        if offer is None:
            return None

        @contextmanager
        def offering(m: Manifest, raw: bytes) -> Iterator[None]:
            with offer(m, raw):
                threading.Thread(target=self._tell, args=(m.model, m.version), name="tell",
                                 daemon=True).start()
                yield
        return offering

    def _tell(self, model: str, version: str) -> None:
        urls = tuple(self.cluster())     # resolved here: a slow DNS never holds the pull
        if urls:
            told = tell.tell(urls, model, self.connections)
            log.info("told %d of %d peers of %s %s", told, len(urls), model, version)

    def announce(self, model: str, version: str) -> None:
        """On a cache node, name ``version`` in the store's ``{model}/latest`` (never an older
        one than named now: ``agent.announce``). A failure is logged, not raised."""
        if not self.cache_node:
            return
        try:
            announce.announce(self.store.root, model, version, self.identity.node_id)
        except OSError as e:
            log.error("announcing %s %s in %s failed: %s", model, version, self.store.root, e)

    def announce_held(self) -> None:
        """At start and on reload, not only after a pull: a ``latest`` lost with the store's
        files, or naming a version gone since, would send the cluster to the origin until the
        next pull. Each model's newest complete version is announced."""
        if not self.cache_node:
            return
        for model in self.policy.models:
            version = self.local_version(model)
            if version is not None:
                self.announce(model.name, version)

    def ready(self, model: Model, version: str) -> str | None:
        """Rule 6: the version made current and its hook run; the hook's outcome for status
        (None if the version was current already, as after a restart, or has no hook)."""
        if not pointers.set_current(self.store, model.name, version):
            return None
        log.info("%s %s is current", model.name, version)
        if not model.on_ready:
            return None
        path = self.store.version_dir(model.name, version)
        ok, what = run_hook(model.on_ready, {"WAGENT_MODEL": model.name,
                                             "WAGENT_VERSION": version,
                                             "WAGENT_PATH": str(path)},
                            model.on_ready_timeout)
        (log.info if ok else log.warning)("on_ready of %s %s: %s", model.name, version, what)
        return what

