"""What a pull has to do: a pure function of the manifest and what the store already holds.

For every distinct file (two paths with one sha256 are one file):

* its sha256 is already a blob: nothing to do;
* otherwise each piece is either already in the file's partial (its journal says so), present in a
  local blob at some offset (copied locally, never fetched), or fetched.

Fetched pieces are batched into requests of consecutive pieces up to ``request_size`` bytes (fewer
requests for small tensor groups; a request never splits a piece), files in manifest order, so the
streams work through one file together and files complete (and free their partials) one by one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from agent.manifest import Manifest, Piece


@dataclass(frozen=True)
class Copy:
    piece: Piece
    blob: str             # sha256 of the local blob holding the same bytes
    blob_offset: int


@dataclass(frozen=True)
class FilePlan:
    sha256: str
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
    def copy_bytes(self) -> int:
        return sum(c.piece.size for c in self.copies)

    @property
    def done_bytes(self) -> int:
        return sum(p.size for p in self.done)


@dataclass(frozen=True)
class Plan:
    files: tuple[FilePlan, ...]     # files that need work
    present: tuple[str, ...]        # sha256 of files already in blobs/
    bytes_total: int                # distinct files' bytes
    bytes_present: int

    @property
    def bytes_fetch(self) -> int:
        return sum(f.fetch_bytes for f in self.files)

    @property
    def bytes_copy(self) -> int:
        return sum(f.copy_bytes for f in self.files)

    @property
    def bytes_done(self) -> int:
        return sum(f.done_bytes for f in self.files)


@dataclass(frozen=True)
class Request:
    sha256: str                    # the file
    pieces: tuple[Piece, ...]      # consecutive

    @property
    def offset(self) -> int:
        return self.pieces[0].offset

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def plan(manifest: Manifest, blobs: Collection[str],
         piece_index: Mapping[str, tuple[str, int]],
         journals: Mapping[str, Mapping[int, tuple[int, str]]]) -> Plan:
    paths: dict[str, list[str]] = {}
    firsts = {}
    for f in manifest.files:
        paths.setdefault(f.sha256, []).append(f.path)
        firsts.setdefault(f.sha256, f)
    files, present = [], []
    total = present_bytes = 0
    for sha, f in firsts.items():
        total += f.size
        if sha in blobs:
            present.append(sha)
            present_bytes += f.size
            continue
        journal = journals.get(sha, {})
        done, copies, fetch = [], [], []
        for p in f.pieces:
            if journal.get(p.offset) == (p.size, p.sha256):
                done.append(p)
            elif p.sha256 in piece_index and piece_index[p.sha256][0] != sha:
                blob, blob_offset = piece_index[p.sha256]
                copies.append(Copy(p, blob, blob_offset))
            else:
                fetch.append(p)
        files.append(FilePlan(sha, f.size, tuple(paths[sha]), f.pieces, tuple(done),
                              tuple(copies), tuple(fetch)))
    return Plan(tuple(files), tuple(present), total, present_bytes)


def requests_for(p: Plan, request_size: int, tail: int = 0) -> list[Request]:
    """Fetch requests in order: file by file, consecutive pieces batched up to request_size.

    The last ``tail`` pieces go one per request, so the streams run out of work together
    instead of one stream finishing a long request alone.
    """
    pieces = [(f.sha256, piece) for f in p.files for piece in f.fetch]
    cut = max(0, len(pieces) - tail)
    out: list[Request] = []
    run: list[Piece] = []
    run_sha = ""
    for i, (sha, piece) in enumerate(pieces):
        if run and (sha != run_sha or i >= cut or run[-1].offset + run[-1].size != piece.offset
                    or sum(x.size for x in run) + piece.size > request_size):
            out.append(Request(run_sha, tuple(run)))
            run = []
        run.append(piece)
        run_sha = sha
    if run:
        out.append(Request(run_sha, tuple(run)))
    return out
