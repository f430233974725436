"""The node's content-addressed store of model versions.

::

    {root}/blobs/{blob id}                    complete, verified files (read-only)
    {root}/models/{model}/{version}/{path}    relative symlinks into blobs/, and manifest.json
    {root}/partial/{blob id}.part|.journal    files being pulled, and their piece journals
    {root}/views/{model}@{version}/{path}     hard links to blobs/ for bind mounts (views.py)
    {root}/usage.json                         last use of each version (for LRU eviction)

A blob is named by its blob id (``agent.blob_id``): a digest of the pieces this store verified,
never the sha256 a manifest claims, so no manifest can put its bytes under a name another
version uses. A version directory is built aside (``models/{model}/.tmp-...``) and renamed into
place, so it appears whole or not at all; it holds the origin's manifest.json, which makes
``models/`` a valid origin for other nodes (nginx follows the symlinks).

Safety rules: the store never writes through a symlink (every directory it writes into is checked
with lstat first, and manifest paths are checked before); paths inside a version are resolved one
component at a time with O_NOFOLLOW; every file and directory gets an explicit mode (0755
directories, 0444 blobs, 0644 files) whatever the caller's umask, so no other user can swap a
part of the tree. Before anything is written, the root and every directory above it must pass
``agent.ownership``'s rule (owned by root, this user or ``wagent``, writable by no one else),
and what the store keeps in it must be its owner's: whoever could rename ``blobs/`` could serve
zeros as a verified version. The locks (``.lock``, ``.usage.lock``, the journals in
``partial/``) are out of everyone else's reach (0600 files, ``partial/`` 0700): flock works on
a read-only descriptor, so a reader who could open a lock could hold it and stall every pull.
Durability: a blob's rename is made durable (fsync of blobs/) before any version
links to it, and a version directory is fsynced, with everything in it, before it is renamed into
place and its parent fsynced, so after a power cut a version is either absent or complete.

What a crash can leave (a ``.tmp-`` or ``.trash-`` directory, a partial file nobody resumes, a
journal whose file already landed) is cleaned up by ``agent.store.space``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.blob_id import blob_id
from agent.durable import fsync_dir, write_atomic
from agent.manifest import MANIFEST_NAME, Manifest, ManifestError, check_name, parse, published_ts
from agent.ownership import (
    dir_problem,
    inner_problem,
    make_missing,
    open_lock_file,
    trusted_uids,
    user_name,
)

log = logging.getLogger(__name__)
DIR_MODE = 0o755
FILE_MODE = 0o644
BLOB_MODE = 0o444
# Readers of the store (nginx on a cache node, inference servers in the wagent group) need only
# blobs/ and models/; what a reader can open it can flock, so the locks are the owner's alone.
PARTIAL_MODE = 0o700
LOCKS = (".lock", ".usage.lock")
_RISK = "swap the store's files, and a version would serve bytes no pull verified"
_ALSO = (", or point the store (--store, or store.path in the policy) at a directory only root "
         "or the service's user can write")
# Names in a model directory that are no version: the current pointer, a cache's announcement.
NOT_VERSIONS = frozenset({"current", "latest"})
_BLOB_NAME = re.compile(r"^[0-9a-f]{64}$")
VIEWS = "views"                 # the views' directory under the root (agent.store.views)
BAD_BLOB = ".bad-"              # prefix of a blob being removed after failing verification
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
    name: str                  # "model/version", or the blob id (of the blob or partial file)
    size: int


class Store:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.models = self.root / "models"
        self.partial = self.root / "partial"
        self.views = self.root / VIEWS       # hard links for bind mounts (agent.store.views)
        self._usage_file = self.root / "usage.json"

    # -- layout ---------------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the store's directories, refusing any that is a symlink or not a directory,
        and a store someone untrusted could change: its root or a directory above it (checked
        before anything is made), or what it keeps (blobs/, models/, partial/, each model's
        directory, the locks). What an older wagent left open to readers is closed: partial/
        becomes 0700 and the locks 0600."""
        trusted = trusted_uids()
        self._check_root(trusted, missing_ok=True)
        # the root may be a symlink the admin made; missing parents come out 0755 whatever
        # the umask (a world-writable parent would fail the check below)
        for d in make_missing(str(self.root), DIR_MODE):
            fsync_dir(Path(d).parent)
        self._check_root(trusted)
        for d, mode in ((self.blobs, DIR_MODE), (self.models, DIR_MODE),
                        (self.partial, PARTIAL_MODE)):
            real_dir(d, mode)
        owner = os.stat(self.root).st_uid
        inside = [self.blobs, self.models, self.partial]
        with os.scandir(self.models) as it:
            inside += [Path(e.path) for e in it]
        inside += [self.root / n for n in LOCKS if os.path.lexists(self.root / n)]
        for p in inside:
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue                # a model directory removed meanwhile
            problem = inner_problem(str(p), st, owner, risk=_RISK)
            if problem is not None:
                raise StoreError(f"the store {self.root} is not safe: {problem}")
        try:
            if stat.S_IMODE(os.lstat(self.partial).st_mode) != PARTIAL_MODE:
                os.chmod(self.partial, PARTIAL_MODE)
            for n in LOCKS:
                os.close(open_lock_file(self.root / n))
        except PermissionError as e:
            who = user_name(owner)
            raise StoreError(f"can't keep the store's locks from other users: {e.filename}: "
                             f"{e.strerror}; fix: chown -R {who} {self.root}, or run this as "
                             f"{who}") from None

    def _check_root(self, trusted: frozenset[int], missing_ok: bool = False) -> None:
        try:
            problem = dir_problem(str(self.root), trusted, risk=_RISK, also=_ALSO,
                                  missing_ok=missing_ok)
        except OSError as e:
            raise StoreError(f"can't check who may change the store {self.root}: {e}") from None
        if problem is not None:
            raise StoreError(f"the store {self.root} is not safe: {problem}")

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

    def blob_path(self, name: str) -> Path:
        return self.blobs / name

    def has_blob(self, name: str, size: int | None = None) -> bool:
        """A regular file in blobs/ (never a symlink), of ``size`` bytes when given."""
        try:
            st = os.lstat(self.blob_path(name))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def drop_blob(self, name: str, same_as: tuple[int, int] | None = None) -> bool:
        """Take a blob out of blobs/ (one whose bytes failed verification): the versions that
        link it are incomplete until a pull fetches it again, so a damaged file is never served
        nor kept. ``same_as``: the (st_dev, st_ino) of the file found bad; a blob that a pull put
        in its place since stays. Returns whether it went.

        Moved aside first (``.bad-`` names, which ``space.clean`` removes if a crash leaves one),
        then checked: a pull's rename can't slip between the check and the removal."""
        path = self.blob_path(name)
        aside = self.blobs / f"{BAD_BLOB}{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        try:
            st = os.lstat(aside)
        except FileNotFoundError:
            return True                     # cleaned up meanwhile: gone all the same
        if not stat.S_ISREG(st.st_mode) or (same_as is not None
                                            and (st.st_dev, st.st_ino) != same_as):
            os.rename(aside, path)          # not the file found bad: put it back
            return False
        self._unlink_views_of(st)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        fsync_dir(self.blobs)
        return True

    def _unlink_views_of(self, st: os.stat_result) -> None:
        """Takes the bad blob's hard links out of the views (``agent.store.views``): a mount
        bound from one must not go on serving its bytes. Its readers then find the file
        missing until the version is whole again and the view is made again."""
        for root, _, files in os.walk(self.views):
            for f in files:
                path = os.path.join(root, f)
                with contextlib.suppress(FileNotFoundError):
                    link = os.lstat(path)
                    if (link.st_dev, link.st_ino) == (st.st_dev, st.st_ino):
                        os.unlink(path)
                        log.warning("removed %s from its view: its blob failed verification",
                                    path)

    def blob_sizes(self) -> dict[str, int]:
        """Name -> size of the regular files in blobs/ (a symlink there is no blob)."""
        out = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.blobs) as it:
            for e in it:
                if _BLOB_NAME.match(e.name) and e.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    # -- installed versions ---------------------------------------------------------------------
    def installed(self, model: str, version: str) -> Manifest | None:
        """The manifest of an installed version: a real directory whose every file links to the
        blob of its pieces, of its size; else None (a pull then publishes it anew)."""
        m = self._version_manifest(model, version)
        if m is None or self.missing(m):
            return None
        return m

    def missing(self, m: Manifest) -> list[str]:
        """The paths of a version whose link is not to the blob of its pieces, or whose blob is
        gone (removed after failing verification, say): it is incomplete while there are any."""
        linked = self.linked_blobs(m)
        return [f.path for f in m.files
                if linked.get(f.path) != (bid := blob_id(f)) or not self.has_blob(bid, f.size)]

    def linked_blobs(self, m: Manifest) -> dict[str, str]:
        """path -> the blob its symlink names, for every file of a version whose link is one
        of ours (relative, into blobs/, no symlinked directory on the way)."""
        out = {}
        with contextlib.suppress(OSError), self._open_version(m.model, m.version) as vfd:
            for f in m.files:
                target = _readlink_at(vfd, f.path)
                if target is None:
                    continue
                depth = f.path.count("/") + 3       # up through the version, model and models/
                head, _, name = target.rpartition("/")
                if head == "/".join([".."] * depth + ["blobs"]) and _BLOB_NAME.match(name):
                    out[f.path] = name
        return out

    @contextlib.contextmanager
    def _open_version(self, model: str, version: str) -> Iterator[int]:
        """A descriptor of the version directory, reached without following a symlink past the
        store's root (a model or version swapped for a symlink is not that version)."""
        fd = os.open(self.models, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in (check_name("model", model), check_name("version", version)):
                nfd = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    def version_manifest(self, model: str, version: str) -> Manifest | None:
        """The manifest of a version directory, complete or not; None if there is none."""
        return self._version_manifest(model, version)

    def _version_manifest(self, model: str, version: str) -> Manifest | None:
        """The manifest.json of a version directory, complete or not."""
        path = self.version_dir(model, version) / MANIFEST_NAME
        try:
            with self._open_version(model, version) as vfd:
                fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=vfd)
                with os.fdopen(fd, "rb") as f:
                    raw = f.read()
            m = parse(raw, str(path))
        except OSError:
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

    def versions(self, model: str) -> list[VersionInfo]:
        """Installed versions of ``model``, newest published first."""
        usage = self.read_usage()
        out = []
        for version in self._version_names(model):
            m = self.installed(model, version)
            if m is None:
                continue
            pub = published_ts(m.published)
            out.append(VersionInfo(model, version, pub, usage.get(f"{model}/{version}", pub),
                                   distinct_size(m), self.version_dir(model, version)))
        out.sort(key=lambda v: (v.published, v.version), reverse=True)
        return out

    def _version_names(self, model: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.model_dir(model))
                          if not n.startswith(".") and n not in NOT_VERSIONS)
        except (FileNotFoundError, NotADirectoryError, ManifestError):
            return []

    def every_manifest(self) -> list[Manifest]:
        """Every version with a readable manifest, complete or not."""
        return [m for model in self.model_names() for v in self._version_names(model)
                if (m := self._version_manifest(model, v)) is not None]

    def piece_index(self) -> dict[str, tuple[str, int]]:
        """piece sha256 -> (blob name, offset) for every piece of every version's blobs.

        Built from the blobs the versions' links really name (a store written by an older
        wagent named blobs otherwise): whatever the name, a copied piece is hashed before use.
        """
        index: dict[str, tuple[str, int]] = {}
        sizes = self.blob_sizes()
        for m in self.every_manifest():
            linked = self.linked_blobs(m)
            for f in m.files:
                name = linked.get(f.path)
                if name is None or sizes.get(name) != f.size:
                    continue
                for p in f.pieces:
                    index.setdefault(p.sha256, (name, p.offset))
        return index

    # -- writing --------------------------------------------------------------------------------
    def add_blob(self, src: Path, name: str, size: int) -> Path:
        """Move a verified file into blobs/ (same file system: a rename) under its blob id.

        Read-only only after the rename: a part file left 0444 by a crash could not be reopened
        for writing by a pull that doesn't run as root. blobs/ is fsynced before returning: a
        version may link to the blob only once its name is durable.
        """
        real_dir(self.blobs)
        got = os.lstat(src).st_size
        if got != size:
            raise StoreError(f"{src} has {got} bytes, its file {size}: not published")
        dest = self.blob_path(name)
        os.replace(src, dest)
        os.chmod(dest, BLOB_MODE)
        fsync_dir(self.blobs)
        return dest

    def publish(self, m: Manifest, manifest_bytes: bytes, now: float) -> Path:
        """Build the version's tree aside and rename it into place; every blob must be present.

        Durable when it returns. The order: blobs/ was fsynced as each blob landed; here every
        directory of the new tree and its manifest are fsynced before the rename, and the model
        directory after it. A power cut before the last fsync leaves either no version (a
        ``.tmp-`` directory that ``clean`` removes) or the complete one, never a version
        directory missing a link or holding an empty manifest.
        """
        missing = [f.path for f in m.files if not self.has_blob(blob_id(f), f.size)]
        if missing:
            raise StoreError(f"cannot publish {m.model}/{m.version}: blobs missing for {missing}")
        new_model = not os.path.lexists(self.model_dir(m.model))
        model_dir = real_dir(self.model_dir(m.model))
        if new_model:
            fsync_dir(self.models)
        final = self.version_dir(m.model, m.version)
        if self.installed(m.model, m.version) is not None:
            self.touch(m.model, m.version, now)
            return final
        tmp = model_dir / f".tmp-{m.version}-{uuid.uuid4().hex[:8]}"
        os.mkdir(tmp, DIR_MODE)
        os.chmod(tmp, DIR_MODE)
        try:
            dirs = {tmp}
            for f in m.files:
                dest = tmp / f.path
                for parent in reversed(dest.relative_to(tmp).parents[:-1]):
                    d = tmp / parent
                    if d not in dirs:
                        os.mkdir(d, DIR_MODE)
                        os.chmod(d, DIR_MODE)
                        dirs.add(d)
                os.symlink(os.path.relpath(self.blob_path(blob_id(f)), dest.parent), dest)
            fd = os.open(tmp / MANIFEST_NAME,
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), FILE_MODE)
                out.write(manifest_bytes)
                out.flush()
                os.fsync(out.fileno())
            for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                fsync_dir(d)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                if self.installed(m.model, m.version) is not None:
                    shutil.rmtree(tmp)      # another pull published it first
                else:
                    # Something broken stands there (a symlink, a file, a version a crash or a
                    # hand left incomplete, one an older wagent linked to other blob names):
                    # set it aside, then put the good one in its place.
                    trash = model_dir / f".trash-{m.version}-{uuid.uuid4().hex[:8]}"
                    os.rename(final, trash)
                    os.rename(tmp, final)
                    remove_tree(trash)
            fsync_dir(model_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.touch(m.model, m.version, now)
        return final

    def touch(self, model: str, version: str, now: float) -> None:
        """Record that a version was used now (eviction drops least recently used first)."""
        try:
            with self.usage_lock():
                usage = self.read_usage()
                usage[f"{model}/{version}"] = now
                self.write_usage(usage)
        except OSError as e:
            # A full disk must not turn a published version into a failed pull: only the LRU
            # order suffers.
            log.warning("store %s: could not record the use of %s/%s: %s", self.root, model,
                        version, e.strerror or e)

    @contextlib.contextmanager
    def usage_lock(self) -> Iterator[None]:
        """Two pulls may touch at once (both hold the store lock shared): no lost update."""
        self.ensure()
        with _flocked(self.root / ".usage.lock", fcntl.LOCK_EX):
            yield

    def read_usage(self) -> dict[str, float]:
        try:
            data = json.loads(self._usage_file.read_text())
            return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (FileNotFoundError, ValueError, TypeError, AttributeError, RecursionError):
            return {}

    def write_usage(self, usage: Mapping[str, float]) -> None:
        # An LRU hint: atomic (a reader never sees half of it), not fsynced.
        write_atomic(self._usage_file, json.dumps(dict(sorted(usage.items())), indent=1).encode(),
                     mode=FILE_MODE, durable=False)

    # -- space ----------------------------------------------------------------------------------
    def usage(self) -> int:
        """Bytes held by blobs and partial files."""
        total = 0
        for d in (self.blobs, self.partial):
            # partial/ is the owner's alone: a reader's `store ls` counts the blobs only
            with contextlib.suppress(FileNotFoundError, PermissionError), os.scandir(d) as it:
                for e in it:
                    with contextlib.suppress(FileNotFoundError):
                        total += e.stat(follow_symlinks=False).st_blocks * 512
        return total

    def free_bytes(self) -> int:
        """Bytes the store's file system still gives an unprivileged writer."""
        st = os.statvfs(self.partial if self.partial.is_dir() else self.root)
        return st.f_bavail * st.f_frsize

    @contextlib.contextmanager
    def pull_lock(self) -> Iterator[None]:
        """Held (shared) by a pull, so eviction never removes a blob a pull is about to use."""
        self.ensure()
        with _flocked(self.root / ".lock", fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """The store lock, exclusive if no pull holds it: yields whether it was had."""
        self.ensure()
        fd = open_lock_file(self.root / ".lock")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


def distinct_size(m: Manifest) -> int:
    return sum({blob_id(f): f.size for f in m.files}.values())


@contextlib.contextmanager
def _flocked(path: Path, how: int) -> Iterator[None]:
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def _readlink_at(dir_fd: int, rel: str) -> str | None:
    """The target of the symlink ``rel`` under ``dir_fd``, reached without following any
    symlink on the way (a subdirectory swapped for a symlink is refused); None if not a link."""
    parts = rel.split("/")
    fd = dir_fd
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nfd
        return os.readlink(parts[-1], dir_fd=fd)
    except OSError:
        return None
    finally:
        if fd != dir_fd:
            os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a file, a symlink (never what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def real_dir(path: Path, mode: int = DIR_MODE) -> Path:
    """``path`` as a real directory (created with ``mode`` if missing); a symlink or a file
    there is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            os.mkdir(path, mode)
            os.chmod(path, mode)            # the mode asked, whatever the umask
            fsync_dir(path.parent)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symlink; wagent never writes through a symlink in its "
                         "store: replace it with a directory or point the store elsewhere")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path} is not a directory; move it away or point the store elsewhere")
    return path
