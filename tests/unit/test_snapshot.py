"""How the application turns the shaper's counters into the status model (pure)."""

import threading
from types import SimpleNamespace

from agent.application import Application
from agent.policy.model import Shaping
from agent.snapshot import shaped_interfaces
from shaping.errors import ShapingError
from shaping.observed import ClassStats
from shaping.plan import SetLinkUp, build_plan
from shaping.shaper import ApplyReport


def test_counters_grouped_by_tree_with_the_live_ceil():
    plan = build_plan(Shaping(enabled=True, interfaces=("eth0",), pull_ports=(8080,),
                              serve_ports=(8080,)), ())
    stats = [
        ClassStats("wg-eth0", "5747:20", "distribution", 1000, 10, 1, 2, 0, 8000),
        ClassStats("wg-eth0", "5747:10", "default", 5000, 50, 0, 0, 0, 0),
        ClassStats("eth0", "5747:20", "distribution", 7, 1, 0, 0, 0, 0),
        ClassStats("other0", "5747:20", "distribution", 9, 9, 9, 9, 9, 9),   # not ours
    ]
    ingress, egress = shaped_interfaces(stats, plan, ceil_bps=10_000_000)
    assert (ingress.name, ingress.direction, ingress.device) == ("eth0", "ingress", "wg-eth0")
    assert (egress.name, egress.direction, egress.device) == ("eth0", "egress", "eth0")
    default, dist = ingress.classes
    assert dist.name == "distribution" and dist.bytes == 1000 and dist.drops == 1
    assert dist.ceil_bps == 10_000_000 and dist.rate_bps == 10_000_000 and dist.est_bps == 8000
    assert default.ceil_bps == 1_000_000_000
    assert [c.bytes for c in egress.classes] == [7]


class FlakyShaper:
    """A shaper whose kernel lost the tree once, then refuses (the interface gone)."""

    def __init__(self):
        self.calls = []
        self.results = [("changed",), ShapingError("no interface 'eth0' on this host")]

    def apply(self, ceil=None, quiet=False):
        self.calls.append((ceil, quiet))
        r = self.results.pop(0)
        if isinstance(r, Exception):
            raise r
        return ApplyReport(actions=(SetLinkUp("wg-eth0"),), notes=("a note",))


def test_periodic_reapply_repairs_with_the_live_ceil_and_reports_failures():
    shaper = FlakyShaper()
    parts = SimpleNamespace(shaper=shaper, lock=threading.Lock(), ceil_bps=5_000_000,
                            shaping_error=None, shaping_repairs=0, shaping_notes=())
    app = Application("/p.yaml")
    app._verify_shaping(parts)           # the scheduler's job runs it every VERIFY_EVERY
    assert shaper.calls == [(5_000_000, True)]
    assert parts.shaping_repairs == 1 and parts.shaping_notes == ("a note",)
    app._verify_shaping(parts)
    assert parts.shaping_error == "re-applying the caps failed: no interface 'eth0' on this host"
