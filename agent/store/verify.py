"""Re-reading what is published: every file of a version hashed again, piece by piece and whole.

A blob's name proves what the pull verified; a disk can still rot, and a hand can still edit a
file. ``verify`` reads each blob once, feeding every buffer to the current piece's hash and to the
whole file's, so the publisher's sha256 is checked too (the one place besides ``--verify-files``
where it is).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from agent.manifest import FileEntry, Manifest
from agent.store.layout import Store

CHUNK = 4 * 2**20


@dataclass(frozen=True)
class Problem:
    model: str
    version: str
    path: str
    why: str


def versions(store: Store, model: str | None = None, version: str | None = None
             ) -> Iterator[Manifest]:
    """The published versions to check: all, one model's, or one."""
    for m in store.every_manifest():
        if (model is None or m.model == model) and (version is None or m.version == version):
            yield m


def verify(store: Store, m: Manifest) -> list[Problem]:
    """Every bad file of one version, with the reason; [] when all of it reads back right."""
    linked = store.linked_blobs(m)
    problems = []
    for f in m.files:
        name = linked.get(f.path)
        why = "its link is missing or not into blobs/" if name is None \
            else _check_file(store, name, f)
        if why is not None:
            problems.append(Problem(m.model, m.version, f.path, why))
    return problems


def _check_file(store: Store, name: str, f: FileEntry) -> str | None:
    try:
        fd = os.open(store.blob_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"its blob {name[:12]} can't be opened: {e.strerror}"
    try:
        size = os.fstat(fd).st_size
        if size != f.size:
            return f"{size} bytes, the manifest says {f.size}"
        whole = hashlib.sha256()
        buf = memoryview(bytearray(CHUNK))
        for p in f.pieces:
            h = hashlib.sha256()
            left, offset = p.size, p.offset
            while left:
                n = os.preadv(fd, [buf[:min(left, CHUNK)]], offset)
                if not n:
                    return f"ends at {offset}, the manifest says {f.size} bytes"
                h.update(buf[:n])
                whole.update(buf[:n])
                left, offset = left - n, offset + n
            if h.hexdigest() != p.sha256:
                return f"bytes {p.offset}+{p.size} do not match their sha256"
        if whole.hexdigest() != f.sha256:
            return (f"every piece matches but the whole file's sha256 is {whole.hexdigest()}, "
                    f"the manifest says {f.sha256}")
        return None
    except OSError as e:
        return f"reading its blob failed: {e.strerror}"
    finally:
        os.close(fd)
