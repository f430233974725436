"""Giving space back: what crashes leave, stale partial files, and eviction by the policy's rules.

``clean`` runs at the start of every pull and of the daemon, and when the disk is full; ``evict``
after each pull the daemon completes; ``gc`` by hand (``wagent store gc``). Partial files are
taken one by one under their own lock, so cleaning them is safe while other pulls run; the
``.tmp-``/``.trash-`` directories and versions go only while no pull holds the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from agent.blob_id import blob_id
from agent.manifest import ManifestError, published_ts
from agent.store import evict as evict_choice
from agent.store import partial, pointers
from agent.store.layout import BAD_BLOB, Removed, Store, distinct_size, remove_tree

log = logging.getLogger(__name__)
PARTIAL_AFTER = 7 * 86400.0     # a partial file no pull advanced for a week is dropped
GC_PARTIAL_AFTER = 3600.0       # by hand: a partial file idle for an hour is stale
LEFTOVER_AFTER = 600.0          # a temporary link or file no lock covers, left this long


def clean(store: Store, now: float, partial_after: float | None = PARTIAL_AFTER,
          wanted: Callable[[str], bool] | None = None, dry_run: bool = False) -> list[Removed]:
    """Remove what crashes leave, and partial files nobody is pulling that are stale: idle
    for ``partial_after`` seconds, or (``wanted`` given, the disk being full) not wanted."""
    if not store.root.is_dir():
        return []
    with store.exclusive() as alone:
        return _clean(store, alone, now, partial_after, wanted, dry_run)


def _clean(store: Store, alone: bool, now: float, partial_after: float | None,
           wanted: Callable[[str], bool] | None, dry_run: bool) -> list[Removed]:
    removed = _clean_dirs(store, now, dry_run) if alone else []
    blobs = store.blob_sizes()

    def stale(name: str, idle: float) -> bool:
        return name in blobs or (partial_after is not None and idle >= partial_after) \
            or (wanted is not None and not wanted(name))

    return removed + [Removed("partial", name, size)
                      for name, size in partial.clean(store.partial, now, stale, dry_run)]


def _clean_dirs(store: Store, now: float, dry_run: bool) -> list[Removed]:
    """The ``.tmp-``/``.trash-`` directories of versions and the temporary files of the store.

    The directories are made and removed under the store lock (a pull's publish, an eviction),
    so one seen by the exclusive holder is a crash's. A temporary link or file in a model
    directory (``.current-*`` of ``set_current``, ``.tmp-latest-*`` of a cache's announcement)
    may be another process's, between its creation and its rename, when that process holds no
    lock (an older wagent, an announcement): it goes once it is ``LEFTOVER_AFTER`` old."""
    found: list[Path] = []

    def stale(e: os.DirEntry[str]) -> bool:
        with contextlib.suppress(OSError):
            if e.is_dir(follow_symlinks=False):
                return True
            # ctime: set when the link or file was made, and by the rename that set a blob
            # aside (which keeps the blob's old mtime)
            return now - e.stat(follow_symlinks=False).st_ctime >= LEFTOVER_AFTER
        return False

    for model in store.model_names():
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, ManifestError), \
                os.scandir(store.model_dir(model)) as it:
            found += [Path(e.path) for e in it
                      if e.name.startswith((".tmp-", ".trash-", ".current-")) and stale(e)]
    with contextlib.suppress(FileNotFoundError), os.scandir(store.blobs) as it:
        found += [Path(e.path) for e in it if e.name.startswith(BAD_BLOB) and stale(e)]
    with contextlib.suppress(FileNotFoundError), os.scandir(store.root) as it:
        # durable.write_atomic's temporary names (".usage.tmp-" from wagent before 2026-12)
        found += [Path(e.path) for e in it if e.name.startswith(
            (".usage.json.tmp-", ".pins.json.tmp-", ".usage.tmp-", ".pins.tmp-"))]
    removed = []
    for path in found:
        removed.append(Removed("leftover", str(path.relative_to(store.root)), _size(path)))
        if not dry_run:
            remove_tree(path)
    return removed


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            return os.lstat(path).st_blocks * 512
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def evict(store: Store, keep: int | Mapping[str, int], pins: Mapping[str, Collection[str]],
          max_size: int | None, now: float, evict_after: float | None = None,
          partial_after: float | None = PARTIAL_AFTER) -> list[Removed]:
    """Remove what the rules of agent.store.evict choose; returns what went (nothing if a pull
    holds the store). The pins by hand and every model's current version are kept beside the
    policy's ``pins``. Crash leftovers and partial files idle for ``partial_after`` go too (a
    version no longer wanted would otherwise hold its preallocated space for ever)."""
    if not store.root.is_dir():
        return []
    with store.exclusive() as alone:
        if not alone:
            log.info("store %s busy (a pull is running): eviction deferred", store.root)
            return []
        removed = _clean(store, True, now, partial_after, None, False)
        kept = pointers.kept(store)
        for model, versions in pins.items():
            kept.setdefault(model, set()).update(versions)
        return removed + _evict(store, keep, kept, max_size, now, evict_after, False)


def gc(store: Store, now: float, dry_run: bool = False) -> list[Removed]:
    """``wagent store gc``: blobs no version references, crash leftovers, and partial files no
    pull holds that were idle for an hour. Versions stay: evicting is the policy's business."""
    if not store.root.is_dir():
        return []
    with store.exclusive() as alone:
        if not alone:
            raise BusyError(f"a pull holds the store {store.root}; try again when it ends "
                            "(or pause the daemon: wagent pause)")
        removed = _clean(store, True, now, GC_PARTIAL_AFTER, None, dry_run)
        return removed + _evict(store, 10**9, {}, None, now, None, dry_run)


class BusyError(Exception):
    """The store is held by a pull."""


def _evict(store: Store, keep: int | Mapping[str, int], pins: Mapping[str, Collection[str]],
           max_size: int | None, now: float, evict_after: float | None, dry_run: bool
           ) -> list[Removed]:
    usage = store.read_usage()
    uses = []
    sizes_by_version = {}
    # Every version with a readable manifest, complete or not: the blobs of a kept version that
    # lost one of them stay, so pulling it again fetches only what is missing; the blobs it uses
    # are those its links name (or would name, for a lost one).
    for m in store.every_manifest():
        pub = published_ts(m.published)
        key = f"{m.model}/{m.version}"
        linked = store.linked_blobs(m)
        names = frozenset(linked.get(f.path) or blob_id(f) for f in m.files)
        uses.append(evict_choice.VersionUse(m.model, m.version, pub, usage.get(key, pub), names))
        sizes_by_version[key] = distinct_size(m)
    blob_sizes = store.blob_sizes()
    choice = evict_choice.choose(uses, blob_sizes, keep=keep, pins=pins, max_size=max_size,
                                 now=now, evict_after=evict_after)
    removed = [Removed("version", f"{model}/{version}", sizes_by_version[f"{model}/{version}"])
               for model, version in choice.versions]
    removed += [Removed("blob", name, blob_sizes[name]) for name in choice.blobs]
    if dry_run:
        return removed
    for model, version in choice.versions:
        d = store.version_dir(model, version)
        trash = d.with_name(f".trash-{version}-{uuid.uuid4().hex[:8]}")
        os.rename(d, trash)            # the version disappears at once, then is cleaned up
        remove_tree(trash)
        usage.pop(f"{model}/{version}", None)
    for name in choice.blobs:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store.blob_path(name))
    if choice.versions:
        store.write_usage(usage)
    return removed
