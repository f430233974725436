"""What a pull needs of its cluster's peers (``agent.peers.swarm.Swarm`` is the one there is):
every peer's URL, which of them are this node's neighbours, and its place in line to fetch
each piece from the sources. A protocol, so that the pulls never import the peers' room (its
server waits on their pieces)."""

from __future__ import annotations

from typing import Protocol


class Peers(Protocol):
    @property
    def urls(self) -> tuple[str, ...]:
        """Every peer's base URL (it serves the origin's layout, ``agent.peers.server``)."""
        ...

    @property
    def neighbors(self) -> tuple[int, ...]:
        """Indexes into ``urls`` of the peers this node fetches from."""
        ...

    def rank(self, blob: str, index: int) -> int:
        """This node's place in line to fetch piece number ``index`` of the file ``blob`` from
        the sources: 0, it does; k, once the swarm has been still for k steps."""
        ...
