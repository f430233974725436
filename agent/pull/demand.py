"""Pieces someone waits for: the meeting point of a mount's readers and the pulls that run.

A read through a lazy mount (``agent.mount``) of a piece not verified yet must get that piece
first, ahead of the background pull, and then wait for it; it must never get a byte that wasn't
verified. The pull's own machinery already does the fetching, the verifying and the journaling,
within the bucket, the backoff and the HTB cap: so a wanted piece is not fetched by a second
client beside the pull (that would fetch it twice, and outside the shaping), it is moved to the
front of the running pull's queue (``Transfer.want``), and the reader waits for the pull to
verify it.

Pulls register the files they fetch here (``attach``), by blob id, and say when a piece lands
(``landed``); a reader asks :meth:`Demand.wait` for one piece of one blob, which returns once
the piece is verified in the partial file (or the whole file is a blob), or raises
:class:`NotYet` at its deadline, with the reason the reader's caller logs and shows.

Lock order: a transfer calls :meth:`landed` after releasing its own lock, and :meth:`wait`
calls ``Transfer.want`` without holding this one, so the two locks are never held together. A
wake-up lost between the two is caught by the generation counter (and, at worst, by the wait's
short timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from agent.manifest import Piece

# A waiting reader looks again at least this often: for a blob that appeared without a transfer
# telling (a pull in another process, `wagent pull`), and for its deadline.
RECHECK = 0.5


class NotYet(Exception):
    """The piece wasn't verified before the reader's deadline; the message says why."""


class PieceSource(Protocol):
    """A running pull, as the readers see it (``agent.pull.transfer.Transfer``)."""

    def want(self, blob: str, piece: Piece, waiting: bool = True) -> bool:
        """True when the piece is verified in its partial file; else it is put first in the
        pull's queue (or is being fetched already) and False is returned. ``waiting``: a
        reader waits for it (False: read-ahead)."""
        ...


    def fetching(self, blob: str, offset: int) -> bool:
        """A stream of this pull is receiving the piece at ``offset`` now."""
        ...

    def verified_pieces(self, blob: str) -> frozenset[int]:
        """The offsets of the pieces of ``blob`` verified (and journaled) so far."""
        ...


class Demand:
    """One per daemon (or per CLI pull): which pulls hold which blobs, and who waits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._sources: dict[str, PieceSource] = {}     # blob id -> the pull fetching it
        self._generation = 0
        self._wishes: list[tuple[str, Piece]] = []      # read-ahead, in the order wanted
        self.waiting = 0                                 # readers waiting now (status)
        self.wanted = 0                                  # pieces asked for ahead of the pull

    def attach(self, source: PieceSource, blobs: list[str]) -> None:
        """A pull fetches ``blobs`` from now on: the wishes for them go first in its queue."""
        with self._cond:
            for b in blobs:
                self._sources[b] = source
            self._generation += 1
            self._cond.notify_all()
            mine = set(blobs)
            wishes = [(b, p) for b, p in self._wishes if b in mine]
        for b, p in wishes:               # served in the order asked
            source.want(b, p, waiting=False)

    def wish(self, pieces: list[tuple[str, Piece]]) -> None:
        """Read-ahead: pieces readers are about to want, most urgent first (what an engine
        reads first: configs and tokenizers, then each shard's header). Asked of the pull that
        has them now, or of the next one that attaches them."""
        with self._cond:
            self._wishes = list(pieces) + [w for w in self._wishes if w not in pieces]
            now = [(self._sources[b], b, p) for b, p in pieces if b in self._sources]
        for source, b, p in now:
            source.want(b, p, waiting=False)

    def forget(self, blobs: set[str]) -> None:
        """No reader will want these any more (a version no longer shown)."""
        with self._cond:
            self._wishes = [w for w in self._wishes if w[0] not in blobs]

    def detach(self, source: PieceSource) -> None:
        with self._cond:
            for b in [b for b, s in self._sources.items() if s is source]:
                del self._sources[b]
            self._generation += 1
            self._cond.notify_all()

    def landed(self) -> None:
        """A piece was verified, or a file became a blob: waiting readers look again."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def pulling(self, blob: str) -> bool:
        with self._cond:
            return blob in self._sources

    @property
    def generation(self) -> int:
        """Moves on at every piece verified, file landed, pull attached or detached."""
        with self._cond:
            return self._generation

    def changed(self, after: int, timeout: float) -> int:
        """Waits until the generation is past ``after`` (at most ``timeout`` s); returns it."""
        with self._cond:
            self._cond.wait_for(lambda: self._generation != after, timeout)
            return self._generation

    def verified(self, blob: str) -> frozenset[int] | None:
        """The verified pieces' offsets of a blob a pull is fetching; None if none is."""
        with self._cond:
            source = self._sources.get(blob)
        return None if source is None else source.verified_pieces(blob)

    def fetching(self, blob: str, piece: Piece) -> bool:
        """A pull's stream is fetching ``piece`` now (it will land, or fail, without waiting
        on anything a peer holds)."""
        with self._cond:
            source = self._sources.get(blob)
        return source is not None and source.fetching(blob, piece.offset)

    def wait(self, blob: str, piece: Piece, deadline: float,
             in_blob: Callable[[], bool], why_not: Callable[[], str],
             waiting: bool = True) -> str:
        """Returns ``"blob"`` when the file is a blob (read it there), ``"part"`` when the piece
        is verified in the partial file. ``in_blob`` looks at the store; ``why_not`` says why
        nothing comes (the model's pull state), for :class:`NotYet`'s message. ``waiting``
        False: the piece goes first in the pull's queue without stopping its other streams
        (a peer's request: its bytes are for another node, not a reader here)."""
        asked = False
        readers = 1 if waiting else 0       # a peer's wait lifts no floor (readers_waiting)
        with self._cond:
            self.waiting += readers
        try:
            while True:
                if in_blob():
                    return "blob"
                with self._cond:
                    source = self._sources.get(blob)
                    seen = self._generation
                if source is not None:
                    if source.want(blob, piece, waiting):
                        return "part"
                    if not asked and waiting:
                        asked = True
                        with self._cond:
                            self.wanted += 1
                left = deadline - self.clock()
                if left <= 0:
                    raise NotYet(why_not())
                with self._cond:
                    if self._generation == seen:
                        self._cond.wait(min(left, RECHECK))
        finally:
            with self._cond:
                self.waiting -= readers

    def hint(self, blob: str, piece: Piece) -> None:
        """Ask for a piece without waiting (read-ahead): first in the queue, if a pull has it."""
        with self._cond:
            source = self._sources.get(blob)
        if source is not None:
            source.want(blob, piece, waiting=False)
