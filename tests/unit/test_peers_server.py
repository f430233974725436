"""The piece server (agent.peers.server) over a real store and real HTTP: verified bytes only,
held only while a stream has the piece in hand, 503 at once otherwise; bounded names."""

from __future__ import annotations

import hashlib
import http.client
import threading
import time

import pytest

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece, to_json
from agent.peers.catalog import Catalog
from agent.peers.server import PeerServer
from agent.peers.swarm import SEND_AT_ONCE
from agent.pull.demand import Demand
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket

DATA = bytes(range(256)) * 64          # 16 KiB: 4 pieces of 4 KiB
PIECE = 4096


def entry(path: str = "w.bin") -> FileEntry:
    pieces = tuple(Piece(o, PIECE, hashlib.sha256(DATA[o:o + PIECE]).hexdigest())
                   for o in range(0, len(DATA), PIECE))
    return FileEntry(path, len(DATA), hashlib.sha256(DATA).hexdigest(), pieces)


class FakePull:
    """What Demand asks of a running pull: which pieces are verified, which in hand."""

    def __init__(self, store: Store, f: FileEntry, demand: Demand) -> None:
        self.f, self.demand = f, demand
        self.blob = blob_id(f)
        self.part = store.partial / f"{self.blob}.part"
        self.part.write_bytes(b"\0" * len(DATA))
        self.done: set[int] = set()
        self.in_hand: set[int] = set()
        self.wanted: list[int] = []

    def want(self, blob: str, piece: Piece, waiting: bool = True) -> bool:
        if piece.offset in self.done:
            return True
        self.wanted.append(piece.offset)
        return False

    def fetching(self, blob: str, offset: int) -> bool:
        return offset in self.in_hand

    def land(self, offset: int) -> None:
        with open(self.part, "r+b") as fh:
            fh.seek(offset)
            fh.write(DATA[offset:offset + PIECE])
        self.done.add(offset)
        self.in_hand.discard(offset)
        self.demand.landed()


