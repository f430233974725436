"""A file being pulled: its preallocated partial file and the journal of its verified pieces.

``partial/{blob id}.part`` receives pieces with pwrite at their offsets;
``partial/{blob id}.journal`` gets one line per verified piece, appended only after the piece's
bytes are written (and, with ``durable``, after fdatasync), so after kill -9 or a power cut the
journal never claims bytes the part file lacks: a resumed pull re-fetches at most the pieces that
were in flight. The journal also keeps each source's ETag for the file, which later requests send
as If-Range::

    wagent-journal 2 <blob id> <size>
    etag http://origin:8080 "6750a1b2-4000000"
    piece 0 1048576 <sha256>

**Who owns a file.** A pull claims the partial files it works on before it opens them, and
``clean`` (which removes what nobody pulls) and a second pull of the same file see the claim. A
claim is a lock on one byte of ``partial/.claims``, at an offset hashed from the file's name: an
OFD lock (fcntl(2)), held by the open file and not by the process, so two pulls in one daemon
exclude each other as two processes do. A pull opens ``.claims`` once and claims every file of
its version on that one descriptor (``Claims``), however many files there are; ``clean`` takes
the same byte before it looks at a file, so cleaning never races a pull. The lock file goes when
nobody holds a claim: the last one out locks the whole file, then removes it; whoever locked a
byte of a file removed meanwhile takes it again on the new one.

**Descriptors.** A part file and its journal are open only while something works on them:
``Partial.opened`` opens both on first use and closes them when its last user (a stream, the
copier) leaves. So a pull holds one descriptor for its claims and two per file in progress, at
most one file per stream and one for the copier, whatever the number of files. (Holding both
files of every file from the start, as wagent did before, needed two descriptors per file: under
systemd's default soft limit of 1024, a version of more than about 500 files could not be
pulled.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from agent.durable import fsync_dir
from agent.ownership import open_lock_file

MAGIC = "wagent-journal 2"
MODE = 0o644
CLAIMS = ".claims"
_NAME = re.compile(r"^([0-9a-f]{64})\.(part|journal)$")
# struct flock (fcntl(2)): l_type, l_whence, l_start, l_len, l_pid, in the platform's layout
# (64-bit offsets: F_OFD_* always take struct flock64 on 32-bit platforms).
_FLOCK = "@hhqqi"
_WHOLE = (0, 0)             # (start, length): a length of 0 runs to the end of any file


class PartialBusy(Exception):
    """Another pull holds this partial file."""


def _offset(name: str) -> int:
    """The byte of the claims file that stands for partial file ``name``: 62 bits of a hash, so
    two names share one with a chance of 2^-62 (that would only make one wait for the other)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 2


