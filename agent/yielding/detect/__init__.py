"""Detectors of training traffic, sampled every tick by ``agent.yielding.backoff.BackoffLoop``.

Each one reads kernel counters under a root directory ("/" on a node, a fixture tree in tests)
and reports rates between two ticks (``agent.yielding.detect.readings``):

- ``link``: what arrived or left that is not distribution traffic (other traffic, any port);
- ``rdma``: InfiniBand/RoCE port counters (NCCL over RDMA bypasses tc);
- ``ports``: TCP connections on training ports (present at once, before their bytes);
- ``nccl``: processes that map libnccl (a training job is here).

The link and RDMA detectors read a few counters and run every tick; the ports and NCCL ones
cost far more (a sock_diag dump walks the kernel's whole TCP hash, the NCCL scan every process's
maps) and are paced by their measured CPU cost (``agent.yielding.detect.pacing``): early hints,
not the signal that must act within the tick.

``Detectors`` bundles them; one that fails in a tick is reported in ``Readings.errors`` and the
others still count.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.policy.model import Backoff
from agent.yielding.detect.link import Distribution, LinkDetector
from agent.yielding.detect.nccl import NcclDetector
from agent.yielding.detect.pacing import Paced, Pacer
from agent.yielding.detect.ports import PortsDetector
from agent.yielding.detect.rdma import RdmaDetector
from agent.yielding.detect.readings import (
    LinkReading,
    NcclReading,
    PortReading,
    RdmaReading,
    Readings,
)

__all__ = [
    "Detectors", "LinkDetector", "LinkReading", "NcclDetector", "NcclReading", "PortReading",
    "PortsDetector", "RdmaDetector", "RdmaReading", "Readings",
]

# Seconds the link's rates are averaged over: 0, the last tick. A flow is judged in the tick it
# starts; the controller's quiet period, not an average, keeps a backoff through short gaps.
LINK_AVERAGE = 0.0
# Shares of one core the paced detectors may take, and how stale their readings may get. A
# training job maps libnccl when it starts, seconds before its first byte.
PORTS_SHARE, PORTS_MOST = 0.001, 3.0
NCCL_SHARE, NCCL_LEAST, NCCL_MOST = 0.001, 5.0, 60.0


class Detectors:
    def __init__(self, link: LinkDetector | None = None, rdma: RdmaDetector | None = None,
                 ports: PortsDetector | None = None, nccl: NcclDetector | None = None,
                 tick: float | None = None) -> None:
        """``tick``: pace the ports and NCCL detectors by their CPU cost, never more often than
        this; None runs them every sample (tests driving the detectors by hand)."""
        self.link, self.rdma, self.ports, self.nccl = link, rdma, ports, nccl
        self.ports_paced = self.nccl_paced = None
        if tick is not None and ports is not None:
            self.ports_paced = Paced(ports.sample,
                                     Pacer(PORTS_SHARE, tick, max(tick, PORTS_MOST)),
                                     between=ports.refresh)
        if tick is not None and nccl is not None:
            self.nccl_paced = Paced(nccl.sample, Pacer(NCCL_SHARE, max(tick, NCCL_LEAST),
                                                       NCCL_MOST))

    @classmethod
    def from_policy(cls, backoff: Backoff, interfaces: Sequence[str] = (),
                    link: bool = True) -> Detectors:
        """The detectors a policy's ``backoff`` section asks for.

        ``backoff.roots`` may name ``root`` (a tree holding proc/ and sys/), or ``proc`` and
        ``sys`` directories (whose parents are then taken as the roots).
        """
        proc_root, sys_root = roots_from(backoff.roots)
        return cls(
            link=LinkDetector(sys_root, interfaces, average_over=LINK_AVERAGE) if link else None,
            rdma=RdmaDetector(sys_root),
            ports=PortsDetector(backoff.training_ports, proc_root)
            if backoff.training_ports else None,
            nccl=NcclDetector(proc_root, every=0.0) if backoff.nccl_processes else None,
            tick=backoff.tick,
        )

    def sample(self, now: float, distribution: Distribution | None = None) -> Readings:
        errors: list[str] = []

        def run(name: str, fn, *args):  # noqa: ANN001
            try:
                return fn(*args)
            except Exception as e:  # a detector bug must not stop the backoff loop
                errors.append(f"{name} detector: {e}")
                return ()

        return Readings(
            at=now,
            links=run("link", self.link.sample, now, distribution) if self.link else (),
            rdma=run("rdma", self.rdma.sample, now) if self.rdma else (),
            ports=run("ports", self.ports_paced or self.ports.sample, now) if self.ports else (),
            nccl=run("nccl", self.nccl_paced or self.nccl.sample, now) if self.nccl else (),
            errors=tuple(errors),
        )


def roots_from(roots: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    given = dict(roots)
    base = Path(given.get("root", "/"))
    proc_root = Path(given["proc"]).parent if "proc" in given else base
    sys_root = Path(given["sys"]).parent if "sys" in given else base
    return proc_root, sys_root
