"""The swarm's pure parts: neighbours, who fetches what from the sources, the picker; and how
the policy wires peers into shaping. The model the design was chosen by (one cluster, one piece
in and out per node at a time) is checked against the rules it relies on."""

from __future__ import annotations

import doctest
import itertools

from agent.peers import members, swarm
from agent.peers.swarm import Swarm, neighbors, order
from agent.policy.model import Peers, Policy, Shaping, Source
from agent.pull import picker
from agent.pull.picker import SOURCES, pick
from agent.pull.transfer import _have_pieces

PEERS = tuple(f"10.1.0.{i}" for i in range(1, 25))


def test_doctests():
    assert doctest.testmod(swarm).failed == 0
    assert doctest.testmod(picker).failed == 0


def test_neighbours_are_symmetric_connected_and_the_same_from_any_list_order():
    for n, d in itertools.product((2, 3, 8, 16, 24), (1, 2, 4, 6)):
        ps = PEERS[:n]
        adj = {p: set(neighbors(ps, p, d)) for p in ps}
        assert all(a in adj[b] for a in ps for b in adj[a])
        assert all(p not in adj[p] and 0 < len(adj[p]) <= max(d, 2) for p in ps)
        seen, todo = {ps[0]}, [ps[0]]
        for p in todo:
            for q in adj[p] - seen:
                seen.add(q)
                todo.append(q)
        assert seen == set(ps), (n, d)
        assert adj == {p: set(neighbors(tuple(reversed(ps)), p, d)) for p in ps}


def test_each_piece_has_one_root_and_the_roots_take_turns():
    swarms = [Swarm(PEERS[:8], p, 8090, 6) for p in PEERS[:8]]
    for blob in ("a" * 64, "b" * 64):
        for i in range(40):
            assert sorted(s.rank(blob, i) for s in swarms) == list(range(8))
        # over 8 consecutive pieces each node roots one: the cache's one copy spread evenly
        for start in (0, 8, 16):
            roots = [next(s.me for s in swarms if s.rank(blob, i) == 0)
                     for i in range(start, start + 8)]
            assert sorted(roots) == sorted(PEERS[:8])
    # a different file starts its turns elsewhere
    assert order(PEERS[:8], "a" * 64) != order(PEERS[:8], "b" * 64)


def test_the_picker_takes_the_rarest_piece_from_the_least_recently_asked_free_holder():
    a, b, c = ("f", 0), ("f", 10), ("f", 20)
    holds = {1: {a, b, c}, 2: {a, b}, 3: {a}}
    assert pick([a, b, c], holds, lambda n: True, lambda p: 5, 0.0, 2.0) == (c, 1)
    assert pick([a, b], holds, lambda n: True, lambda p: 5, 0.0, 2.0,
                last_asked={1: 5.0, 2: 1.0}) == (b, 2)
    # its holders all busy: the next rarest
    assert pick([a, b, c], holds, lambda n: n != 1, lambda p: 5, 0.0, 2.0) == (b, 2)
    # nothing offered: what it roots, from the sources; with a stream at the sources, nothing
    assert pick([a, b], {}, lambda n: True, lambda p: 0 if p == b else 3, 0.0, 2.0) \
        == (b, SOURCES)
    assert pick([a, b], {}, lambda n: True, lambda p: None, 100.0, 2.0) is None
    # the swarm still: the next in line fetches a piece nobody offers, one step at a time
    assert pick([a], {}, lambda n: True, lambda p: 2, 3.9, 2.0) is None
    assert pick([a], {}, lambda n: True, lambda p: 2, 4.0, 2.0) == (a, SOURCES)
    assert pick([a, b], {1: {a}}, lambda n: False, lambda p: 1, 9.0, 2.0) == (b, SOURCES)


def test_a_have_map_names_this_pulls_pieces_by_their_bits():
    class F:
        pieces = tuple(type("P", (), {"offset": o})() for o in (0, 100, 200, 300, 400, 500,
                                                                600, 700, 800))
    assert _have_pieces({"x": "a080", "other": "ff"}, {"x": F()}) == {
        ("x", 0), ("x", 200), ("x", 800)}


def test_this_node_is_the_entry_it_can_bind(monkeypatch):
    assert "127.0.0.1" in members.resolve(["localhost", "no-such-host.invalid"])
    monkeypatch.setattr(members, "resolve", lambda hosts: ("127.0.0.1", "192.0.2.7"))
    s = members.swarm(["whatever"], 8090, 6)
    assert s is not None and s.me == "127.0.0.1" and s.urls[1] == "http://192.0.2.7:8090"
    monkeypatch.setattr(members, "resolve", lambda hosts: ("192.0.2.7", "192.0.2.8"))
    assert members.swarm(["whatever"], 8090, 6) is None       # not among them: no swarm


def test_the_peers_port_is_shaped_both_ways_as_distribution_traffic():
    p = Policy(sources=(Source("http://cache:8080", cache=True),),
               shaping=Shaping(interfaces=("eth0",), serve_ports=(8080,)),
               peers=Peers(enabled=True, port=8090))
    assert p.shaping.serve_ports == (8080, 8090)
    assert any(s.url.endswith(":8090") for s in p.shaped_sources)
    q = Policy(shaping=Shaping(interfaces=("eth0",), pull_ports=(443,)),
               peers=Peers(enabled=True, port=8090, upload=10**8))
    assert q.shaping.pull_ports == (443, 8090) and q.peers.upload == 10**8
    off = Policy(shaping=Shaping(interfaces=("eth0",)))
    assert off.shaping.serve_ports == () and off.shaped_sources == ()
