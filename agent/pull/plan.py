"""What a pull has to do: a pure function of the manifest and what the store already holds.

For every distinct file (two paths with the same pieces are one file, named by its blob id: see
``agent.blob_id``):

* its blob is already in the store, with the file's size: nothing to do;
* otherwise each piece is either already in the file's partial (its journal says so), present in a
  local blob at some offset (copied locally, never fetched), or fetched.

Fetched pieces are batched into requests of consecutive pieces up to ``request_size`` bytes (fewer
requests for small tensor groups; a request never splits a piece), files in manifest order, so the
streams work through one file together and files complete (and free their partials) one by one.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece


@dataclass(frozen=True)
class Copy:
    piece: Piece
    blob: str             # name of the local blob holding the same bytes
    blob_offset: int


@dataclass(frozen=True)
class FilePlan:
    blob: str                      # the file's blob id: where it lands, what its partial is called
    size: int
    paths: tuple[str, ...]
    pieces: tuple[Piece, ...]
    done: tuple[Piece, ...]        # verified in the partial already
    copies: tuple[Copy, ...]
    fetch: tuple[Piece, ...]

    @property
    def fetch_bytes(self) -> int:
        return sum(p.size for p in self.fetch)

    @property
    def done_bytes(self) -> int:
        return sum(p.size for p in self.done)


@dataclass(frozen=True)
class PullPlan:
    files: tuple[FilePlan, ...]     # files that need work
    present: tuple[str, ...]        # blob ids of files already in blobs/
    bytes_total: int                # distinct files' bytes
    bytes_present: int

    @property
    def bytes_fetch(self) -> int:
        return sum(f.fetch_bytes for f in self.files)

    @property
    def bytes_done(self) -> int:
        return sum(f.done_bytes for f in self.files)


@dataclass(frozen=True)
class RangeRequest:
    blob: str                      # the file's blob id
    pieces: tuple[Piece, ...]      # consecutive

    @property
    def offset(self) -> int:
        return self.pieces[0].offset

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def distinct_files(manifest: Manifest) -> dict[str, tuple[FileEntry, tuple[str, ...]]]:
    """blob id -> (the first entry with those pieces, every path that has them), in order."""
    firsts: dict[str, FileEntry] = {}
    paths: dict[str, list[str]] = {}
    for f in manifest.files:
        bid = blob_id(f)
        firsts.setdefault(bid, f)
        paths.setdefault(bid, []).append(f.path)
    return {bid: (f, tuple(paths[bid])) for bid, f in firsts.items()}


def plan(manifest: Manifest, blobs: Mapping[str, int],
         piece_index: Mapping[str, tuple[str, int]],
         journals: Mapping[str, Mapping[int, tuple[int, str]]]) -> PullPlan:
    """``blobs``: blob id -> size of the blobs in the store; one of another size than the file
    is not the file (a blob damaged or cut short) and is fetched anew."""
    files, present = [], []
    total = present_bytes = 0
    for bid, (f, paths) in distinct_files(manifest).items():
        total += f.size
        if blobs.get(bid) == f.size:
            present.append(bid)
            present_bytes += f.size
            continue
        journal = journals.get(bid, {})
        done, copies, fetch = [], [], []
        for p in f.pieces:
            if journal.get(p.offset) == (p.size, p.sha256):
                done.append(p)
            elif p.sha256 in piece_index and piece_index[p.sha256][0] != bid:
                blob, blob_offset = piece_index[p.sha256]
                copies.append(Copy(p, blob, blob_offset))
            else:
                fetch.append(p)
        files.append(FilePlan(bid, f.size, paths, f.pieces, tuple(done), tuple(copies),
                              tuple(fetch)))
    return PullPlan(tuple(files), tuple(present), total, present_bytes)


def requests_for(p: PullPlan, request_size: int, tail: int = 0) -> list[RangeRequest]:
    """Fetch requests in order: file by file, consecutive pieces batched up to request_size.

    The last ``tail`` pieces go one per request, so the streams run out of work together
    instead of one stream finishing a long request alone.
    """
    pieces = [(f.blob, piece) for f in p.files for piece in f.fetch]
    cut = max(0, len(pieces) - tail)
    out: list[RangeRequest] = []
    run: list[Piece] = []
    run_blob = ""
    run_size = 0            # kept as it grows: a run may hold thousands of small pieces
    for i, (blob, piece) in enumerate(pieces):
        if run and (blob != run_blob or i >= cut or run[-1].offset + run[-1].size != piece.offset
                    or run_size + piece.size > request_size):
            out.append(RangeRequest(run_blob, tuple(run)))
            run, run_size = [], 0
        run.append(piece)
        run_size += piece.size
        run_blob = blob
    if run:
        out.append(RangeRequest(run_blob, tuple(run)))
    return out


def take_piece(queue: collections.deque[RangeRequest], blob: str, offset: int
               ) -> RangeRequest | None:
    """Takes the piece of ``blob`` at ``offset`` out of ``queue``, as a request of its own, for
    a reader waiting on it: the request holding it is split, the rest of that request goes to
    the front (a reader mostly reads on), what came before it stays where it was. None if no
    queued request holds it (a stream is fetching it, or it was never planned).

    >>> from agent.manifest import Piece
    >>> ps = tuple(Piece(o, 1, "0" * 64) for o in range(4))
    >>> q = collections.deque([RangeRequest("x", ps[:1]), RangeRequest("b", ps)])
    >>> got = take_piece(q, "b", 2)
    >>> [p.offset for p in got.pieces], [(r.blob, [p.offset for p in r.pieces]) for r in q]
    ([2], [('b', [3]), ('x', [0]), ('b', [0, 1])])
    """
    for i, req in enumerate(queue):
        if req.blob != blob or not req.pieces[0].offset <= offset <= req.pieces[-1].offset:
            continue
        k = next(j for j, p in enumerate(req.pieces) if p.offset >= offset)
        if req.pieces[k].offset != offset:
            return None                   # not a piece boundary of this manifest
        del queue[i]
        if k:
            queue.insert(i, RangeRequest(blob, req.pieces[:k]))
        if k + 1 < len(req.pieces):
            queue.appendleft(RangeRequest(blob, req.pieces[k + 1:]))
        return RangeRequest(blob, (req.pieces[k],))
    return None


def near_end(queue: collections.deque[RangeRequest], streams: int) -> bool:
    """Fewer than twice as many requests queued as ``streams``: a pull's last requests, which
    go a piece at a time (``take_next``) and say nothing of the path (the stream count)."""
    return len(queue) < 2 * streams


def take_next(queue: collections.deque[RangeRequest], streams: int) -> RangeRequest:
    """The next request of a non-empty ``queue`` for one of ``streams`` streams. Once fewer than
    twice as many requests as streams are queued, a piece at a time (the rest of the request
    back at the front): a stream that takes a long request near the end would go on alone
    while the others have finished (a request is planned before the count is known: 16 MiB
    behind a 5 MB/s cap per connection is 3.2 s).

    >>> from agent.manifest import Piece
    >>> ps = tuple(Piece(o, 1, "0" * 64) for o in range(3))
    >>> q = collections.deque(RangeRequest(b, ps) for b in "abc")
    >>> [p.offset for p in take_next(q, 1).pieces], len(q)
    ([0, 1, 2], 2)
    >>> [p.offset for p in take_next(q, 1).pieces], [(r.blob, len(r.pieces)) for r in q]
    ([0], [('b', 1), ('b', 1), ('c', 3)])
    """
    req = queue.popleft()
    if len(req.pieces) > 1 and near_end(queue, streams):
        queue.extendleft(RangeRequest(req.blob, (p,)) for p in reversed(req.pieces[1:]))
        req = RangeRequest(req.blob, req.pieces[:1])
    return req
