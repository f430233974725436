"""sha256 of files and of their pieces, in parallel threads.

hashlib releases the GIL while it hashes a buffer of more than 2 KiB, so threads hashing separate
pieces (or files) use every core; each thread reads into its own reused buffer with ``readinto``.
The whole-file hash is one more sequential pass; a file made of one piece reuses that piece's hash.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

CHUNK = 4 * 2**20
EMPTY_SHA256 = hashlib.sha256().hexdigest()


def hash_range(path: Path, offset: int, size: int, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(chunk, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = size
        while left:
            n = f.readinto(view[:min(left, len(buf))])
            if not n:
                raise OSError(f"{path}: ended {left} bytes early (was it changed while hashed?)")
            h.update(view[:n])
            left -= n
    return h.hexdigest()


def fd_range_sha256(fd: int, offset: int, size: int, chunk: int = CHUNK) -> str:
    """sha256 of bytes [offset, offset+size) of an open file (positional reads: thread-safe);
    a file that ends early hashes what it has, which then fails the comparison."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(min(chunk, max(size, 1))))
    left = size
    while left:
        n = os.preadv(fd, [buf[:min(left, len(buf))]], offset)
        if not n:
            break
        h.update(buf[:n])
        left, offset = left - n, offset + n
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hash_range(path, 0, os.stat(path).st_size)


def hash_files(plans: Sequence[tuple[Path, Sequence[tuple[int, int]]]],
               jobs: int | None = None) -> list[tuple[str, list[str]]]:
    """For each (path, piece bounds): (file sha256, [piece sha256...]), on ``jobs`` threads."""
    jobs = jobs or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="hash") as pool:
        # The whole-file hashes are the longest tasks: submit them first so they overlap the rest.
        whole: list[Future[str] | None] = [
            pool.submit(file_sha256, path) if len(bounds) != 1 else None for path, bounds in plans]
        parts = [[pool.submit(hash_range, path, o, s) for o, s in bounds] for path, bounds in plans]
        out = []
        for w, ps in zip(whole, parts, strict=True):
            piece_shas = [p.result() for p in ps]
            if w is not None:
                file_sha = w.result()
            else:
                file_sha = piece_shas[0]
            out.append((file_sha if piece_shas or w is not None else EMPTY_SHA256, piece_shas))
        return out
