"""A cluster whose nodes serve each other (the policy's ``peers``), as ``wagent plan --fleet``
models it. Pure: rates in bytes per second, times in seconds.

With peers on, a cluster's cache pulls the version from the origin (a flow of the simulation
like any other, and the cluster's only one from the origin) and sends each piece once, to the
node that roots it; the nodes pass the pieces on among themselves (``agent.peers.swarm``). A
node of such a cluster learns of the version as soon as its cache starts it (the cache's piece
server names the version it is pulling as ``latest``), and is held by three things:

* **its own download**: the node's cap times ``GOODPUT``, what a node fed by its neighbours,
  a piece per request, carries of its link;
* **what the cluster can upload**: the cache's egress and every node's upload to its peers
  (its link, within ``peers.upload``), shared by the nodes pulling at once, as a cache's
  egress is shared in a cluster without peers;
* **the cache's own pull**: no node has a piece before the cache does, so none is done before
  the cache is, plus the time its last piece takes to reach every node (``pipeline``); and the
  first pieces reach a node that long after it starts (the simulation adds that long's worth
  of bytes to what the node fetches).

The cache sends each piece once (``agent.peers.swarm``: one root per piece). Not modelled: the
orphan rule (a root that died: its pieces come from the cache once more), CPU (on the emulated
cluster, 25 daemons on two cores run out of it at N = 16 and 24: tests/bench/peers.py prints
both), and a cluster with peers but no cache, whose nodes the simulation has pull from the
origin as before.
"""

from __future__ import annotations

import math

from agent.peers.swarm import SEND_AT_ONCE

# What a node fed by its neighbours carries of its link, measured on the emulated cluster
# (tests/bench/peers.py, 8 nodes at 40 Mbit/s, 1 MiB pieces: 3.5-3.7 MB/s of 4.75 while the
# cache pulled): each piece is a request of its own, through the small receive windows the
# backoff sets, and a stream waits between pieces for a neighbour that has the next. With it
# the plan's last node was 2% (32 MiB) and 8% (64 MiB) off the measured one at 8 nodes.
GOODPUT = 0.76


def pipeline(nodes: int, piece: float, cache_rate: float, node_rate: float) -> float:
    """Seconds from the cache's last piece to every node having it: the cache sends it to its
    root, then each holder passes it to ``SEND_AT_ONCE`` neighbours at a time (a piece is
    forwarded only once whole and verified), holders multiplying by 1 + SEND_AT_ONCE a hop.

    >>> round(pipeline(8, 1 << 20, 4.75e6, 4.75e6), 2)     # 1 MiB pieces, 40 Mbit/s links
    1.55
    """
    if nodes <= 1 or node_rate <= 0:
        return piece / cache_rate if cache_rate > 0 else 0.0
    hops = math.ceil(math.log(nodes) / math.log(1 + SEND_AT_ONCE) - 1e-9)
    return piece / cache_rate + hops * SEND_AT_ONCE * piece / node_rate
