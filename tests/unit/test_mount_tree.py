"""The lazy mount's tree (values from manifests), the pieces a read touches, and what is read
ahead; the registry where readers wait for the pull's pieces (``agent.pull.demand``)."""

import threading
import time

import pytest

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece
from agent.mount.service import read_ahead
from agent.mount.tree import ROOT, Tree, Version, next_piece, pieces_for
from agent.pull.demand import Demand, NotYet


def _file(path: str, sizes: list[int], tag: str = "0") -> FileEntry:
    pieces, off = [], 0
    for i, n in enumerate(sizes):
        pieces.append(Piece(off, n, f"{tag}{i:x}".ljust(64, "0")))
        off += n
    return FileEntry(path, off, tag.ljust(64, "1"), tuple(pieces))


def _manifest(version: str = "v1") -> Manifest:
    return Manifest("m", version, "2026-01-01T00:00:00Z", (
        _file("config.json", [10], "a"),
        _file("sub/model-00001-of-00002.safetensors", [4, 4, 2], "b"),
        _file("sub/model-00002-of-00002.safetensors", [8], "c"),
    ))


def test_a_version_is_a_directory_of_its_manifests_files_with_stable_inodes():
    t = Tree()
    top = t.add(Version("m", "v1", _manifest(), 1.0))
    assert [n.name for n in t.listing(ROOT)] == ["m@v1"]
    assert [n.name for n in t.listing(top.inode)] == ["config.json", "sub"]
    sub = t.lookup(top.inode, "sub")
    shard = t.lookup(sub.inode, "model-00001-of-00002.safetensors")
    assert shard.size == 10 and shard.blob == blob_id(_manifest().files[1])
    # the same paths get the same numbers in another process (a restarted daemon)
    again = Tree()
    again.add(Version("m", "v1", _manifest(), 1.0))
    assert set(again.nodes) == set(t.nodes)
    # another version: other numbers; removing one leaves the other whole
    t.add(Version("m", "v2", _manifest("v2"), 2.0))
    assert len(t.nodes) == 2 * len(again.nodes) - 1
    t.remove("m@v1")
    assert [n.name for n in t.listing(ROOT)] == ["m@v2"] and len(t.nodes) == len(again.nodes)


def test_the_pieces_a_read_touches():
    f = _file("x", [4, 4, 2])
    assert [p.offset for p in pieces_for(f, 0, 1)] == [0]
    assert [p.offset for p in pieces_for(f, 3, 2)] == [0, 4]
    assert [p.offset for p in pieces_for(f, 4, 4)] == [4]
    assert [p.offset for p in pieces_for(f, 0, 100)] == [0, 4, 8]
    assert pieces_for(f, 10, 5) == [] and pieces_for(f, 3, 0) == []
    assert next_piece(f, f.pieces[1]) == f.pieces[2] and next_piece(f, f.pieces[2]) is None


def test_read_ahead_is_small_files_then_each_shards_header():
    m = _manifest()
    got = [(b, p.offset) for b, p in read_ahead(m)]
    assert got == [(blob_id(m.files[0]), 0), (blob_id(m.files[1]), 0), (blob_id(m.files[2]), 0)]


class FakePull:
    """A pull as readers see it: pieces land when the test says."""

    def __init__(self) -> None:
        self.done: set[tuple[str, int]] = set()
        self.asked: list[tuple[str, int]] = []

    def want(self, blob: str, piece: Piece, waiting: bool = True) -> bool:
        if (blob, piece.offset) in self.done:
            return True
        self.asked.append((blob, piece.offset))
        return False


def test_a_reader_waits_for_its_piece_and_asks_for_it_first():
    demand, pull = Demand(), FakePull()
    piece = Piece(4, 4, "0" * 64)
    demand.attach(pull, ["b"])
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(
        demand.wait("b", piece, time.monotonic() + 10, lambda: False, lambda: "")))
    t.start()
    deadline = time.monotonic() + 5
    while not pull.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pull.asked[0] == ("b", 4) and demand.waiting == 1
    pull.done.add(("b", 4))
    demand.landed()
    t.join(5)
    assert got == ["part"] and demand.waiting == 0 and demand.wanted == 1


def test_a_whole_blob_needs_no_pull_and_no_pull_means_the_deadline():
    demand = Demand()
    piece = Piece(0, 4, "0" * 64)
    assert demand.wait("b", piece, time.monotonic() + 1, lambda: True, lambda: "") == "blob"
    started = time.monotonic()
    with pytest.raises(NotYet, match="its pull is failed"):
        demand.wait("b", piece, started + 0.3, lambda: False, lambda: "its pull is failed")
    assert 0.25 < time.monotonic() - started < 2


def test_wishes_go_to_the_pull_that_attaches_them_in_order():
    demand, pull = Demand(), FakePull()
    p0, p1 = Piece(0, 1, "0" * 64), Piece(1, 1, "0" * 64)
    demand.wish([("a", p0), ("b", p1), ("z", p0)])
    demand.attach(pull, ["a", "b"])
    assert pull.asked == [("a", 0), ("b", 1)]
