"""Re-reading what is published: every file of a version hashed again, piece by piece and whole.

A blob's name proves what the pull verified; a disk can still rot, and a hand can still edit a
file. ``verify`` reads each blob once (a blob that versions share, once per run), feeding every
buffer to the current piece's hash and to the whole file's, so the publisher's sha256 is checked
too (the one place besides ``--verify-files`` where it is).

A blob whose bytes are not those its name stands for (a piece that doesn't match, a wrong size,
a read error) is never kept: ``remove=True`` (``wagent store verify``, ``wagent pull
--verify-files``) takes it out of blobs/, which makes every version linking it incomplete, so
that the next pull fetches it again and nothing serves it meanwhile. Only the blob goes: a file
whose pieces all match but whose whole sha256 is not the manifest's has the bytes the pieces
name; the manifest is wrong, and fetching again would bring the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest
from agent.store.layout import Store, StoreError

CHUNK = 4 * 2**20


@dataclass(frozen=True)
class Problem:
    model: str
    version: str
    path: str
    why: str
    blob: str | None = None        # the blob whose bytes are wrong (None: the link, the manifest)
    removed: bool = False          # that blob was taken out of blobs/: the next pull re-fetches


@dataclass(frozen=True)
class _Read:
    """What reading one blob found: why its bytes are not its name's (None: they are), the
    whole file's sha256, and which file was read (to remove that one, not a newer one)."""

    bad: str | None
    whole: str | None
    identity: tuple[int, int] | None


def versions(store: Store, model: str | None = None, version: str | None = None
             ) -> Iterator[Manifest]:
    """The published versions to check: all, one model's, or one."""
    for m in store.every_manifest():
        if (model is None or m.model == model) and (version is None or m.version == version):
            yield m


class Checker:
    """Verifies versions, reading each blob once per checker (versions share blobs)."""

    def __init__(self, store: Store, remove: bool = False) -> None:
        self.store = store
        self.remove = remove
        self._read: dict[tuple[str, str], _Read] = {}
        self._removed: dict[str, bool] = {}        # blob -> whether it went
        self._failed: dict[str, str] = {}          # blob -> why it could not go

    def verify(self, m: Manifest) -> list[Problem]:
        """Every bad file of one version, with the reason; [] when all of it reads back right."""
        linked = self.store.linked_blobs(m)
        problems = []
        for f in m.files:
            name = linked.get(f.path)
            if name is None:
                problems.append(Problem(m.model, m.version, f.path,
                                        "its link is missing or not into blobs/"))
                continue
            p = self.check(m, f, name)
            if p is not None:
                problems.append(p)
        return problems

    def check(self, m: Manifest, f: FileEntry, name: str) -> Problem | None:
        """One file of ``m`` held in the blob ``name``: None when it reads back right."""
        key = (name, blob_id(f))    # the same blob for the same pieces: read once
        got = self._read.get(key)
        if got is None:
            got = self._read[key] = _read_blob(self.store, name, f)
        if got.bad is not None:
            return self._bad(m, f, name, got)
        if got.whole != f.sha256:
            return Problem(m.model, m.version, f.path,
                           f"every piece matches but the whole file's sha256 is {got.whole}, "
                           f"the manifest says {f.sha256}: the manifest is wrong (rebuild it "
                           "with 'wagent manifest build'); the bytes are those its pieces name")
        return None

    def _bad(self, m: Manifest, f: FileEntry, name: str, got: _Read) -> Problem:
        why = got.bad or ""
        if got.identity is None:            # not opened (missing, or no regular file)
            return Problem(m.model, m.version, f.path, why)
        if self.remove and name not in self._removed:
            try:
                self._removed[name] = self.store.drop_blob(name, got.identity)
            except OSError as e:
                self._removed[name] = False
                self._failed[name] = f"; removing its blob failed: {e.strerror or e}"
        return Problem(m.model, m.version, f.path, why + self._failed.get(name, ""), blob=name,
                       removed=self._removed.get(name, False))


def verify(store: Store, m: Manifest, remove: bool = False) -> list[Problem]:
    """Every bad file of one version, with the reason; ``remove``: a bad blob leaves blobs/."""
    return Checker(store, remove).verify(m)


def drop_bad_blobs(store: Store, m: Manifest) -> list[Problem]:
    """Before a pull that distrusts the store (``--verify-files``): every blob of ``m`` that is
    in blobs/ already is read again, and one whose bytes are not its name's is removed, so that
    the pull fetches it rather than link it. Returns what was removed. Raises StoreError for a
    blob that is bad but can't be removed, or a manifest whose whole-file sha256 is wrong."""
    checker = Checker(store, remove=True)
    removed = []
    for f in {blob_id(f): f for f in m.files}.values():
        name = blob_id(f)
        if not store.has_blob(name):
            continue                        # fetched (and verified) by the pull
        p = checker.check(m, f, name)
        if p is None:
            continue
        if not p.removed:
            raise StoreError(f"{m.model}/{m.version}/{p.path}: {p.why}")
        removed.append(p)
    return removed


def _read_blob(store: Store, name: str, f: FileEntry) -> _Read:
    try:
        fd = os.open(store.blob_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Read(f"its blob {name[:12]} is missing (pull the version again)", None, None)
    except OSError as e:
        return _Read(f"its blob {name[:12]} can't be opened: {e.strerror}", None, None)
    try:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        if st.st_size != f.size:
            return _Read(f"{st.st_size} bytes, the manifest says {f.size}", None, identity)
        whole = hashlib.sha256()
        buf = memoryview(bytearray(CHUNK))
        for p in f.pieces:
            h = hashlib.sha256()
            left, offset = p.size, p.offset
            while left:
                n = os.preadv(fd, [buf[:min(left, CHUNK)]], offset)
                if not n:
                    return _Read(f"ends at {offset}, the manifest says {f.size} bytes", None,
                                 identity)
                h.update(buf[:n])
                whole.update(buf[:n])
                left, offset = left - n, offset + n
            if h.hexdigest() != p.sha256:
                return _Read(f"bytes {p.offset}+{p.size} do not match their sha256", None,
                             identity)
        return _Read(None, whole.hexdigest(), identity)
    except OSError as e:
        return _Read(f"reading its blob failed: {e.strerror}", None, identity)
    finally:
        os.close(fd)
