"""Making file system changes durable: what a power cut must not undo."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:     # a file system that can't fsync a directory
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a reader, or a crash, sees the old file or the new
    one, never half of one. ``durable``: the data and the rename survive a power cut too (an
    LRU hint need not). The temporary name is never followed if it is a symlink."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)     # whatever the umask
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
