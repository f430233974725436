"""What a lazy mount shows: a read-only tree of versions, each the files its manifest lists.

The daemon serves one FUSE mount (``agent.mount.fuse_server``: a FUSE session is per process);
its root holds one directory per version a ``wagent mount`` asked for, ``MODEL@VERSION``, which
the root CLI bind-mounts onto the directory the engine reads. So the tree is values only: built
from manifests, no file system behind it, and the sizes, names and layout are known before a
byte is pulled (``ls``, ``stat`` and an engine's listing answer at once).

Inode numbers are derived from what they name (the version and the path), not handed out in
order: the kernel keeps the numbers it was given for as long as it caches an entry, so a daemon
that restarts and serves the same mount again must give every path the number it had.
"""

from __future__ import annotations

import bisect
import hashlib
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece

ROOT = 1                       # FUSE's root inode (FUSE_ROOT_ID)
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444


def entry_name(model: str, version: str) -> str:
    """The directory of a version under the mount's root (names are checked by the manifest
    rules: neither holds ``@`` or ``/``)."""
    return f"{model}@{version}"


def _inode(*parts: str) -> int:
    """A stable number for a path: 62 bits of its hash, never the root's (a clash between two
    paths of one mount has a chance of about 2^-62 per pair)."""
    n = int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big") >> 2
    return n if n > ROOT else n + 2


@dataclass
class Node:
    inode: int
    name: str
    parent: int
    mode: int
    size: int = 0
    entry: str = ""                     # the MODEL@VERSION it belongs to ("" for the root)
    file: FileEntry | None = None       # for files
    blob: str = ""                      # the file's blob id (agent.blob_id), for files
    children: dict[str, int] = field(default_factory=dict)   # name -> inode, for directories

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass(frozen=True)
class Version:
    model: str
    version: str
    manifest: Manifest
    published: float                    # the manifest's time: every node's mtime

    @property
    def name(self) -> str:
        return entry_name(self.model, self.version)


class Tree:
    """The inodes of every version shown. Mutated only by the daemon's control calls (under
    the mount's lock, ``agent.mount.service``); read by the FUSE handlers."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, "", ROOT, DIR_MODE)}
        self.versions: dict[str, Version] = {}

    def add(self, v: Version) -> Node:
        """Shows ``v`` (again: the same inodes) under the root; returns its directory."""
        if v.name in self.versions:
            return self.nodes[self.nodes[ROOT].children[v.name]]
        top = Node(_inode(v.name), v.name, ROOT, DIR_MODE, entry=v.name)
        self.nodes[top.inode] = top
        for f in v.manifest.files:
            parent = top
            parts = f.path.split("/")
            for i, part in enumerate(parts[:-1]):
                ino = parent.children.get(part)
                if ino is None:
                    d = Node(_inode(v.name, *parts[:i + 1]), part, parent.inode, DIR_MODE,
                             entry=v.name)
                    self.nodes[d.inode] = d
                    parent.children[part] = d.inode
                    ino = d.inode
                parent = self.nodes[ino]
            node = Node(_inode(v.name, *parts), parts[-1], parent.inode, FILE_MODE, f.size,
                        entry=v.name, file=f, blob=blob_id(f))
            self.nodes[node.inode] = node
            parent.children[node.name] = node.inode
        self.nodes[ROOT].children[v.name] = top.inode
        self.versions[v.name] = v
        return top

    def remove(self, name: str) -> None:
        """Hides a version: its nodes go (the kernel forgets them once nothing holds them)."""
        if self.versions.pop(name, None) is None:
            return
        top = self.nodes[ROOT].children.pop(name)
        for node in list(self.walk(top)):
            del self.nodes[node.inode]

    def walk(self, inode: int) -> Iterator[Node]:
        node = self.nodes[inode]
        yield node
        for child in node.children.values():
            yield from self.walk(child)

    def lookup(self, parent: int, name: str) -> Node | None:
        p = self.nodes.get(parent)
        if p is None:
            return None
        ino = p.children.get(name)
        return None if ino is None else self.nodes.get(ino)

    def listing(self, inode: int) -> list[Node]:
        """A directory's children in a stable order (readdir resumes by position)."""
        d = self.nodes[inode]
        return [self.nodes[i] for _, i in sorted(d.children.items())]


def _start(p: Piece) -> int:
    return p.offset


def pieces_for(f: FileEntry, offset: int, size: int) -> list[Piece]:
    """The pieces holding bytes ``[offset, offset + size)`` of ``f`` (clipped to the file).

    >>> from agent.manifest import FileEntry, Piece
    >>> f = FileEntry("a", 10, "0" * 64, (Piece(0, 4, "a" * 64), Piece(4, 4, "b" * 64),
    ...                                   Piece(8, 2, "c" * 64)))
    >>> [p.offset for p in pieces_for(f, 3, 2)], [p.offset for p in pieces_for(f, 9, 100)]
    ([0, 4], [8])
    """
    end = min(f.size, offset + size)
    if offset >= end:
        return []
    first = bisect.bisect_right(f.pieces, offset, key=_start) - 1
    out = []
    for p in f.pieces[max(0, first):]:
        if p.offset >= end:
            break
        out.append(p)
    return out


def next_piece(f: FileEntry, piece: Piece) -> Piece | None:
    """The piece after ``piece`` in ``f``, for read-ahead."""
    i = bisect.bisect_right(f.pieces, piece.offset, key=_start)
    return f.pieces[i] if i < len(f.pieces) else None
