"""The read path of a lazy mount: verified bytes only, from the blob or from the partial file.

A read of ``[offset, offset + size)`` of a file is served piece by piece:

- the file is a blob in the store (complete, every piece verified, or a file this version
  shares with one already here): read there;
- else each piece the read touches must be verified in the file's partial file (journaled by
  the pull only after its sha256 matched, ``agent.store.partial``); a piece that isn't yet is
  asked for first (``agent.pull.demand``: the running pull moves it to the front of its queue)
  and the read waits for it, up to the policy's ``mounts.read_deadline``. Then, and only then,
  are its bytes read from the partial file.

So no byte reaches a reader that its piece's sha256 did not vouch for: a corrupt piece from a
source fails its check in the pull, is fetched again (from the next source), and the reader
simply waits longer. After the read, the next piece of the file is asked for too (engines read
shards front to back), without waiting for it.

These calls block (a wait for a piece, a cold pread): the FUSE server runs them in threads,
never on its event loop (``agent.mount.fuse_server``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from agent.manifest import Piece
from agent.mount.tree import Node, next_piece, pieces_for
from agent.pull.demand import Demand, NotYet
from agent.store import Store

OPEN_BLOBS = 64              # blobs kept open between reads (descriptors: the unit allows 8192)


class OpenFiles:
    """Descriptors kept open across reads, at most ``keep`` idle ones. Kept open because a
    file's read-ahead state lives in its open file: a blob opened for every read was read cold
    each time (measured: 0.6x of reading the store directly). A descriptor in use is never
    closed under its reader (a closed number could be reused for another file)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._open: dict[str, list[int]] = {}            # path -> [fd, users], oldest first

    @contextlib.contextmanager
    def use(self, path: Path) -> Iterator[int]:
        key = str(path)
        with self._lock:
            entry = self._open.pop(key, None)
            if entry is not None:
                self._open[key] = entry                    # most recently used last
                entry[1] += 1
        if entry is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as e:
                raise ReadFailed(f"{path}: {e.strerror}") from None
            # engines read shards front to back: the kernel may read further ahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            with self._lock:
                other = self._open.get(key)
                if other is not None:                      # opened meanwhile: use that one
                    os.close(fd)
                    entry = other
                    entry[1] += 1
                else:
                    entry = self._open[key] = [fd, 1]
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                idle = [k for k, e in self._open.items() if e[1] == 0]
                for k in idle[:max(0, len(idle) - self.keep)]:
                    os.close(self._open.pop(k)[0])

    def close(self) -> None:
        with self._lock:
            for k, e in list(self._open.items()):
                if e[1] == 0:
                    os.close(self._open.pop(k)[0])


class ReadFailed(Exception):
    """A read that can't be served: the message says why (status and the journal show it); the
    reader gets EIO."""


class Reader:
    """``store``: the daemon's store now (a reload may move it); ``deadline``: the policy's
    ``mounts.read_deadline`` now; ``why_not(entry)``: why the version's pieces don't come (its
    pull's state), for the error."""

    def __init__(self, store: Callable[[], Store], demand: Demand,
                 deadline: Callable[[], float], why_not: Callable[[str], str],
                 clock: Callable[[], float]) -> None:
        self.store = store
        self.demand = demand
        self.deadline = deadline
        self.why_not = why_not
        self.clock = clock
        self._lock = threading.Lock()
        self._complete: set[str] = set()                     # blobs seen whole (immutable)
        self._blob_fds = OpenFiles(OPEN_BLOBS)
        self.bytes_read = 0

    def read(self, node: Node, offset: int, size: int) -> bytes:
        f = node.file
        if f is None:
            raise ReadFailed(f"{node.name} is a directory")
        pieces = pieces_for(f, offset, size)
        if not pieces:
            return b""
        end = min(f.size, offset + size)
        if self._whole(node):
            data = self._pread_blob(node.blob, offset, end - offset)
        else:
            deadline = self.clock() + self.deadline()
            out = bytearray()
            pos = offset
            for p in pieces:
                upto = min(end, p.offset + p.size)
                out += self._piece_bytes(node, p, pos, upto - pos, deadline)
                pos = upto
            data = bytes(out)
            after = next_piece(f, pieces[-1])
            if after is not None:
                self.demand.hint(node.blob, after)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def close(self) -> None:
        self._blob_fds.close()

    def complete(self, node: Node) -> bool:
        """The node's file is known to be a whole blob (no waiting to read it)."""
        return node.blob in self._complete

    # -- where the bytes are ------------------------------------------------------------------
    def _whole(self, node: Node) -> bool:
        if node.blob in self._complete:
            return True
        if self.store().has_blob(node.blob, node.size):
            with self._lock:
                self._complete.add(node.blob)
            return True
        return False

    def _piece_bytes(self, node: Node, piece: Piece, offset: int, size: int,
                     deadline: float) -> bytes:
        try:
            where = self.demand.wait(node.blob, piece, deadline, lambda: self._whole(node),
                                     lambda: self.why_not(node.entry))
        except NotYet as e:
            raise ReadFailed(f"{node.entry}/{node.file.path if node.file else node.name}: "
                             f"bytes {piece.offset}+{piece.size} not verified within "
                             f"{self.deadline():g} s: {e}") from None
        if where == "part":
            part = self.store().partial / f"{node.blob}.part"
            try:
                fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                pass            # it became a blob since (renamed): read it there
            else:
                try:
                    return self._exactly(fd, offset, size, str(part))
                finally:
                    os.close(fd)
            if not self._whole(node):
                raise ReadFailed(f"{node.entry}: {part} went away and no blob took its place")
        return self._pread_blob(node.blob, offset, size)

    def _pread_blob(self, blob: str, offset: int, size: int) -> bytes:
        with self._blob_fds.use(self.store().blob_path(blob)) as fd:
            return self._exactly(fd, offset, size, f"blob {blob}")

    @staticmethod
    def _exactly(fd: int, offset: int, size: int, what: str) -> bytes:
        try:
            data = os.pread(fd, size, offset)
        except OSError as e:
            raise ReadFailed(f"{what}: {e.strerror}") from None
        if len(data) != size:
            # A verified range is written whole before it is journaled: a short read means
            # the file was cut behind the store's back.
            raise ReadFailed(f"{what}: {len(data)} of {size} bytes at {offset} "
                             f"({os.strerror(errno.EIO)})")
        return data
