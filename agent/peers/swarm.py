"""How the nodes of a cluster share a version: who talks to whom, who fetches what first.

Every node of a cluster holds the same peer list (the policy's ``peers.hosts``). From it alone,
with no coordinator to ask, elect or lose, each node derives:

* **its neighbours**: ``peers.neighbors`` of them, on a ring of the peers in rendezvous order
  (``sha256(peer)``) with chords across it, so the graph is connected, symmetric, and a node's
  neighbours are spread over the ring. A node learns what its neighbours hold (their have-maps,
  ``agent.peers.server``) and fetches only from them.
* **the pieces it roots**: piece ``i`` of a file is fetched from the sources (the cache, then
  the origin) by one node only, the first of the peers in the blob's rendezvous order
  (``sha256(peer, blob)``) rotated by ``i``; every other node gets it from a neighbour. So the
  cache sends each piece once, and the first copies are spread evenly over the cluster (over N
  consecutive pieces of a file each node roots one).

Then each node fetches the piece fewest neighbours hold, from a neighbour that holds it and
isn't sending too much already (``agent.pull.picker``), or a piece it roots from the sources
when no neighbour has anything for it. Why, in numbers from a model of one cluster (32 pieces,
every link the same rate, a cold cache filling at that rate; last node done over S / B):

=============================================================  =====  =====  =====
design (the model)                                             N = 8  N = 16 N = 24
=============================================================  =====  =====  =====
a binary tree per piece (parents fixed), links shared          1.84   2.58   2.55
a chain per piece (each node forwards to one)                  1.40   1.54   1.78
any holder, two pieces in and out at a time                    2.07   2.19   2.19
any neighbour of 6, one piece in and one out at a time         1.25   1.25   1.31
=============================================================  =====  =====  =====

A piece is forwarded only once it is whole and verified (a byte not verified is never served),
so each hop costs a piece's whole time on the link it crosses. Sent side by side, n pieces each
take n times as long: the same bytes per second, but every hop waits n times longer, and the
last pieces reach the last nodes late. In the model, one at a time is best: each hop costs a
piece's time at the link's full rate, and fetching what neighbours hold, not what a fixed
parent holds, keeps every link busy (BitTorrent's rarest first; the bound is about
S / B x (1 + log2 N / pieces)).

The real thing differs in one way the model leaves out: a stream is not a link. Its socket's
receive window is kept to a millisecond of the link by the backoff (at least four segments),
and every piece is a request whose answer waits for a thread to wake at both ends, so one
stream carries far less than the link. Measured (tests/bench/peers.py, 32 MiB in 1 MiB pieces,
40 Mbit/s; last node done over S / B; one run each, about +-0.07):

========================================  =====  =====
streams in / pieces sent at once          N = 8  N = 16
========================================  =====  =====
3 / 1 (the model's one out)                2.44   2.72
3 / 2                                      1.87   2.20
4 / 3                                      1.82   1.97
**6 / 3** (shipped)                        1.65   2.07
6 / 4                                      1.68   2.01
========================================  =====  =====

>>> s = Swarm(("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"), "10.0.0.1",
...           port=8090, degree=2)
>>> len(s.neighbors), s.me not in [s.peers[i] for i in s.neighbors]
(2, True)
>>> sorted(Swarm(s.peers, p, 8090, 2).rank("b1", 3) for p in s.peers)  # one root, then a line
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# Pieces a node sends its neighbours at once (its piece server answers 429 beyond): few, so
# each goes out at most of the uplink's rate and is passed on soon (the model above), but
# several, so the uplink never idles while a neighbour's next request crosses the wire and
# window-bound streams fill it together (measured below the model's table).
SEND_AT_ONCE = 3


def _score(*parts: str) -> bytes:
    return hashlib.sha256("\n".join(parts).encode()).digest()


def ring(peers: Sequence[str]) -> tuple[str, ...]:
    """The peers in rendezvous order: the same on every node, whatever order the list has."""
    return tuple(sorted(peers, key=lambda p: (_score(p), p)))


def neighbors(peers: Sequence[str], me: str, degree: int) -> tuple[str, ...]:
    """``me``'s neighbours: the peers 1, 2, ... steps away on the ring and, past the first
    two, chords a third of the ring away; symmetric (if b is a's, a is b's). Two per step
    (one each way), so ``degree`` rounded down to even, and at least the ring's two.

    >>> ps = [f"p{i}" for i in range(12)]
    >>> all(a in neighbors(ps, b, 4) for a in ps for b in neighbors(ps, a, 4))
    True
    """
    order = ring(peers)
    n = len(order)
    if me not in order or n < 2:
        return ()
    if degree >= n - 1:
        return tuple(p for p in order if p != me)
    steps = []
    for k in range(1, max(1, degree // 2) + 1):
        # 1, n/3, 2, n/3 + 1, ...: near and far, so that a piece crosses the ring in few hops
        steps.append(1 + (k - 1) // 2 if k % 2 else max(2, n // 3) + (k - 2) // 2)
    pos = order.index(me)
    out: list[str] = []
    for s in steps:
        for d in (s, -s):
            p = order[(pos + d) % n]
            if p != me and p not in out:
                out.append(p)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def order(peers: tuple[str, ...], blob: str) -> tuple[str, ...]:
    """The blob's rendezvous order: piece ``i``'s root is ``order[i % N]``, then the next in
    line after it. Kept per blob: a pull asks it for every piece at every choice."""
    return tuple(sorted(peers, key=lambda p: (_score(p, blob), p)))


@dataclass(frozen=True)
class Swarm:
    """This node's place among its peers, as a pull uses it (``agent.pull.swarm.Peers``)."""

    peers: tuple[str, ...]
    me: str
    port: int
    degree: int

    @functools.cached_property
    def neighbors(self) -> tuple[int, ...]:
        """Indexes into ``peers`` (and ``urls``) of this node's neighbours."""
        mine = set(neighbors(self.peers, self.me, self.degree))
        return tuple(i for i, p in enumerate(self.peers) if p in mine)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(url(p, self.port) for p in self.peers)

    def rank(self, blob: str, index: int) -> int:
        """This node's place in line for fetching piece ``index`` of ``blob`` from the
        sources: 0, it does (it roots the piece); k, it does once the piece's first k in line
        have been silent long enough (``agent.pull.picker``: one of them is down)."""
        return (_place(self.peers, self.me, blob) - index) % len(self.peers)


@functools.lru_cache(maxsize=4096)
def _place(peers: tuple[str, ...], me: str, blob: str) -> int:
    return order(peers, blob).index(me)


def url(address: str, port: int) -> str:
    """A peer's piece server (``agent.peers.server``), by its address."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
