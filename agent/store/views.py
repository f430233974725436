"""Views: a complete version as a directory of hard links to its blobs, for a bind mount.

::

    {root}/views/{model}@{version}/{path}     hard links to blobs/ (0444, the blobs' inodes)

``wagent mount`` of a version the store holds whole binds its view onto the engine's directory
instead of the FUSE mount: the engine then reads the store's own files, at the disk's and the
page cache's speed, with no process in the way (a userspace FUSE server copies every byte twice:
measured 0.72x of reading the store directly). Hard links, not the version directory itself:
its relative symlinks into ``blobs/`` would not resolve from the mount point, nor in a container
given only that directory.

A view holds nothing of its own: the same inodes as the blobs (no space, no copy), made in a
``.tmp-`` directory and renamed into place, so it appears whole or not at all. The mounts
(``agent.mount.service``) make one when a complete version is mounted and drop it when its last
directory is unmounted; at start they drop those no mount shows any more. A view keeps its blobs'
bytes on disk while it exists (a link count), so the mounts keep its version from eviction, as
they keep any mounted version.

A blob that fails verification later (``wagent store verify``, ``Store.drop_blob``) takes its
links out of every view with it: a bound view never goes on serving bytes found bad. Its readers
find the file missing until the version is whole again; the next ``make_view`` (a mount of it,
the daemon's start) puts the links back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from agent.durable import fsync_dir
from agent.manifest import Manifest, check_name
from agent.store.layout import VIEWS, Store, StoreError, real_dir, remove_tree

__all__ = ["VIEWS", "drop_stale", "drop_view", "make_view", "view_name", "view_names"]


def view_name(model: str, version: str) -> str:
    return f"{check_name('model', model)}@{check_name('version', version)}"


def make_view(store: Store, model: str, version: str) -> Path:
    """The view of an installed version: made now, or the one there already with any link
    it lost put back (a blob that failed verification takes its links out of the views,
    ``Store.drop_blob``; once pulled again the version is whole)."""
    target = store.views / view_name(model, version)
    m = store.installed(model, version)
    if os.path.isdir(target) and not os.path.islink(target):
        if m is not None:
            _link_missing(store, m, target)
        return target
    if m is None:
        raise StoreError(f"{model} {version} is not complete in the store {store.root}")
    real_dir(store.views)
    tmp = real_dir(store.views / f".tmp-{uuid.uuid4().hex}")
    try:
        _link_missing(store, m, tmp)
        fsync_dir(tmp)
        os.rename(tmp, target)
    except OSError as e:
        remove_tree(tmp)
        # made meanwhile (another mount): that one (rename(2) onto a directory with entries)
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(target):
            raise
    except BaseException:
        remove_tree(tmp)
        raise
    fsync_dir(store.views)
    return target


def _link_missing(store: Store, m: Manifest, target: Path) -> None:
    """Every file of ``m`` under ``target`` as a hard link to its blob, those there kept."""
    linked = store.linked_blobs(m)
    for f in m.files:
        dst = target / f.path                   # manifest paths are relative, checked on parse
        parent = target
        for part in Path(f.path).parts[:-1]:
            parent = real_dir(parent / part)
        if not os.path.lexists(dst):
            with contextlib.suppress(FileExistsError):
                os.link(store.blob_path(linked[f.path]), dst, follow_symlinks=False)


def drop_view(store: Store, model: str, version: str) -> None:
    """Removes the view of a version (its links only: the blobs stay)."""
    remove_tree(store.views / view_name(model, version))


def drop_stale(store: Store, keep: set[str]) -> list[str]:
    """Removes every view not named in ``keep`` (no mount shows it: a crash between a mount's
    last unmount and its view's removal, or a ``.tmp-`` one half made); returns their names."""
    gone = [n for n in view_names(store) if n not in keep]
    for n in gone:
        remove_tree(store.views / n)
    return gone


def view_names(store: Store) -> list[str]:
    """The views there are, and what a crash left half made (``.tmp-``)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(os.listdir(store.views))
    return []
