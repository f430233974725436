"""Verified pieces on their way into the journal, off the streams' receive path.

A piece is journaled only once its bytes are on disk: fdatasync, then the journal line (so a
crash never leaves a journal claiming bytes the part file lacks). A stream that did that itself
stopped reading its socket for the fdatasync, 2-10 ms a piece on a real disk, more under load,
and a pull's receive windows are sized for a queue budget of about a millisecond
(``agent.yielding.sockets``): the sender stalls within that budget, so every piece cost its
stream the rest of the sync. With fewer streams each stream lands more pieces per second: on
the yield bench's 1 Gbit/s link two streams carried 88-92% of the link and eight 95%, the syncs
and the size of a stream's reads (``PullOptions.chunk``) making the difference.

So a stream hands a verified piece to ``Landing`` and reads on; one thread per pull syncs and
journals. Pieces of one file waiting together take one fdatasync (it covers every byte written
to the file before it). ``put`` waits while more than ``backlog`` bytes wait to land, so a disk
slower than the network still holds the streams (and a crash loses at most that much of
verified work, besides the pieces in flight).

    landing = Landing(land=done, fail=failed)
    landing.put(state, piece, received)     # a stream, after the piece's sha256 matched
    landing.close()                         # every piece put is landed (or failed) by now
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from agent.manifest import Piece
from agent.store.partial import Partial

BACKLOG = 256 * 2**20       # bytes verified and waiting to land before a stream waits


class HasPartial(Protocol):
    @property
    def partial(self) -> Partial: ...


F = TypeVar("F", bound=HasPartial)


class Landing(Generic[F]):
    """``land(file, piece, received)`` runs for each piece put, in the order put, after its
    bytes are synced (with the partial file open, unless it is finished); ``fail(file,
    error)`` for an error of a sync or of ``land`` (the other files' pieces still land)."""

    def __init__(self, land: Callable[[F, Piece, int], None],
                 fail: Callable[[F, Exception], None], backlog: int = BACKLOG) -> None:
        self._land = land
        self._fail = fail
        self.backlog = backlog
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[F, Piece, int]] = collections.deque()
        self._waiting = 0           # bytes in the queue and in the batch being landed
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pull-landing", daemon=True)
        self._thread.start()

    def put(self, f: F, piece: Piece, received: int) -> None:
        with self._cond:
            while self._waiting >= self.backlog and not self._closing:
                self._cond.wait(0.2)
            self._queue.append((f, piece, received))
            self._waiting += piece.size
            self._cond.notify_all()

    def close(self) -> None:
        """Land what was put, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            files: dict[int, list[tuple[F, Piece, int]]] = {}
            for item in batch:
                files.setdefault(id(item[0]), []).append(item)
            for items in files.values():
                self._land_file(items)
            with self._cond:
                self._waiting -= sum(p.size for _, p, _ in batch)
                self._cond.notify_all()

    def _land_file(self, items: list[tuple[F, Piece, int]]) -> None:
        f = items[0][0]
        try:
            if f.partial.finished:
                # Every piece landed already (one fetched twice): nothing to sync; ``land``
                # counts it once.
                for _, piece, received in items:
                    self._land(f, piece, received)
                return
            with f.partial.opened():
                f.partial.sync()
                for _, piece, received in items:
                    self._land(f, piece, received)
        except Exception as e:          # handed to the pull, which fails with it
            self._fail(f, e)
