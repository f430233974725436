"""What the detectors report each tick: plain frozen values, rates in bits per second.

A detector turns cumulative kernel counters into rates between two ticks; the controller
(``agent.yielding.controller``) only ever sees these values, so it is tested without any /proc or
/sys.

>>> r = Readings(at=12.0, ports=(PortReading(port=29500, connections=1, bps=None,
...                                          peers=("10.0.0.1:29500",)),))
>>> r.training_connections
1
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkReading:
    """One interface: its traffic that is not distribution traffic."""

    ifname: str
    other_bps: float          # max over the two directions of (link bytes - distribution bytes)
    rx_bps: float
    tx_bps: float
    distribution_bps: float | None = None  # None: the caller gave no distribution counter


@dataclass(frozen=True)
class RdmaReading:
    """One RDMA port (``mlx5_0/1``): NCCL over InfiniBand or RoCE never passes tc."""

    device: str
    port: str
    bps: float                # max of receive and transmit, from port or hw counters
    ops_per_s: float = 0.0    # RDMA requests (read/write/atomic) per second, where counted
    saturated: bool = False   # a 32-bit counter stuck at its maximum: rate unknown

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


@dataclass(frozen=True)
class PortReading:
    """TCP connections on one training port (as local or remote port)."""

    port: int
    connections: int                  # ESTABLISHED, SYN_SENT or SYN_RECV
    bps: float | None = None          # None: bytes not available (e.g. from /proc/net/tcp)
    peers: tuple[str, ...] = ()       # "addr:port" of the far ends, for the reason line


@dataclass(frozen=True)
class NcclReading:
    """A process that maps libnccl: a training job is present on this node."""

    pid: int
    comm: str


@dataclass(frozen=True)
class Readings:
    """Everything the detectors saw at ``at`` (the loop's clock, seconds)."""

    at: float
    links: tuple[LinkReading, ...] = ()
    rdma: tuple[RdmaReading, ...] = ()
    ports: tuple[PortReading, ...] = ()
    nccl: tuple[NcclReading, ...] = ()
    errors: tuple[str, ...] = field(default=())  # detectors that failed this tick, in words

    @property
    def training_connections(self) -> int:
        return sum(p.connections for p in self.ports)