def _lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set an OFD lock without waiting; False if another open file holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, start, length,
                                                       0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _blocker(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """(start, length) of a lock another open file holds over the range, None if there is none."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET,
                                                         start, length, 0))
    kind, _, s, n, _ = struct.unpack(_FLOCK, got)
    return None if kind == fcntl.F_UNLCK else (s, n)


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class Claims:
    """The partial files one owner (a pull, or ``clean`` for a moment) holds in a directory:
    one descriptor of ``.claims``, one locked byte per file. Thread-safe."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / CLAIMS
        self._fd = -1
        self._held: set[str] = set()
        self._mutex = threading.Lock()

    def take(self, name: str, busy: str) -> None:
        """Claim ``name``, or raise PartialBusy(busy) if another owner holds it."""
        with self._mutex:
            if name in self._held:
                return
            while True:
                if self._fd < 0:
                    self._fd = open_lock_file(self.path)
                byte = _offset(name)
                if _lock(self._fd, fcntl.F_WRLCK, byte, 1):
                    if _same_file(self.path, self._fd):
                        self._held.add(name)
                        return
                    # The file was removed by the last owner out, between our open and our
                    # lock: nobody holds anything on it, so none of ours is lost either.
                    if self._held:
                        raise RuntimeError(f"{self.path} was removed while claims were held")
                    self._reopen()
                    continue
                held_by = _blocker(self._fd, byte, 1)
                if held_by is None:
                    continue                # given back between the two calls: try again
                if held_by[1] == 0 and not self._held:
                    # The whole file is locked: its last owner out is removing it (never while
                    # we hold a claim on it). Take the byte on the file that comes next.
                    self._reopen()
                    time.sleep(0.001)
                    continue
                raise PartialBusy(busy)

    def give_back(self, name: str) -> None:
        with self._mutex:
            if name in self._held:
                self._held.discard(name)
                _lock(self._fd, fcntl.F_UNLCK, _offset(name), 1)

    def close(self) -> None:
        """Give every claim back; remove the claims file if nobody else holds one."""
        with self._mutex:
            self._held.clear()
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            # Ours go first, so of owners leaving together the last always sees none but its
            # own; the whole-file lock is had only if no other owner holds a claim, and while
            # it is held nobody can take one on this file.
            _lock(fd, fcntl.F_UNLCK, *_WHOLE)
            if _lock(fd, fcntl.F_WRLCK, *_WHOLE) and _same_file(self.path, fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        except OSError:
            pass                            # a lock file left behind is harmless
        finally:
            os.close(fd)

    def _reopen(self) -> None:
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Claims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Partial:
    """One file being pulled. Made with a pull's ``claims``, its files are opened only within
    ``opened()``; made alone, it claims itself and keeps its files open until ``close()``, like a
    file object."""

    def __init__(self, directory: Path, name: str, size: int, durable: bool = True,
                 claims: Claims | None = None) -> None:
        self.name = name
        self.size = size
        self.durable = durable
        self.directory = directory
        self.part_path = directory / f"{name}.part"
        self.journal_path = directory / f"{name}.journal"
        self.done: dict[int, tuple[int, str]] = {}      # offset -> (size, sha256)
        self.etags: dict[str, str] = {}
        self.created = False            # this Partial made the part file (it held nothing)
        self.finished = False
        self._lock = threading.Lock()
        # Streams write one file together (the plan's order); a buffered write holds the
        # inode's lock (i_rwsem: ext4, xfs, tmpfs), and a second writer the kernel makes spin
        # on it while the first copies: 14% of a pull's CPU on 2 streams (perf, 2026-12-07).
        # Waiting on this lock sleeps instead.
        self._writing = threading.Lock()
        self._users = 0                 # opened() callers inside, plus one if made alone
        self._alone_ref = False         # that one
        self._alone = claims is None
        self._claims = Claims(directory) if claims is None else claims
        self.fd = self._jfd = -1
        try:
            self._claims.take(name, f"another pull is already fetching {name} into "
                                    f"{directory}; try again when it ends")
            part_existed = self.part_path.exists()
            if self._alone:
                self._open_files()
                self._users, self._alone_ref = 1, True
            with self.opened():
                self._load_checked(part_existed)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def opened(self) -> Iterator[Partial]:
        """Keep the part file and journal open while inside (nested and shared by threads: they
        close when the last user leaves)."""
        with self._lock:
            if self.finished:
                raise RuntimeError(f"partial file {self.name} used after it was finished")
            if self._users == 0:
                self._open_files()
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._close_files()

    def _open_files(self) -> None:
        if self.fd >= 0:
            return
        try:
            self._jfd = os.open(self.journal_path, os.O_RDWR | os.O_CREAT | os.O_APPEND
                                | os.O_NOFOLLOW | os.O_CLOEXEC, MODE)
            os.fchmod(self._jfd, MODE)
            self.fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                              | os.O_CLOEXEC, MODE)
        except BaseException:
            self._close_files()
            raise

    def _load_checked(self, part_existed: bool) -> None:
        """Read the journal and keep only what the part file still holds (files open)."""
        self.created = not part_existed
        if self.created:
            fsync_dir(self.directory)
        self._load()
        if self.created:
            self.done.clear()           # a journal without its part file claims nothing
        end = os.fstat(self.fd).st_size
        if end > self.size:
            # Longer than the file (written under another claim, or by hand): what lies past the
            # end must never become part of the blob.
            os.ftruncate(self.fd, self.size)
            end = self.size
        # A part file cut short (by hand, or a file system that lost its tail) no longer holds
        # the pieces past its end, whatever the journal says.
        self.done = {o: v for o, v in self.done.items() if o + v[0] <= end}
        if not self.done:
            # Nothing trustworthy in it: start it over (keeping the ETags, still useful).
            os.ftruncate(self._jfd, 0)
            lines = [f"{MAGIC} {self.name} {self.size}"] + [
                f"etag {quote(s, safe='')} {quote(e, safe='')}" for s, e in self.etags.items()]
            os.write(self._jfd, ("\n".join(lines) + "\n").encode())

    def _load(self) -> None:
        try:
            with open(self._jfd, closefd=False, errors="replace") as f:
                f.seek(0)
                lines = f.read().splitlines()
        except OSError:
            return
        if not lines or lines[0] != f"{MAGIC} {self.name} {self.size}":
            return          # unknown or torn header: start the file over
        for line in lines[1:]:
            parts = line.split(" ")
            # A torn last line (power cut mid-write) is simply not a record.
            if parts[0] == "piece" and len(parts) == 4 and parts[1].isdigit() \
                    and parts[2].isdigit() and len(parts[3]) == 64 \
                    and len(parts[1]) < 20 and len(parts[2]) < 20:
                self.done[int(parts[1])] = (int(parts[2]), parts[3])
            elif parts[0] == "etag" and len(parts) == 3:
                self.etags[unquote(parts[1])] = unquote(parts[2])

    def _need_open(self) -> None:
        if self.fd < 0:
            raise RuntimeError(f"partial file {self.name} used outside opened()")

    def unallocated(self) -> int:
        """Bytes the file system still has to give this file."""
        return max(0, self.size - os.lstat(self.part_path).st_blocks * 512)

    def preallocate(self) -> None:
        """Reserve the whole file now, so a full disk shows at once and not mid-pull.

        A reservation that fails gives back what it took (ext4 keeps the blocks a failed
        fallocate allocated): the file is cut back to its old size, which frees every block
        past it.
        """
        with self.opened():
            st = os.fstat(self.fd)
            if st.st_blocks * 512 >= self.size:
                return
            try:
                os.posix_fallocate(self.fd, 0, max(self.size, 1))
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, st.st_size + 1)   # a real change of size: ext4 then
                    os.ftruncate(self.fd, st.st_size)       # frees the blocks past the end
                raise

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """pwrite at ``offset`` (within ``opened()``)."""
        self._need_open()
        view = memoryview(data)
        with self._writing:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view = view[n:]
                offset += n

    def sync(self) -> None:
        """Make the written bytes durable before a journal line claims them (if ``durable``)."""
        self._need_open()
        if self.durable:
            os.fdatasync(self.fd)

    def record_piece(self, offset: int, size: int, sha256: str) -> None:
        """Append a verified piece (call ``sync`` first; within ``opened()``)."""
        with self._lock:
            self._need_open()
            os.write(self._jfd, f"piece {offset} {size} {sha256}\n".encode())
            self.done[offset] = (size, sha256)

    def record_etag(self, source: str, etag: str) -> str:
        """Keep the first ETag seen from ``source`` (pass a URL without credentials: the journal
        is a plain file); returns the one in effect, which differs if the file changed."""
        with self._lock:
            known = self.etags.get(source)
            if known is not None:
                return known
            self._need_open()
            os.write(self._jfd, f"etag {quote(source, safe='')} {quote(etag, safe='')}\n"
                     .encode())
            self.etags[source] = etag
            return etag

    def keep_only(self, offsets: set[int]) -> None:
        """Forget journaled pieces the current manifest doesn't have (another piece layout)."""
        with self._lock:
            self.done = {o: v for o, v in self.done.items() if o in offsets}

    def finish(self) -> Path:
        """Cut the part file to its size and fsync it; returns it, ready to be moved into
        blobs/. No byte may be written to it after this. The journal (and the claim) stays
        until ``drop_journal``, once the file is a blob."""
        with self.opened():
            os.ftruncate(self.fd, self.size)    # exactly the file: no byte past its end
            os.fsync(self.fd)
            with self._lock:
                self.finished = True
        return self.part_path

    def drop_journal(self) -> None:
        """The file is a blob: its journal goes, then its claim."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_path)
        self.close()

    def discard(self) -> None:
        """Remove the part file and journal (a pull that made them and failed before using
        them: they hold nothing worth adopting), then give the claim back."""
        for path in (self.part_path, self.journal_path):    # the journal last, as ``clean``
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.close()

    def _close_files(self) -> None:
        for attr in ("fd", "_jfd"):
            fd = getattr(self, attr)
            setattr(self, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close(self) -> None:
        """Give the claim back; the files close now, or when the last ``opened()`` user leaves
        (again is harmless: an fd number is never closed twice)."""
        with self._lock:
            if self._alone_ref:
                self._alone_ref = False
                self._users -= 1
            if self._users == 0:
                self._close_files()
        if self._alone:
            self._claims.close()
        else:
            self._claims.give_back(self.name)


def clean(directory: Path, now: float, stale: Callable[[str, float], bool],
          dry_run: bool = False) -> list[tuple[str, int]]:
    """Remove the partial files nobody is pulling for which ``stale(name, idle seconds)``
    holds; returns (name, bytes freed) for each. A file a pull claims is never touched."""
    by_name: dict[str, list[str]] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
        for e in it:
            m = _NAME.match(e.name)
            if m:
                by_name.setdefault(m.group(1), []).append(e.name)
    if not by_name:
        return []               # nothing to look at: no claims file made and removed for it
    removed = []
    with Claims(directory) as claims:
        for name, files in sorted(by_name.items()):
            try:
                claims.take(name, "")
            except PartialBusy:
                continue                    # a pull owns it
            try:
                if _flocked(directory / f"{name}.journal"):
                    continue                # an older wagent's pull, or not ours to judge
                stats = []
                for fn in files:
                    with contextlib.suppress(FileNotFoundError):
                        stats.append(os.lstat(directory / fn))
                idle = now - max((st.st_mtime for st in stats), default=now)
                if not stale(name, idle):
                    continue
                removed.append((name, sum(st.st_blocks * 512 for st in stats)))
                if dry_run:
                    continue
                for fn in (f"{name}.part", f"{name}.journal"):    # the journal last
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(directory / fn)
            finally:
                claims.give_back(name)
    return removed


def _flocked(journal: Path) -> bool:
    """Whether another process holds the journal's flock (the owner's mark of a wagent before
    the claims file, whose pull may still run across an upgrade), or the journal can't be
    opened to tell (a symlink, no permission: left alone)."""
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
