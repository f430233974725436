"""How the application turns its running parts into the status model: the shaper's counters
and the backoff loop's status (pure), and the tick's summary, which leaves the kernel and the
store alone."""

import time

from agent.application import mounts_for, worker_deps
from agent.identity import Identity
from agent.parts import Parts
from agent.peers.service import PeerService
from agent.policy.model import Backoff, Model, Policy, Shaping, StoreSettings
from agent.pull.connections import Connections
from agent.pull.demand import Demand
from agent.pull.node_pulls import NodePulls
from agent.pull.worker import Worker
from agent.scheduler import Scheduler
from agent.snapshot import readings, shaped_interfaces, snapshot, tick_summary
from agent.status import DaemonState, TickSummary
from agent.store import Store
from agent.yielding.backoff import BackoffStatus
from agent.yielding.ratelimit import TokenBucket
from agent.yielding.runtime import ShapingRuntime
from shaping.observed import ClassStats, LinkCounters
from shaping.plan import build_plan
from shaping.shaper import ApplyReport
from tests.backoff_helpers import set_netdev, write_tcp
from tests.waiting import wait_for

M = 10**6
G = 10**9


def test_counters_grouped_by_tree_with_the_live_ceil():
    # The plan as Shaper.plan() gives it: the backoff loop's ceil (10 Mbit/s) in place.
    plan = build_plan(Shaping(enabled=True, interfaces=("eth0",), pull_ports=(8080,),
                              serve_ports=(8080,), ceil=10_000_000), ())
    stats = [
        ClassStats("wg-eth0", "5747:20", "distribution", 1000, 10, 1, 2, 0, 8000),
        ClassStats("wg-eth0", "5747:10", "default", 5000, 50, 0, 0, 0, 0),
        ClassStats("eth0", "5747:20", "distribution", 7, 1, 0, 0, 0, 0),
        ClassStats("other0", "5747:20", "distribution", 9, 9, 9, 9, 9, 9),   # not ours
    ]
    ingress, egress = shaped_interfaces(stats, plan)
    assert (ingress.name, ingress.direction, ingress.device) == ("eth0", "ingress", "wg-eth0")
    assert (egress.name, egress.direction, egress.device) == ("eth0", "egress", "eth0")
    default, dist = ingress.classes
    assert dist.name == "distribution" and dist.bytes == 1000 and dist.drops == 1
    # the default guaranteed rate: 0.2% of the 1 Gbit/s link
    assert dist.ceil_bps == 10_000_000 and dist.rate_bps == 2_000_000 and dist.est_bps == 8000
    assert default.ceil_bps == 1_000_000_000
    assert [c.bytes for c in egress.classes] == [7]


def test_readings_keep_the_documents_names_and_leave_out_what_was_not_read():
    st = BackoffStatus(state="full", rate_bps=G, reason="quiet", since=None, events=0,
                       events_by_signal={}, ticks=1, cap_bps=G, floor_bps=10**7,
                       apply_errors=0, last_error=None, training_connections=1,
                       other_bps=5e8, pull_streams=8, pull_min_rtt_us=40,
                       pull_window_bytes=10_000)
    assert readings(st) == {"other_bps": 5e8, "rdma_bps": 0.0, "training_connections": 1.0,
                            "nccl_processes": 0.0, "pull_streams": 8.0,
                            "pull_min_rtt_us": 40.0, "pull_window_bytes": 10_000.0}


# -- what the daemon's tick reads against what `wagent status` reads -------------------------
class CountingShaper:
    """The shaping runtime's kernel side without a kernel; counts the tc dumps asked of it."""

    def __init__(self, policy, sources):
        self.shaping, self.sources = policy.shaping, tuple(sources)
        self.dumps = 0
        MADE.append(self)

    ceil = property(lambda self: self.shaping.ceil)

    def apply(self, ceil=None, quiet=False):
        return ApplyReport()

    def stats(self):
        self.dumps += 1
        return []

    def plan(self):
        return build_plan(self.shaping, self.sources)

    def detector_links(self):
        return []

    def counters(self):
        return {"eth0": LinkCounters(0, 0)}

    def set_ceil(self, bps):
        pass

    def close(self):
        pass


MADE: list[CountingShaper] = []


class ScanningStore(Store):
    """A real store that counts the walks of its tree."""

    scans = 0

    def model_names(self):
        self.scans += 1
        return super().model_names()

    def usage(self):
        self.scans += 1
        return super().usage()


def test_the_summary_reads_memory_where_the_snapshot_dumps_tc_and_walks_the_store(tmp_path):
    write_tcp(tmp_path, [], [])
    set_netdev(tmp_path, "eth0", 0, 0)
    policy = Policy(backoff=Backoff(tick=0.05, nccl_processes=False,
                                    roots=(("root", str(tmp_path)),)),
                    shaping=Shaping(enabled=True, interfaces=("eth0",), ceil=800 * M,
                                    link_rate=G),
                    models=(Model("m"),), store=StoreSettings(path=str(tmp_path / "store")),
                    state_dir=str(tmp_path / "state"))
    store = ScanningStore(policy.store.path)
    store.ensure()
    bucket = TokenBucket(None)
    connections = Connections()
    pulls = NodePulls(policy, Identity("node-a", "host-a", "gpu", "test"), store, bucket,
                      clock=time.time, pulling=lambda: 0, connections=connections)
    worker = Worker(policy, worker_deps(pulls))
    shaping = ShapingRuntime(policy, bucket, sockets=connections.sockets,
                             make_shaper=CountingShaper)
    demand = Demand(time.monotonic)
    mounts = mounts_for(lambda: policy, lambda: store, pulls, worker, demand,
                        time.time, time.monotonic)
    parts = Parts(policy=policy, identity=pulls.identity, store=store, bucket=bucket,
                  pulls=pulls, worker=worker, scheduler=Scheduler(), shaping=shaping,
                  mounts=mounts, peers=PeerService(policy, lambda: store, demand, None))
    shaping.start()
    try:
        (shaper,) = MADE[-1:]
        assert wait_for(lambda: shaping.loop.ticks > 0)
        s = tick_summary(parts, TickSummary(workers={"backoff": True}))
        assert (shaper.dumps, store.scans) == (0, 0)
        assert s.workers == {"backoff": True} and s.backoff_state == "full"
        assert [(p.model, p.state) for p in s.pulls] == [("m", "idle")]
        # the control: the whole state does dump the classes and walk the store
        state = snapshot(parts, DaemonState(pid=1, started_at=0.0, version="x"), time.time,
                         time.monotonic)
        assert shaper.dumps == 1 and store.scans >= 2
        assert state.backoff.state == s.backoff_state and state.pulls == s.pulls
    finally:
        shaping.stop()
