"""How a pull runs: one typed value from the policy's ``pulls`` section to the streams.

``PullOptions.from_policy`` builds it from :class:`agent.policy.model.Pulls` (the policy's model
of that section; ``agent.pull.node_pulls`` builds it once per policy, ``wagent pull`` once per
command); ``agent.pull.engine`` hands the same value to :class:`agent.pull.transfer.Transfer`,
with the streams and request size this pull uses (``dataclasses.replace``):

>>> o = PullOptions(streams=4, retries=1)
>>> o.timeouts.connect, o.floor.min_rate
(10.0, 65536)
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.policy.model import Pulls
from agent.pull.deadlines import Timeouts
from agent.pull.goodput import Floor


@dataclass(frozen=True)
class PullOptions:
    streams: int = 32                   # at most, or exactly without ``adaptive``
    # True: the count chosen by measuring what each stream adds (agent.pull.stream_count), up
    # to ``streams`` (the policy's ``pulls.adaptive_streams``, ``wagent pull --no-adaptive``)
    adaptive: bool = True
    # with peers: how long a piece no neighbour offers (and this node doesn't root) is waited
    # for before the sources are asked, and a piece the cache can't send yet is asked of it
    # again before the next source is (the policy's ``peers.wait``)
    peer_wait: float = 10.0
    piece_size: int = 64 * 2**20        # publisher side; here only the cap of one request
    # Consecutive pieces batched into one Range request at most; a pull lowers it so that its
    # streams finish together (agent.pull.engine), and hands the transfer what it uses.
    request_size: int = 16 * 2**20
    # Bytes read, then hashed and written (and paid to the bucket), at a time. A stream's
    # window holds its share of the rate over the base RTT plus the 1 ms queue budget
    # (agent.yielding.sockets): what a window holds drains in about that time, whatever the
    # rate or the count, so the stream must be back at its socket sooner. Hashing and writing
    # 1 MiB took about 0.9 ms here, and 2 streams carried 91.5% of the yield bench's link
    # against 95.0% with 256 KiB (0.2 ms), as 8 streams do either way.
    chunk: int = 256 * 2**10
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    # Deadlines (agent/pull/deadlines.py): a response's headers within headers_deadline s of
    # its request (None: connect + read timeout); a manifest or `latest` body at
    # small_body_rate bytes/s at least, after one read timeout.
    headers_deadline: float | None = None
    small_body_rate: float = 256 * 1024
    retries: int = 5
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    durable: bool = True                # fdatasync a piece before journaling it
    # Every piece is verified and the pieces tile the file, so the file's sha256 already holds;
    # True adds one sequential re-read and hash of each file (about doubling the CPU per GB).
    verify_files: bool = False
    # A floor on one request's goodput: a source whose body arrives slower than min_goodput
    # bytes/s, averaged over goodput_average_over seconds (after goodput_grace seconds), is
    # abandoned and the rest of the request retried on the next source. Only time spent waiting
    # on the network counts, never time held by the rate limit. 0 turns it off. Reads are capped
    # at min_goodput x goodput_average_over / 2 bytes (see goodput.py); the defaults keep that at
    # 1 MiB, the usual chunk (smaller reads cost CPU). A stream under 64 KiB/s for half a minute
    # is broken: 10 Mbit/s spread over 16 streams still gives each about 78 KB/s.
    min_goodput: int = 64 * 1024
    goodput_average_over: float = 32.0
    goodput_grace: float = 30.0

    @classmethod
    def from_policy(cls, pulls: Pulls) -> PullOptions:
        return cls(streams=pulls.streams, adaptive=pulls.adaptive_streams,
                   piece_size=pulls.piece_size,
                   request_size=min(pulls.piece_size, cls.request_size),
                   connect_timeout=pulls.connect_timeout, read_timeout=pulls.read_timeout,
                   retries=pulls.retries)

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(self.connect_timeout, self.read_timeout, self.headers_deadline,
                        self.small_body_rate)

    @property
    def floor(self) -> Floor:
        return Floor(self.min_goodput, self.goodput_average_over, self.goodput_grace)