@pytest.fixture
def bed(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.ensure()
    demand = Demand()
    catalog = Catalog(lambda: store)
    server = PeerServer("127.0.0.1", 0, catalog, demand, lambda: store,
                        upload=TokenBucket(None), wait=lambda: 10.0, max_connections=8)
    server.start()
    f = entry()
    m = Manifest("m", "v1", "2026-12-06T00:00:00Z", (f,))
    pull = FakePull(store, f, demand)
    try:
        yield server, catalog, demand, pull, m
    finally:
        server.stop()


def get(server: PeerServer, path: str, headers: dict[str, str] | None = None
        ) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def test_a_verified_piece_of_a_version_in_flight_is_served_and_others_are_503_at_once(bed):
    server, catalog, demand, pull, m = bed
    server.in_swarm = lambda: True               # a swarm member, asked by a neighbour
    server.is_peer = lambda address: True
    with catalog.offering(m, to_json(m)):
        demand.attach(pull, [pull.blob])
        pull.land(PIECE)
        status, headers, body = get(server, "/m/v1/w.bin", {"Range": "bytes=4096-8191"})
        assert status == 206 and body == DATA[PIECE:2 * PIECE]
        assert headers["Content-Range"] == f"bytes 4096-8191/{len(DATA)}"
        # not held: a hold (up to wait, 10 s) would have seen the piece land at 5 s
        later = threading.Timer(5.0, pull.land, args=(0,))
        later.start()
        try:
            status, headers, _ = get(server, "/m/v1/w.bin", {"Range": "bytes=0-4095"})
        finally:
            later.cancel()
        assert status == 503 and "Retry-After" in headers
        assert 0 in pull.wanted                      # ...but it went first in the pull
        status, _, body = get(server, "/m/v1/manifest.json")
        assert status == 200 and body == to_json(m)
        assert get(server, "/m/latest")[2] == b"v1\n"


def test_a_piece_in_hand_is_held_until_it_lands(bed):
    server, catalog, demand, pull, m = bed
    server.in_swarm = lambda: True               # a swarm member, asked by another node
    with catalog.offering(m, to_json(m)):
        demand.attach(pull, [pull.blob])
        pull.in_hand.add(2 * PIECE)
        t0 = time.monotonic()       # before the timer starts: it lands 0.3 s after that
        threading.Timer(0.3, pull.land, args=(2 * PIECE,)).start()
        status, _, body = get(server, "/m/v1/w.bin", {"Range": f"bytes={2 * PIECE}-"
                                                               f"{3 * PIECE - 1}"})
        assert status == 206 and body == DATA[2 * PIECE:3 * PIECE]
        assert time.monotonic() - t0 >= 0.3 and server.served.waited == 1
        # A range whose next piece is in no stream's hand: the body stops after the verified
        # one and the connection closes (the client keeps what it verified, asks on).
        pull.land(0)
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        c.request("GET", "/m/v1/w.bin", headers={"Range": f"bytes=0-{2 * PIECE - 1}"})
        r = c.getresponse()
        assert r.status == 206
        with pytest.raises(http.client.IncompleteRead) as e:
            r.read()
        assert e.value.partial == DATA[:PIECE]
        c.close()


def test_names_that_are_not_in_a_manifest_are_404_and_a_bad_range_416(bed):
    server, catalog, demand, pull, m = bed
    with catalog.offering(m, to_json(m)):
        for path in ("/m/v1/../../etc/passwd", "/m/v1/other.bin", "/m/v9/w.bin",
                     "/m/.tmp-x/w.bin", "/m/current/w.bin", "/x"):
            assert get(server, path)[0] == 404, path
        assert get(server, "/m/v1/w.bin", {"Range": "bytes=99999-"})[0] == 416
    assert get(server, "/m/v1/w.bin")[0] == 404      # the pull ended: nothing in flight


def test_the_have_map_lists_verified_pieces_and_a_line_more_as_each_lands(bed):
    import json as _json

    server, catalog, demand, pull, m = bed
    pull.verified_pieces = lambda blob: frozenset(pull.done)
    with catalog.offering(m, to_json(m)):
        demand.attach(pull, [pull.blob])
        pull.land(PIECE)
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            c.request("GET", "/.wagent/have/m/v1")
            r = c.getresponse()
            assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked"
            doc = _json.loads(r.readline())
            assert doc["have"] == {pull.blob: "40"}     # piece 1 of 4
            threading.Timer(0.2, pull.land, args=(0,)).start()
            t0 = time.monotonic()
            doc = _json.loads(r.readline())
            assert doc["have"] == {pull.blob: "c0"} and time.monotonic() - t0 >= 0.2
        finally:
            c.close()
    assert get(server, "/.wagent/have/m/v1")[0] == 404


def test_a_cache_holds_its_cluster_until_the_piece_lands_and_sends_one_at_a_time(bed):
    server, catalog, demand, pull, m = bed
    server.is_peer = lambda address: True        # a cache (outside the swarm) and its nodes
    with catalog.offering(m, to_json(m)):
        demand.attach(pull, [pull.blob])
        t0 = time.monotonic()
        threading.Timer(0.3, pull.land, args=(3 * PIECE,)).start()
        status, _, body = get(server, "/m/v1/w.bin", {"Range": f"bytes={3 * PIECE}-"})
        assert status == 206 and body == DATA[3 * PIECE:]
        assert time.monotonic() - t0 >= 0.3      # not in any stream's hand: held all the same
        assert 3 * PIECE in pull.wanted           # ...and put first in the cache's pull


def test_a_cache_sends_a_piece_it_has_while_its_send_slots_wait_for_one_it_has_not(bed):
    server, catalog, demand, pull, m = bed
    server.is_peer = lambda address: True        # a cache (outside the swarm) and its nodes
    with catalog.offering(m, to_json(m)):
        demand.attach(pull, [pull.blob])
        # More nodes than send slots ask for a piece still on its way from the origin...
        held = [threading.Thread(target=get, args=(server, "/m/v1/w.bin",
                                                   {"Range": f"bytes={3 * PIECE}-"}))
                for _ in range(SEND_AT_ONCE + 1)]
        for t in held:
            t.start()
        while pull.wanted.count(3 * PIECE) < len(held):
            time.sleep(0.01)
        pull.land(PIECE)
        later = threading.Timer(5.0, pull.land, args=(3 * PIECE,))
        later.start()
        try:
            # ...and one asks for a piece that is here: it goes out before the other lands.
            status, _, body = get(server, "/m/v1/w.bin",
                                  {"Range": f"bytes={PIECE}-{2 * PIECE - 1}"})
            assert status == 206 and body == DATA[PIECE:2 * PIECE]
            assert 3 * PIECE not in pull.done
        finally:
            later.cancel()
            pull.land(3 * PIECE)
            for t in held:
                t.join(10)


def test_a_cache_names_the_version_it_pulls_and_looks_at_once_for_one_it_has_not_seen(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.ensure()
    pokes: list[str] = []
    now = [100.0]
    catalog = Catalog(lambda: store, poke=lambda model: pokes.append(model) is None,
                      clock=lambda: now[0])
    assert catalog.latest("m") is None
    (store.models / "m").mkdir()
    (store.models / "m" / "latest").write_text("v0\nwagent-announced-by cache\n")
    assert catalog.latest("m") == "v0"
    m = Manifest("m", "v1", "2026-12-06T00:00:00Z", (entry(),))
    with catalog.offering(m, to_json(m)):
        assert catalog.latest("m") == "v1"          # in flight: announced at once
        assert catalog.find("m", "v1").in_flight
    assert catalog.latest("m") == "v0"
    assert catalog.find("m", "../etc") is None and catalog.find("m", "current") is None
    assert catalog.look_now("m") and catalog.look_now("m") and pokes == ["m"]   # once a second
    now[0] += 1.0
    assert catalog.look_now("m") and pokes == ["m", "m"]
    assert not Catalog(lambda: store, poke=lambda model: False).look_now("m")   # not a cache
    # told by the cache: any node looks, for a name that can be a model's, once a second
    told: list[str] = []
    node = Catalog(lambda: store, told=lambda model: told.append(model) is None,
                   clock=lambda: now[0])
    assert node.look_when_told("m") and node.look_when_told("m") and told == ["m"]
    assert not node.look_when_told("../m") and told == ["m"]
    assert not catalog.look_when_told("m")              # a daemon that can't be told
