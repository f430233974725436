"""A file being pulled: its preallocated partial file and the journal of its verified pieces.

``partial/{sha256}.part`` receives pieces with pwrite at their offsets; ``partial/{sha256}.journal``
gets one line per verified piece, appended only after the piece's bytes are written (and, with
``durable``, after fdatasync), so after kill -9 or a power cut the journal never claims bytes the
part file lacks: a resumed pull re-fetches at most the pieces that were in flight. The journal also
keeps each source's ETag for the file, which later requests send as If-Range::

    wagent-journal 1 <sha256> <size>
    etag http://origin:8080 "6750a1b2-4000000"
    piece 0 1048576 <sha256>
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from urllib.parse import quote, unquote

MAGIC = "wagent-journal 1"


class PartialBusy(Exception):
    """Another process holds this partial file."""


class Partial:
    def __init__(self, directory: Path, sha256: str, size: int, durable: bool = True) -> None:
        self.sha256 = sha256
        self.size = size
        self.durable = durable
        self.part_path = directory / f"{sha256}.part"
        self.journal_path = directory / f"{sha256}.journal"
        self.done: dict[int, tuple[int, str]] = {}      # offset -> (size, sha256)
        self.etags: dict[str, str] = {}
        self._lock = threading.Lock()
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = self._jfd = -1
        try:
            self._open(flags)
        except BaseException:
            self.close()
            raise

    def _open(self, flags: int) -> None:
        part_existed = self.part_path.exists()
        self.fd = os.open(self.part_path, flags, 0o644)
        self._jfd = os.open(self.journal_path, flags | os.O_APPEND, 0o644)
        try:
            # One pull per partial file: a second pull of the same file waits for another turn.
            fcntl.flock(self._jfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PartialBusy(f"another pull is already fetching {self.sha256} into "
                              f"{self.part_path.parent}; try again when it ends") from None
        self._load()
        if not part_existed:
            self.done.clear()           # a journal without its part file claims nothing
        # A part file cut short (by hand, or a file system that lost its tail) no longer holds
        # the pieces past its end, whatever the journal says.
        end = os.fstat(self.fd).st_size
        self.done = {o: v for o, v in self.done.items() if o + v[0] <= end}
        sha256, size = self.sha256, self.size
        if not self.done:
            # Nothing trustworthy in it: start it over (keeping the ETags, still useful).
            os.ftruncate(self._jfd, 0)
            lines = [f"{MAGIC} {sha256} {size}"] + [
                f"etag {quote(s, safe='')} {quote(e, safe='')}" for s, e in self.etags.items()]
            os.write(self._jfd, ("\n".join(lines) + "\n").encode())

    def _load(self) -> None:
        try:
            lines = self.journal_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return
        if not lines or lines[0] != f"{MAGIC} {self.sha256} {self.size}":
            return          # unknown or torn header: start the file over
        for line in lines[1:]:
            parts = line.split(" ")
            # A torn last line (power cut mid-write) is simply not a record.
            if parts[0] == "piece" and len(parts) == 4 and parts[1].isdigit() \
                    and parts[2].isdigit() and len(parts[3]) == 64:
                self.done[int(parts[1])] = (int(parts[2]), parts[3])
            elif parts[0] == "etag" and len(parts) == 3:
                self.etags[unquote(parts[1])] = unquote(parts[2])

    def preallocate(self) -> None:
        """Reserve the whole file now, so a full disk shows at once and not mid-pull."""
        if os.fstat(self.fd).st_blocks * 512 < self.size:
            os.posix_fallocate(self.fd, 0, max(self.size, 1))

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

    def discard(self) -> None:
        """Forget every piece (the file changed on the source): the part is started over."""
        with self._lock:
            os.ftruncate(self._jfd, 0)
            os.write(self._jfd, f"{MAGIC} {self.sha256} {self.size}\n".encode())
            self.done.clear()
            self.etags.clear()

    def finish(self) -> Path:
        """Sync and close the part file; returns it, ready to be moved into blobs/. The journal
        (and its lock) stays until ``drop_journal``, once the file is a blob."""
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
