"""Verified pieces land (sync, then journal) in a thread of their own, on real partial files."""

import threading
from dataclasses import dataclass

from agent.manifest import Piece
from agent.pull.landing import Landing
from agent.store.partial import Claims, Partial


@dataclass
class File:
    partial: Partial


def piece(offset: int, size: int = 4) -> Piece:
    return Piece(offset, size, "a" * 64)


def test_pieces_land_in_order_with_their_file_open_and_are_journaled(tmp_path):
    claims = Claims(tmp_path)
    f = File(Partial(tmp_path, "f" * 64, 16, claims=claims))
    landed = []

    def land(g, p, received):
        assert g.partial.fd >= 0                # opened by the landing thread
        g.partial.record_piece(p.offset, p.size, p.sha256)
        landed.append((p.offset, received))

    landing = Landing(land, fail=lambda g, e: landed.append(e))
    with f.partial.opened():
        for o in (0, 4, 8):
            f.partial.write(o, b"abcd")
            landing.put(f, piece(o), 4)
    landing.close()
    assert landed == [(0, 4), (4, 4), (8, 4)]
    assert f.partial.fd < 0                     # closed again when its last user left
    f.partial.close()
    again = Partial(tmp_path, "f" * 64, 16, claims=claims)
    assert sorted(again.done) == [0, 4, 8]      # the journal holds them
    again.close()
    claims.close()


def test_a_failure_fails_its_file_and_the_others_still_land(tmp_path):
    claims = Claims(tmp_path)
    bad = File(Partial(tmp_path, "b" * 64, 8, claims=claims))
    good = File(Partial(tmp_path, "c" * 64, 8, claims=claims))
    landed, failed = [], []

    def land(g, p, received):
        if g is bad:
            raise OSError(5, "Input/output error")
        landed.append(p.offset)

    landing = Landing(land, fail=lambda g, e: failed.append((g, e.errno)))
    landing.put(bad, piece(0), 4)
    landing.put(good, piece(0), 4)
    landing.put(good, piece(4), 4)
    landing.close()
    assert failed == [(bad, 5)] and landed == [0, 4]
    for f in (bad, good):
        f.partial.close()
    claims.close()


def test_put_waits_while_the_backlog_is_full(tmp_path):
    claims = Claims(tmp_path)
    f = File(Partial(tmp_path, "d" * 64, 16, claims=claims))
    go = threading.Event()
    landed = []

    def land(g, p, received):
        go.wait(10)
        landed.append(p.offset)

    landing = Landing(land, fail=lambda g, e: None, backlog=8)
    landing.put(f, piece(0), 4)
    landing.put(f, piece(4), 4)             # 8 bytes wait: the next put waits
    third = threading.Thread(target=landing.put, args=(f, piece(8), 4))
    third.start()
    third.join(0.3)
    assert third.is_alive()
    go.set()
    third.join(10)
    assert not third.is_alive()
    landing.close()
    assert landed == [0, 4, 8]
    f.partial.close()
    claims.close()
