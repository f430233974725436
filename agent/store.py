"""The node's content-addressed store of model versions.

::

    {root}/blobs/{sha256}                     complete, verified files (read-only)
    {root}/models/{model}/{version}/{path}    relative symlinks into blobs/, and manifest.json
    {root}/partial/{sha256}.part|.journal     files being pulled, and their piece journals
    {root}/usage.json                         last use of each version (for LRU eviction)

A version directory is built aside (``models/{model}/.tmp-...``) and renamed into place, so it
appears whole or not at all; it holds the origin's manifest.json, which makes ``models/`` a valid
origin for other nodes (nginx follows the symlinks). The store never writes through a symlink:
every directory it writes into is checked with lstat first, and manifest paths are checked before.

What a crash can leave (a ``.tmp-`` or ``.trash-`` directory, a partial file nobody resumes, a
journal whose file already landed) is cleaned up by ``evict``, which runs only while no pull holds
the store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent import evict as evict_choice
from agent.manifest import MANIFEST_NAME, Manifest, ManifestError, check_name, parse, published_ts

log = logging.getLogger(__name__)
PARTIAL_AFTER = 7 * 86400.0     # a partial file no pull advanced for a week is dropped


class StoreError(Exception):
    """The store can't be used as asked; the message names the path and the fix."""


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: str
    published: float
    last_used: float
    size: int                  # bytes of the distinct blobs it uses
    path: Path


@dataclass(frozen=True)
class Removed:
    kind: str                  # "version", "blob" or "partial"
    name: str                  # "model/version", or the blob's (partial file's) sha256
    size: int


