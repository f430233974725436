"""What the daemon runs for one policy, as :class:`agent.application.Application` built it;
read by ``agent.snapshot`` for status. Each piece of state has one owner among these parts:
the kernel's ceil and the backoff loop are the shaping runtime's, the models' pulls the
worker's, the timed jobs the scheduler's. Every part exists when ``Parts`` is built."""

from __future__ import annotations

from dataclasses import dataclass

from agent.control import ControlServer
from agent.identity import Identity
from agent.metrics import Metrics
from agent.mount.service import Mounts
from agent.peers.service import PeerService
from agent.policy.model import Policy
from agent.pull.node_pulls import NodePulls
from agent.pull.worker import Worker
from agent.scheduler import Scheduler
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket
from agent.yielding.runtime import ShapingRuntime


@dataclass
class Parts:
    """Mutable: reconcile updates it in place, and hands the new policy, identity and store to
    ``pulls`` (the worker's functions) and the new policy to ``worker``."""

    policy: Policy
    identity: Identity
    store: Store
    bucket: TokenBucket
    pulls: NodePulls
    worker: Worker
    scheduler: Scheduler
    shaping: ShapingRuntime
    mounts: Mounts
    peers: PeerService
    control: ControlServer | None = None
    metrics: Metrics | None = None
    metrics_error: str | None = None
    metrics_failures: int = 0            # metrics updates that failed (a new reason each)
