"""Which piece a node fetches next, and from whom, when its cluster's nodes serve each other.

Pure: what the node still needs (in file order), what each neighbour holds (its have-map,
``agent.peers.server``), which neighbours are sending now or down, which pieces this node roots
(``agent.peers.swarm``); out comes one choice. The rules, in order:

1. **A piece a neighbour holds**, the one fewest neighbours hold (rarest first: it is the one
   the cluster is short of, and the one this node can soonest pass on), then the earliest in
   the version; from the holder that is free (not sending to this node's knowledge, not down),
   the one asked least recently (spreading the load).
2. **A piece this node roots** (``rank`` 0), from the sources (the cache, then the origin),
   the earliest.
3. **A piece nobody offers**, once the swarm has stood still (no neighbour's have-map grew,
   no piece landed here) for ``patience`` seconds times this node's place in line for it
   (``rank``): its root is down, or not pulling, and the next in line fetches it from the
   sources, then the one after that if that one is down too. The cache sends such a piece
   once more, not once per node.
4. Else nothing: wait for a have-map to change.

>>> a, b = ("f", 0), ("f", 1)
>>> pick([a, b], {7: {a, b}, 8: {b}}, free=lambda p: True, rank=lambda x: 3,
...      waited=0.0, patience=2.0)
(('f', 0), 7)
>>> pick([a, b], {7: {a, b}, 8: {b}}, free=lambda p: p != 7, rank=lambda x: 3,
...      waited=0.0, patience=2.0)
(('f', 1), 8)
>>> pick([a, b], {}, free=lambda p: True, rank=lambda x: 0 if x == b else 3, waited=0.0,
...      patience=2.0)
(('f', 1), None)
>>> pick([a, b], {}, free=lambda p: True, rank=lambda x: 3, waited=5.0, patience=2.0)
>>> pick([a, b], {}, free=lambda p: True, rank=lambda x: 3, waited=6.0, patience=2.0)
(('f', 0), None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set

Piece = tuple[str, int]          # (blob id, offset)
SOURCES = None                   # "from the sources", in a choice


def pick(needed: Sequence[Piece], holds: Mapping[int, Set[Piece]],
         free: Callable[[int], bool], rank: Callable[[Piece], int | None],
         waited: float, patience: float,
         last_asked: Mapping[int, float] | None = None) -> tuple[Piece, int | None] | None:
    """``needed``: pieces not verified here nor being fetched, in the version's order;
    ``holds``: neighbour index -> the pieces it has verified; ``free(n)``: neighbour ``n``
    may be asked now; ``rank(p)``: this node's place in line to fetch ``p`` from the sources
    (None: not now, a stream fetches from them already); ``waited``: seconds since the swarm
    last moved; ``last_asked``: neighbour -> when it was last asked."""
    asked = last_asked or {}
    best: tuple[int, int, Piece, int] | None = None
    for pos, piece in enumerate(needed):
        holders = [n for n, have in holds.items() if piece in have]
        if not holders:
            continue
        ready = [n for n in holders if free(n)]
        if not ready:
            continue
        key = (len(holders), pos)
        if best is None or key < best[:2]:
            best = (len(holders), pos, piece,
                    min(ready, key=lambda n: (asked.get(n, float("-inf")), n)))
    if best is not None:
        return best[2], best[3]
    offered: set[Piece] | None = None
    for piece in needed:
        r = rank(piece)
        if r is None:
            return None
        if r == 0:
            return piece, SOURCES
        if waited >= patience * r:
            if offered is None:
                offered = set().union(*holds.values()) if holds else set()
            if piece not in offered:
                return piece, SOURCES
    return None