class Store:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.models = self.root / "models"
        self.partial = self.root / "partial"
        self._usage_file = self.root / "usage.json"

    # -- layout ---------------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the store's directories, refusing any that is a symlink or not a directory."""
        os.makedirs(self.root, exist_ok=True)   # the root may be a symlink the admin made
        for d in (self.blobs, self.models, self.partial):
            real_dir(d)

    def check_writable(self, model: str, version: str) -> None:
        """Refuse, before anything is written, a store whose model or version path is a symlink."""
        self.ensure()
        real_dir(self.model_dir(model))
        final = self.version_dir(model, version)
        if os.path.islink(final):
            raise StoreError(f"{final} is a symlink; wagent never writes through a symlink in "
                             "its store: remove it and pull again")

    def model_dir(self, model: str) -> Path:
        return self.models / check_name("model", model)

    def version_dir(self, model: str, version: str) -> Path:
        return self.model_dir(model) / check_name("version", version)

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / sha256

    def has_blob(self, sha256: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.blob_path(sha256)).st_mode)
        except FileNotFoundError:
            return False

    def blob_shas(self) -> set[str]:
        """Names of the regular files in blobs/ (a symlink there is no blob: has_blob agrees)."""
        try:
            with os.scandir(self.blobs) as it:
                return {e.name for e in it if len(e.name) == 64
                        and e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return set()

    # -- installed versions ---------------------------------------------------------------------
    def installed(self, model: str, version: str) -> Manifest | None:
        """The manifest of an installed version: a real directory whose every file links to
        its blob, and every blob present; else None (a pull then publishes it anew)."""
        d = self.version_dir(model, version)
        m = self._version_manifest(model, version)
        if m is None or os.path.islink(d):
            return None
        for f in m.files:
            try:
                link = os.readlink(d / f.path)
            except OSError:
                return None
            if link != os.path.relpath(self.blob_path(f.sha256), (d / f.path).parent) \
                    or not self.has_blob(f.sha256):
                return None
        return m

    def _version_manifest(self, model: str, version: str) -> Manifest | None:
        """The manifest.json of a version directory, complete or not."""
        path = self.version_dir(model, version) / MANIFEST_NAME
        try:
            m = parse(path.read_bytes(), str(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ManifestError as e:
            log.warning("ignoring installed version: %s", e)
            return None
        if (m.model, m.version) != (model, version):
            log.warning("ignoring %s: it names %s/%s", path, m.model, m.version)
            return None
        return m

    def model_names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.models) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def manifests(self) -> list[Manifest]:
        out = []
        for model in self.model_names():
            for version in self._version_names(model):
                m = self.installed(model, version)
                if m is not None:
                    out.append(m)
        return out

    def versions(self, model: str) -> list[VersionInfo]:
        """Installed versions of ``model``, newest published first."""
        usage = self._read_usage()
        out = []
        for version in self._version_names(model):
            m = self.installed(model, version)
            if m is None:
                continue
            sizes = {f.sha256: f.size for f in m.files}
            pub = published_ts(m.published)
            out.append(VersionInfo(model, version, pub, usage.get(f"{model}/{version}", pub),
                                   sum(sizes.values()), self.version_dir(model, version)))
        out.sort(key=lambda v: (v.published, v.version), reverse=True)
        return out

    def _version_names(self, model: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.model_dir(model)) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError, ManifestError):
            return []

    def piece_index(self) -> dict[str, tuple[str, int]]:
        """piece sha256 -> (blob sha256, offset) for every piece of every installed version."""
        index: dict[str, tuple[str, int]] = {}
        for m in self.manifests():
            for f in m.files:
                for p in f.pieces:
                    index.setdefault(p.sha256, (f.sha256, p.offset))
        return index

    # -- writing --------------------------------------------------------------------------------
    def add_blob(self, src: Path, sha256: str) -> Path:
        """Move a verified file into blobs/ (same file system: a rename), then make it read-only.

        Read-only only after the rename: a part file left 0444 by a crash could not be reopened
        for writing by a pull that doesn't run as root.
        """
        real_dir(self.blobs)
        dest = self.blob_path(sha256)
        os.replace(src, dest)
        os.chmod(dest, 0o444)
        return dest

    def publish(self, m: Manifest, manifest_bytes: bytes, now: float) -> Path:
        """Build the version's tree aside and rename it into place; every blob must be present."""
        missing = [f.path for f in m.files if not self.has_blob(f.sha256)]
        if missing:
            raise StoreError(f"cannot publish {m.model}/{m.version}: blobs missing for {missing}")
        model_dir = real_dir(self.model_dir(m.model))
        final = self.version_dir(m.model, m.version)
        if self.installed(m.model, m.version) is not None:
            self.touch(m.model, m.version, now)
            return final
        tmp = model_dir / f".tmp-{m.version}-{uuid.uuid4().hex[:8]}"
        os.mkdir(tmp)
        try:
            for f in m.files:
                dest = tmp / f.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.relpath(self.blob_path(f.sha256), dest.parent), dest)
            with open(tmp / MANIFEST_NAME, "wb") as out:
                out.write(manifest_bytes)
                os.fsync(out.fileno())      # never a version directory with an empty manifest
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                if self.installed(m.model, m.version) is not None:
                    shutil.rmtree(tmp)      # another pull published it first
                else:
                    # Something broken stands there (a symlink, a file, a version a crash or a
                    # hand left incomplete): set it aside, then put the good one in its place.
                    trash = model_dir / f".trash-{m.version}-{uuid.uuid4().hex[:8]}"
                    os.rename(final, trash)
                    os.rename(tmp, final)
                    _remove(trash)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.touch(m.model, m.version, now)
        return final

    def touch(self, model: str, version: str, now: float) -> None:
        """Record that a version was used now (eviction drops least recently used first)."""
        try:
            with self._usage_lock():
                usage = self._read_usage()
                usage[f"{model}/{version}"] = now
                self._write_usage(usage)
        except OSError as e:
            # A full disk must not turn a published version into a failed pull: only the LRU
            # order suffers.
            log.warning("store %s: could not record the use of %s/%s: %s", self.root, model,
                        version, e.strerror or e)

    @contextlib.contextmanager
    def _usage_lock(self) -> Iterator[None]:
        """Two pulls may touch at once (both hold the store lock shared): no lost update."""
        fd = os.open(self.root / ".usage.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_usage(self) -> dict[str, float]:
        try:
            data = json.loads(self._usage_file.read_text())
            return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return {}

    def _write_usage(self, usage: Mapping[str, float]) -> None:
        tmp = self._usage_file.with_name(f".usage.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(dict(sorted(usage.items())), indent=1))
        os.replace(tmp, self._usage_file)

    # -- space ----------------------------------------------------------------------------------
    def usage(self) -> int:
        """Bytes held by blobs and partial files."""
        total = 0
        for d in (self.blobs, self.partial):
            with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
                for e in it:
                    with contextlib.suppress(FileNotFoundError):
                        total += e.stat(follow_symlinks=False).st_blocks * 512
        return total

    @contextlib.contextmanager
    def pull_lock(self) -> Iterator[None]:
        """Held (shared) by a pull, so eviction never removes a blob a pull is about to use."""
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def evict(self, keep: int | Mapping[str, int], pins: Mapping[str, Collection[str]],
              max_size: int | None, now: float, evict_after: float | None = None,
              partial_after: float | None = PARTIAL_AFTER) -> list[Removed]:
        """Remove what the rules of agent.evict choose; returns what went (nothing if busy).

        Also cleans what crashes leave: ``.tmp-``/``.trash-`` directories, journals of files
        that landed, and partial files no pull has advanced for ``partial_after`` seconds (a
        version no longer wanted would otherwise hold its preallocated space for ever).
        """
        if not self.root.is_dir():
            return []
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("store %s busy (a pull is running): eviction deferred", self.root)
                return []
            removed = self._clean_leftovers(now, partial_after)
            return removed + self._evict_locked(keep, pins, max_size, now, evict_after)
        finally:
            os.close(fd)

    def _clean_leftovers(self, now: float, partial_after: float | None) -> list[Removed]:
        for model in self.model_names():
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, ManifestError), \
                    os.scandir(self.model_dir(model)) as it:
                for e in it:
                    if e.name.startswith((".tmp-", ".trash-")):
                        _remove(Path(e.path))
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for e in it:
                if e.name.startswith(".usage.tmp-"):
                    _remove(Path(e.path))
        blobs = self.blob_shas()
        by_sha: dict[str, list[os.DirEntry[str]]] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.partial) as it:
            for e in it:
                by_sha.setdefault(e.name.split(".", 1)[0], []).append(e)
        removed = []
        for sha, entries in sorted(by_sha.items()):
            stats = []
            for e in entries:
                with contextlib.suppress(FileNotFoundError):
                    stats.append(e.stat(follow_symlinks=False))
            idle = now - max((st.st_mtime for st in stats), default=now)
            if sha in blobs or (partial_after is not None and idle >= partial_after):
                for e in entries:
                    _remove(Path(e.path))
                removed.append(Removed("partial", sha, sum(st.st_blocks * 512 for st in stats)))
        return removed

    def _evict_locked(self, keep: int | Mapping[str, int], pins: Mapping[str, Collection[str]],
                      max_size: int | None, now: float, evict_after: float | None
                      ) -> list[Removed]:
        usage = self._read_usage()
        uses = []
        sizes_by_version = {}
        # Every version with a readable manifest, complete or not: the blobs of a kept version
        # that lost one of them stay, so pulling it again fetches only what is missing.
        every = [m for model in self.model_names() for v in self._version_names(model)
                 if (m := self._version_manifest(model, v)) is not None]
        for m in every:
            pub = published_ts(m.published)
            key = f"{m.model}/{m.version}"
            uses.append(evict_choice.VersionUse(m.model, m.version, pub, usage.get(key, pub),
                                                frozenset(f.sha256 for f in m.files)))
            sizes_by_version[key] = sum({f.sha256: f.size for f in m.files}.values())
        blob_sizes = {}
        for sha in self.blob_shas():
            with contextlib.suppress(FileNotFoundError):
                blob_sizes[sha] = os.lstat(self.blob_path(sha)).st_size
        choice = evict_choice.choose(uses, blob_sizes, keep=keep, pins=pins, max_size=max_size,
                                     now=now, evict_after=evict_after)
        removed = []
        for model, version in choice.versions:
            d = self.version_dir(model, version)
            trash = d.with_name(f".trash-{version}-{uuid.uuid4().hex[:8]}")
            os.rename(d, trash)            # the version disappears at once, then is cleaned up
            _remove(trash)
            usage.pop(f"{model}/{version}", None)
            removed.append(Removed("version", f"{model}/{version}",
                                   sizes_by_version[f"{model}/{version}"]))
        for sha in choice.blobs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.blob_path(sha))
                removed.append(Removed("blob", sha, blob_sizes[sha]))
        if choice.versions:
            self._write_usage(usage)
        return removed


def _remove(path: Path) -> None:
    """Remove a file, a symlink (never what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def real_dir(path: Path) -> Path:
    """``path`` as a real directory (created if missing); a symlink or a file there is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symlink; wagent never writes through a symlink in its "
                         "store: replace it with a directory or point the store elsewhere")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path} is not a directory; move it away or point the store elsewhere")
    return path
