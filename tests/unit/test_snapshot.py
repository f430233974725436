"""How the application turns the shaper's counters into the status model (pure)."""

from agent.policy.model import Shaping
from agent.snapshot import shaped_interfaces
from shaping.observed import ClassStats
from shaping.plan import build_plan


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
    assert dist.ceil_bps == 10_000_000 and dist.rate_bps == 10_000_000 and dist.est_bps == 8000
    assert default.ceil_bps == 1_000_000_000
    assert [c.bytes for c in egress.classes] == [7]
