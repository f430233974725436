"""What a node can serve its peers: the versions its store holds, and those it is pulling.

A version being pulled is offered from the moment its pull has the manifest (``offering``,
around the engine's transfer): its files' verified pieces are served as they land, and a
piece not verified yet is waited for (``agent.pull.demand``). So a node behind a cache learns
of a version from the cache as soon as the cache starts fetching it (``latest`` names the
version in flight), and streams it from the cache instead of going to the origin.

Only names that came from a manifest reach the store: a request names a model, a version and
a path; the path is looked up among the manifest's files, and the file's blob id (derived from
its pieces) names what is read. Nothing a client sends becomes a file name.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, ManifestError, check_name, published_ts
from agent.store import Store

# A complete version's manifest is read from the store once per this long at most.
MANIFEST_TTL = 5.0
POKE_EVERY = 1.0


@dataclass(frozen=True)
class Offer:
    manifest: Manifest
    raw: bytes
    files: dict[str, FileEntry]        # path -> entry
    in_flight: bool
    # each distinct file's blob id and entry, in the manifest's order (have-maps list them)
    blobs: tuple[tuple[str, FileEntry], ...] = ()

    @classmethod
    def of(cls, manifest: Manifest, raw: bytes, in_flight: bool) -> Offer:
        distinct: dict[str, FileEntry] = {}
        for f in manifest.files:
            distinct.setdefault(blob_id(f), f)
        return cls(manifest, raw, {f.path: f for f in manifest.files}, in_flight,
                   tuple(distinct.items()))


class Catalog:
    """One per daemon. ``store``: the daemon's store now; ``poke(model)``: look for a new
    version of ``model`` now and say True (a cache node's pull-through), or say False;
    ``told(model)``: the cluster's cache says it started a version of ``model``: look now, on
    any node, and say whether ``model`` is one this node pulls."""

    def __init__(self, store: Callable[[], Store], poke: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 told: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.poke = poke
        self.told = told
        self.clock = clock
        self._lock = threading.Lock()
        self._flight: dict[tuple[str, str], Offer] = {}
        self._complete: dict[tuple[str, str], tuple[float, Offer | None]] = {}
        self._poked: dict[tuple[str, str], tuple[float, bool]] = {}

    @contextlib.contextmanager
    def offering(self, manifest: Manifest, raw: bytes) -> Iterator[None]:
        """While a pull of ``manifest``'s version runs: it is served, piece by piece."""
        key = (manifest.model, manifest.version)
        offer = Offer.of(manifest, raw, True)
        with self._lock:
            self._flight[key] = offer
        try:
            yield
        finally:
            with self._lock:
                if self._flight.get(key) is offer:
                    del self._flight[key]
                self._complete.pop(key, None)      # look at the store afresh

    def find(self, model: str, version: str) -> Offer | None:
        try:
            check_name("model", model)
            check_name("version", version)
        except ManifestError:
            return None
        key = (model, version)
        now = self.clock()
        with self._lock:
            offer = self._flight.get(key)
            if offer is not None:
                return offer
            seen = self._complete.get(key)
            if seen is not None and now - seen[0] < MANIFEST_TTL:
                return seen[1]
        offer = self._installed(model, version)
        with self._lock:
            self._complete[key] = (now, offer)
            if len(self._complete) > 64:
                oldest = min(self._complete, key=lambda k: self._complete[k][0])
                del self._complete[oldest]
        return offer

    def _installed(self, model: str, version: str) -> Offer | None:
        store = self.store()
        try:
            m = store.installed(model, version)
            if m is None:
                return None
            raw = (store.version_dir(model, version) / "manifest.json").read_bytes()
        except (OSError, ManifestError):
            return None
        return Offer.of(m, raw, False)

    def look_now(self, model: str) -> bool:
        """Pull-through: have this node look for a new version of ``model`` now; at most once
        a second per model, whoever asks (a client can't make it poll the origin in a loop).
        False when this node doesn't pull through (not a cache node)."""
        return self._at_most_every_second("through", model, self.poke)

    def look_when_told(self, model: str) -> bool:
        """The cache of this node's cluster started a version of ``model`` (``GET
        /.wagent/look/{model}``, ``agent.pull.tell``): this node polls now, not at its next
        poll, up to ``poll_interval`` later. At most once a second per model, whoever asks:
        anyone who reaches the port can make a node poll its sources, no more often than
        that. False: not a model this node pulls."""
        try:
            check_name("model", model)
        except ManifestError:
            return False
        return self._at_most_every_second("told", model, self.told)

    def _at_most_every_second(self, kind: str, model: str,
                              act: Callable[[str], bool] | None) -> bool:
        if act is None:
            return False
        now = self.clock()
        key = (kind, model)
        with self._lock:
            last = self._poked.get(key)
            if last is not None and now - last[0] < POKE_EVERY:
                return last[1]
            if len(self._poked) > 1024:        # names anyone may send: bounded
                self._poked.clear()
        done = act(model)
        with self._lock:
            self._poked[key] = (now, done)
        return done

    def latest(self, model: str) -> str | None:
        """The version a cache announces: the one it is pulling, else its store's ``latest``
        (the newest it holds completely), else None."""
        with self._lock:
            flying = [o.manifest for (m, _), o in self._flight.items() if m == model]
        if flying:
            return max(flying, key=lambda m: published_ts(m.published)).version
        try:
            check_name("model", model)
            text = (self.store().models / model / "latest").read_text()
        except (OSError, ManifestError, UnicodeDecodeError):
            return None
        first = text.split("\n", 1)[0].strip()
        return first or None

    def blob_of(self, offer: Offer, path: str) -> tuple[FileEntry, str] | None:
        f = offer.files.get(path)
        return None if f is None else (f, blob_id(f))
