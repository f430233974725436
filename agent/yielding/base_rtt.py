"""The base RTT of the path to each peer, remembered across connections: the smallest RTT seen
in each of the last ten minutes (RFC 6817's base delay history).

A socket's own ``tcpi_min_rtt`` is the smallest RTT it saw since it opened. A pull whose
connections open while another host's pull already fills the bottleneck they share (two cache
nodes behind one origin) sees that standing queue in every sample, its handshake's included: it
takes the queue for the path and sizes its windows for it. On the emulated fleet the second
cache read 2.5-3.2 ms where the path is 7-10 us, its windows came out about 4x the first's and
it took up to 65% of the origin (LEDBAT's "latecomer" problem). The daemon's earlier
connections to the same peer (its polls of ``latest``, made while the path was idle) saw the
path without that queue; remembered per peer, they keep a latecomer's windows as small as the
first pull's.

Kept as one minimum per minute for ``history`` minutes, so a path whose RTT really grew (a new
route) is believed ten minutes later at most; meanwhile the windows are sized for the old RTT,
which slows that pull and never queues more. Pure: ``now`` is passed in.

    >>> b = BaseRtts()
    >>> b.observe("10.0.0.1", 8e-6, now=0.0); b.observe("10.0.0.1", 2.5e-3, now=30.0)
    >>> b.base("10.0.0.1", now=30.0), b.base("10.0.0.1", now=700.0), b.base("10.0.0.2", 0.0)
    (8e-06, None, None)
"""

from __future__ import annotations

BUCKET_S = 60.0
HISTORY = 10                 # buckets: RFC 6817's BASE_HISTORY, ten one-minute minima
MAX_PEERS = 256              # the least recently seen peer is forgotten past this


class BaseRtts:
    """Per peer (an address): the minimum RTT of each of the last ``history`` buckets."""

    def __init__(self, bucket_s: float = BUCKET_S, history: int = HISTORY,
                 max_peers: int = MAX_PEERS) -> None:
        self.bucket_s = bucket_s
        self.history = history
        self.max_peers = max_peers
        # Oldest bucket first; the dict's order is the peers' last observation, oldest first.
        self._peers: dict[str, list[tuple[int, float]]] = {}

    def observe(self, peer: str, rtt_s: float, now: float) -> None:
        if rtt_s <= 0:
            return
        bucket = int(now // self.bucket_s)
        buckets = self._peers.pop(peer, [])
        self._peers[peer] = buckets
        if buckets and buckets[-1][0] == bucket:
            if rtt_s < buckets[-1][1]:
                buckets[-1] = (bucket, rtt_s)
        else:
            buckets.append((bucket, rtt_s))
        first = bucket - self.history + 1
        while buckets and buckets[0][0] < first:
            buckets.pop(0)
        while len(self._peers) > self.max_peers:
            del self._peers[next(iter(self._peers))]

    def base(self, peer: str, now: float) -> float | None:
        """The smallest RTT to ``peer`` in the last ``history`` buckets; None: none seen."""
        first = int(now // self.bucket_s) - self.history + 1
        return min((rtt for bucket, rtt in self._peers.get(peer, ()) if bucket >= first),
                   default=None)
