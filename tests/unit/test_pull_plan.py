import collections
import doctest

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece
from agent.pull import plan as planning
from agent.pull.plan import RangeRequest, plan, requests_for, take_next


def sha(c):
    return c * 64


def f(path, fsha, *pieces):
    out, off = [], 0
    for size, psha in pieces:
        out.append(Piece(off, size, psha))
        off += size
    return FileEntry(path, off, fsha, tuple(out))


M = Manifest("m", "v2", "2026-12-02T11:00:00Z", (
    f("a.safetensors", sha("1"), (10, sha("a")), (20, sha("b")), (30, sha("c")), (40, sha("d"))),
    f("same.bin", sha("2"), (5, sha("e"))),
    f("copy-of-same.bin", sha("2"), (5, sha("e"))),
    f("config.json", sha("3"), (7, sha("f"))),
))


A, SAME, CONFIG = (blob_id(M.files[i]) for i in (0, 1, 3))


def test_present_files_cost_nothing_and_duplicates_fetch_once():
    p = plan(M, blobs={CONFIG: 7}, piece_index={}, journals={})
    assert p.present == (CONFIG,)
    assert [fp.paths for fp in p.files] == [("a.safetensors",), ("same.bin", "copy-of-same.bin")]
    assert p.bytes_total == 100 + 5 + 7
    assert p.bytes_fetch == 105


def test_local_pieces_are_copied_and_journaled_ones_kept():
    index = {sha("b"): (sha("9"), 1000), sha("e"): (sha("8"), 0)}
    journals = {A: {0: (10, sha("a")), 60: (40, sha("0"))}}     # second: stale hash
    p = plan(M, blobs={}, piece_index=index, journals=journals)
    a = p.files[0]
    assert [x.offset for x in a.done] == [0]
    assert [(c.piece.offset, c.blob, c.blob_offset) for c in a.copies] == [(10, sha("9"), 1000)]
    assert [x.offset for x in a.fetch] == [30, 60]
    assert p.bytes_done == 10 and p.bytes_fetch == 70 + 7


def test_a_piece_of_the_file_itself_is_not_a_copy_source():
    index = {sha("a"): (A, 0)}
    p = plan(M, blobs={}, piece_index=index, journals={})
    assert p.files[0].copies == ()


def test_requests_batch_consecutive_pieces_up_to_size():
    p = plan(M, blobs={}, piece_index={sha("b"): (sha("9"), 0)}, journals={})
    reqs = requests_for(p, request_size=75)
    assert [(r.blob, r.offset, r.size) for r in reqs] == [
        (A, 0, 10), (A, 30, 70), (SAME, 0, 5), (CONFIG, 0, 7)]
    reqs = requests_for(p, request_size=50)
    assert [(r.offset, r.size) for r in reqs][:3] == [(0, 10), (30, 30), (60, 40)]


def test_the_tail_goes_one_piece_per_request():
    p = plan(M, blobs={}, piece_index={}, journals={})
    reqs = requests_for(p, request_size=1000, tail=4)
    assert [(r.blob, r.offset, r.size) for r in reqs] == [
        (A, 0, 30), (A, 30, 30), (A, 60, 40), (SAME, 0, 5), (CONFIG, 0, 7)]
    assert len(requests_for(p, request_size=1000)) == 3


def test_a_blob_of_another_size_is_not_the_file():
    p = plan(M, blobs={CONFIG: 6}, piece_index={}, journals={})
    assert p.present == ()


def test_a_file_claiming_another_files_sha256_is_another_blob():
    # Same claimed sha256 as config.json, other pieces (other bytes): never the same blob, so
    # neither this version nor an honest one can ever use the other's bytes.
    liar = Manifest("x", "v1", M.published, (f("config.json", sha("3"), (7, sha("7"))),
                                               f("empty", sha("3"))))
    ids = [fp.blob for fp in plan(liar, blobs={}, piece_index={}, journals={}).files]
    assert len(set(ids)) == 2 and CONFIG not in ids


def test_requests_of_many_small_pieces_are_planned_in_linear_time():
    n = 40_000
    big = Manifest("m", "v1", M.published, (f("a.bin", sha("1"), *[(100, sha("a"))] * n),))
    p = plan(big, blobs={}, piece_index={}, journals={})
    reqs = requests_for(p, request_size=16 * 2**20, tail=16)
    assert sum(len(r.pieces) for r in reqs) == n


def test_the_last_requests_go_a_piece_at_a_time_for_the_streams_running():
    assert doctest.testmod(planning).failed == 0
    ps = tuple(Piece(o, 1, "0" * 64) for o in range(4))
    q = collections.deque(RangeRequest(b, ps) for b in "abcdef")
    assert len(take_next(q, 2).pieces) == 4           # 5 left: not yet under 2 x 2
    assert len(take_next(q, 2).pieces) == 4           # 4 left
    got = take_next(q, 2)                             # 3 left: split
    assert (got.blob, len(got.pieces)) == ("c", 1)
    assert [(r.blob, len(r.pieces)) for r in q][:4] == [("c", 1)] * 3 + [("d", 4)]
