"""A local directory as a publish destination: the root an nginx origin serves.

A file is copied, each of its pieces checked against the manifest on the way
(``agent.publish.pieces``), to a temporary name beside its place, flushed, then renamed over it,
and its directory flushed: nginx serves the old file, nothing, or the whole new one, never half,
and a power cut leaves the same. Modes are those nginx reads (files 0644, directories 0755),
whatever the umask. A file already there with the size and the sha256 of the manifest's entry is
kept (a publish resumed after an interruption rewrites only what is missing).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

from agent import hashing
from agent.durable import fsync_dir, write_atomic
from agent.manifest import FileEntry
from agent.publish.destination import Job, Present, PublishError, Sent
from agent.publish.pieces import group, read_verified

COPY_CHUNK = 16 << 20           # pieces read, checked and written at a time


class LocalDestination:
    def __init__(self, root: Path) -> None:
        self.root = root
        if not root.is_dir():
            raise PublishError(f"{root}: no such directory (the origin's root; create it, "
                               "or give an s3://BUCKET/PREFIX)")

    def _path(self, key: str) -> Path:
        # Keys are built from names the manifest checked (no '..', no absolute parts).
        return self.root.joinpath(*key.split("/"))

    def name(self, key: str) -> str:
        return str(self._path(key))

    def read(self, key: str, limit: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(limit + 1)[:limit + 1]
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PublishError(f"{self.name(key)}: {e.strerror}") from None

    def present(self, key: str) -> Present | None:
        path = self._path(key)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PublishError(f"{path}: {e.strerror}") from None
        # No place keeps what it was written with: read it back (a local disk, once per
        # resumed file) only when the size can match.
        return Present(size, None)

    def same(self, key: str, entry: FileEntry) -> bool:
        """The file under ``key`` holds exactly ``entry``'s bytes."""
        found = self.present(key)
        return (found is not None and found.size == entry.size
                and hashing.file_sha256(self._path(key)) == entry.sha256)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        _mkdirs(path.parent)
        try:
            write_atomic(path, data, mode=0o644)
        except OSError as e:
            raise PublishError(f"{path}: {e.strerror}") from None

    def file_jobs(self, key: str, path: Path, entry: FileEntry
                  ) -> tuple[list[Job], Callable[[], None]]:
        target = self._path(key)
        if self.same(key, entry):
            return [], lambda: None
        return [Job(lambda sent: self._copy(path, target, entry, sent), entry.size)], \
            lambda: None

    def _copy(self, source: Path, target: Path, entry: FileEntry, sent: Sent) -> None:
        """Piece by piece: read, hash, write; the temporary file is renamed over ``target``
        only once every piece matched the manifest."""
        _mkdirs(target.parent)
        tmp = target.with_name(f".{target.name}.wagent-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "xb") as dst:
                os.fchmod(dst.fileno(), 0o644)
                for offset, size, pieces in group(entry.pieces, COPY_CHUNK):
                    dst.write(read_verified(source, offset, size, pieces))
                    sent(size)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, target)
            fsync_dir(target.parent)
        except OSError as e:
            raise PublishError(f"{target}: {e.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        pass


def _mkdirs(d: Path) -> None:
    try:
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as e:
        raise PublishError(f"{d}: {e.strerror}") from None
