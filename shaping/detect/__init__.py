"""Detectors of training traffic, sampled every tick by ``shaping.backoff.BackoffLoop``.

Each one reads kernel counters under a root directory ("/" on a node, a fixture tree in tests)
and reports rates between two ticks (``shaping.detect.readings``):

- ``link``: interface bytes minus the distribution class's bytes (other traffic);
- ``rdma``: InfiniBand/RoCE port counters (NCCL over RDMA bypasses tc);
- ``ports``: TCP connections on training ports (present at once, before their bytes);
- ``nccl``: processes that map libnccl (a training job is here).

``Detectors`` bundles them; one that fails in a tick is reported in ``Readings.errors`` and the
others still count.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.policy_model import Backoff
from shaping.detect.link import Distribution, LinkDetector
from shaping.detect.nccl import NcclDetector
from shaping.detect.ports import PortsDetector
from shaping.detect.rdma import RdmaDetector
from shaping.detect.readings import (
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

LINK_WINDOW = 1.0  # seconds the link's rates are averaged over (at least one tick)


class Detectors:
    def __init__(self, link: LinkDetector | None = None, rdma: RdmaDetector | None = None,
                 ports: PortsDetector | None = None, nccl: NcclDetector | None = None) -> None:
        self.link, self.rdma, self.ports, self.nccl = link, rdma, ports, nccl

    @classmethod
    def from_policy(cls, backoff: Backoff, interfaces: Sequence[str] = (),
                    link: bool = True) -> Detectors:
        """The detectors a policy's ``backoff`` section asks for.

        ``backoff.roots`` may name ``root`` (a tree holding proc/ and sys/), or ``proc`` and
        ``sys`` directories (whose parents are then taken as the roots).
        """
        proc_root, sys_root = roots_from(backoff.roots)
        return cls(
            link=LinkDetector(sys_root, interfaces, window=LINK_WINDOW) if link else None,
            rdma=RdmaDetector(sys_root),
            ports=PortsDetector(backoff.training_ports, proc_root)
            if backoff.training_ports else None,
            # A few times slower than the tick, never more often than twice a second.
            nccl=NcclDetector(proc_root, every=max(5 * backoff.tick, 0.5))
            if backoff.nccl_processes else None,
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
            ports=run("ports", self.ports.sample, now) if self.ports else (),
            nccl=run("nccl", self.nccl.sample, now) if self.nccl else (),
            errors=tuple(errors),
        )


def roots_from(roots: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    given = dict(roots)
    base = Path(given.get("root", "/"))
    proc_root = Path(given["proc"]).parent if "proc" in given else base
    sys_root = Path(given["sys"]).parent if "sys" in given else base
    return proc_root, sys_root
