"""A file's bytes read for sending, each of the manifest's pieces checked on the way.

A publish never sends a byte it didn't verify: the bytes a job reads are hashed in memory, piece
by piece (the pieces tile the file, so every byte is under one), before they leave, with no
second pass over the files. Parts of a multipart upload are whole pieces, grouped up to a
target size, so that each part's pieces are checked from that part's own bytes.

>>> from agent.manifest import Piece
>>> [(o, s) for o, s, _ in group([Piece(0, 4, "a"), Piece(4, 4, "b"), Piece(8, 2, "c")], 6)]
[(0, 8), (8, 2)]
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from agent.manifest import Piece
from agent.publish.destination import PublishError


def group(pieces: Sequence[Piece], target: int) -> list[tuple[int, int, tuple[Piece, ...]]]:
    """Consecutive pieces in runs of at least ``target`` bytes (the last run may be smaller):
    (offset, size, pieces) per run."""
    runs: list[tuple[int, int, tuple[Piece, ...]]] = []
    current: list[Piece] = []
    for p in pieces:
        current.append(p)
        if sum(q.size for q in current) >= target:
            runs.append(_run(current))
            current = []
    if current:
        runs.append(_run(current))
    return runs


def _run(pieces: list[Piece]) -> tuple[int, int, tuple[Piece, ...]]:
    return pieces[0].offset, sum(p.size for p in pieces), tuple(pieces)


def read_verified(path: Path, offset: int, size: int, pieces: Sequence[Piece]) -> bytes:
    """Bytes [offset, offset+size) of ``path``, once each piece in them hashes to the manifest's
    sha256 (``pieces`` tile that range)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise PublishError(f"{path}: {e.strerror}") from None
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise PublishError(f"{path}: shorter than the manifest says: it changed since the "
                           "build; build the manifest again")
    view = memoryview(data)
    for p in pieces:
        got = hashlib.sha256(view[p.offset - offset:p.offset - offset + p.size]).hexdigest()
        if got != p.sha256:
            raise PublishError(f"{path}: bytes {p.offset}-{p.offset + p.size - 1} are not those "
                               "of the manifest: the file changed since the build; build the "
                               "manifest again")
    return data
