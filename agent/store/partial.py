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

The journal carries the lock (flock) that says a pull owns the file. It is opened and locked
before the part file, and a lock taken on a journal that was meanwhile removed is dropped and taken
again, so ``clean`` (which removes what nobody pulls, under the same lock) and a starting pull
never both believe they own a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote

from agent.durable import fsync_dir

MAGIC = "wagent-journal 2"
MODE = 0o644
_NAME = re.compile(r"^([0-9a-f]{64})\.(part|journal)$")


class PartialBusy(Exception):
    """Another process holds this partial file."""


class Partial:
    def __init__(self, directory: Path, name: str, size: int, durable: bool = True) -> None:
        self.name = name
        self.size = size
        self.durable = durable
        self.directory = directory
        self.part_path = directory / f"{name}.part"
        self.journal_path = directory / f"{name}.journal"
        self.done: dict[int, tuple[int, str]] = {}      # offset -> (size, sha256)
        self.etags: dict[str, str] = {}
        self._lock = threading.Lock()
        self.fd = self._jfd = -1
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self._jfd = _open_locked(self.journal_path, f"another pull is already fetching "
                                 f"{self.name} into {self.directory}; try again when it ends")
        part_existed = self.part_path.exists()
        self.fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                          MODE)
        os.fchmod(self.fd, MODE)
        if not part_existed:
            fsync_dir(self.directory)
        self._load()
        if not part_existed:
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

    def unallocated(self) -> int:
        """Bytes the file system still has to give this file."""
        return max(0, self.size - os.fstat(self.fd).st_blocks * 512)

    def preallocate(self) -> None:
        """Reserve the whole file now, so a full disk shows at once and not mid-pull.

        A reservation that fails gives back what it took (ext4 keeps the blocks a failed
        fallocate allocated): the file is cut back to its old size, which frees every block
        past it.
        """
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
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def sync(self) -> None:
        """Make the written bytes durable before a journal line claims them (if ``durable``)."""
        if self.durable:
            os.fdatasync(self.fd)

    def record_piece(self, offset: int, size: int, sha256: str) -> None:
        """Append a verified piece (call ``sync`` first)."""
        with self._lock:
            os.write(self._jfd, f"piece {offset} {size} {sha256}\n".encode())
            self.done[offset] = (size, sha256)

    def record_etag(self, source: str, etag: str) -> str:
        """Keep the first ETag seen from ``source`` (pass a URL without credentials: the journal
        is a plain file); returns the one in effect, which differs if the file changed."""
        with self._lock:
            known = self.etags.get(source)
            if known is not None:
                return known
            os.write(self._jfd, f"etag {quote(source, safe='')} {quote(etag, safe='')}\n"
                     .encode())
            self.etags[source] = etag
            return etag

    def keep_only(self, offsets: set[int]) -> None:
        """Forget journaled pieces the current manifest doesn't have (another piece layout)."""
        with self._lock:
            self.done = {o: v for o, v in self.done.items() if o in offsets}

    def finish(self) -> Path:
        """Sync and close the part file; returns it, ready to be moved into blobs/. The journal
        (and its lock) stays until ``drop_journal``, once the file is a blob."""
        os.ftruncate(self.fd, self.size)    # exactly the file: no byte past its end
        os.fsync(self.fd)
        self._close_part()
        return self.part_path

    def drop_journal(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_path)
        self.close()

    def _close_part(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close both files (again is harmless: an fd number is never closed twice)."""
        self._close_part()
        jfd, self._jfd = self._jfd, -1
        if jfd >= 0:
            with contextlib.suppress(OSError):
                os.close(jfd)


def _open_locked(path: Path, busy: str) -> int:
    """Open (creating) and flock ``path``; a lock that lands on a file removed meanwhile (by
    ``clean``) is dropped and taken again on the file now at ``path``."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                     MODE)
        try:
            os.fchmod(fd, MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PartialBusy(busy) from None
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def clean(directory: Path, now: float, stale: Callable[[str, float], bool],
          dry_run: bool = False) -> list[tuple[str, int]]:
    """Remove the partial files nobody is pulling for which ``stale(name, idle seconds)``
    holds; returns (name, bytes freed) for each. A file a pull holds is never touched."""
    by_name: dict[str, list[str]] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
        for e in it:
            m = _NAME.match(e.name)
            if m:
                by_name.setdefault(m.group(1), []).append(e.name)
    removed = []
    for name, files in sorted(by_name.items()):
        jpath = directory / f"{name}.journal"
        try:
            jfd = os.open(jpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC) \
                if f"{name}.journal" in files else -1
        except OSError:
            continue
        try:
            if jfd >= 0:
                try:
                    fcntl.flock(jfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue                # a pull owns it
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
            for fn in (f"{name}.part", f"{name}.journal"):    # the lock's file last
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / fn)
        finally:
            if jfd >= 0:
                os.close(jfd)
    return removed

