"""The shaping runtime the daemon and `wagent pull --policy` share: who holds the ceil, how a
reload reaches the loop, the periodic re-apply. The kernel side is a stand-in shaper here; the
real one runs in tests/integration/test_shaping.py and test_daemon_reload.py."""


from agent.policy.model import Backoff, Policy, Shaping
from agent.yielding.runtime import ShapingRuntime
from shaping.errors import ShapingError
from shaping.observed import LinkCounters
from shaping.plan import SetLinkUp
from shaping.shaper import ApplyReport
from tests.backoff_helpers import Bucket, Windows, set_netdev, tcp_line, write_tcp
from tests.waiting import wait_for

M = 10**6
G = 10**9


class FakeShaper:
    """What the runtime asks of shaping.shaper.Shaper, without a kernel."""

    made: list["FakeShaper"] = []

    def __init__(self, policy, sources, results=()):
        self.shaping, self.sources = policy.shaping, tuple(sources)
        self.live = None
        self.applied, self.set_calls, self.cleared, self.closed = [], [], False, False
        self.results = list(results)
        FakeShaper.made.append(self)

    @property
    def ceil(self):
        return self.live if self.live is not None else self.shaping.ceil

    def apply(self, ceil=None, quiet=False):
        if ceil is not None:
            self.live = ceil
        self.applied.append((ceil, quiet))
        r = self.results.pop(0) if self.results else ApplyReport()
        if isinstance(r, Exception):
            raise r
        return r

    def set_ceil(self, bps):
        self.set_calls.append(bps)
        self.live = bps

    def detector_links(self):
        return []           # no ingress tree a kernel holds: no fast path here

    def counters(self):
        return {"eth0": LinkCounters(0, 0)}

    def close(self):
        self.closed = True

    def clear(self):
        self.cleared = True


def shaped(tmp_path, **backoff):
    write_tcp(tmp_path, [], [])
    set_netdev(tmp_path, "eth0", 0, 0)
    return Policy(backoff=Backoff(tick=0.05, nccl_processes=False,
                                  roots=(("root", str(tmp_path)),), **backoff),
                  shaping=Shaping(enabled=True, interfaces=("eth0",), ceil=800 * M,
                                  link_rate=G),
                  state_dir=str(tmp_path / "state"))


def test_without_shaping_the_loop_drives_the_bucket(tmp_path):
    write_tcp(tmp_path, [], [])
    policy = Policy(backoff=Backoff(tick=0.1, roots=(("root", str(tmp_path)),)),
                    shaping=Shaping(ceil=800 * M))
    bucket = Bucket()
    rt = ShapingRuntime(policy, bucket, sockets=None).start()
    try:
        assert rt.loop is not None and rt.loop.controller.cap == 800 * M
        assert rt.loop.detectors.link is None                  # nothing to subtract: off
        assert rt.ceil is None
        assert wait_for(lambda: bucket.rates) and bucket.rates[0] == 800 * M
    finally:
        rt.stop()
    off = ShapingRuntime(Policy(backoff=Backoff(enabled=False)), bucket, sockets=None).start()
    assert off.loop is None


def test_the_pull_sockets_windows_follow_and_count_the_bytes(tmp_path):
    set_netdev(tmp_path, "eth0", 0, 0)
    write_tcp(tmp_path, [], [])
    policy = Policy(backoff=Backoff(tick=0.05, queue_budget=0.002, nccl_processes=False,
                                    roots=(("root", str(tmp_path)),)),
                    shaping=Shaping(interfaces=("eth0",), enabled=False, link_rate=G))
    windows = Windows()
    rt = ShapingRuntime(policy, Bucket(), sockets=windows).start()
    try:
        # No shaper: the pull sockets' own bytes tell our traffic from the link's.
        assert rt.loop.detectors.link is not None and windows.budget_s == 0.002
        assert windows.most == 120_000                  # 3% of the default 4 MB burst
        assert wait_for(lambda: windows.rates) and windows.rates[0] == G
    finally:
        rt.stop()
    ShapingRuntime(Policy(backoff=Backoff(enabled=False)), Bucket(), sockets=windows).start()
    assert windows.rates[-1] is None                # backoff off: windows left to the kernel


def test_the_ceil_is_the_shapers_and_a_reload_keeps_it_through_the_loops_update(tmp_path):
    FakeShaper.made.clear()
    policy = shaped(tmp_path, quiet=0.2)
    rt = ShapingRuntime(policy, Bucket(), sockets=None, make_shaper=FakeShaper).start()
    try:
        first = FakeShaper.made[0]
        assert first.applied == [(None, False)] and rt.ceil == 800 * M
        # Training on: the loop cuts the kernel's ceil; status reads it from the shaper.
        write_tcp(tmp_path, [tcp_line(0, "0200000A:D000", "0100000A:733C", 1)], [])
        assert wait_for(lambda: rt.loop.decision and rt.loop.decision.state == "backed_off")
        assert wait_for(lambda: rt.ceil == rt.loop.decision.rate_bps < 800 * M)
        low = rt.ceil
        loop = rt.loop
        new = shaped(tmp_path, floor=5 * M, quiet=0.2)
        rt.reconcile(new)
        second = FakeShaper.made[1]
        # The new tree goes in with the loop's ceil, not the policy's: no opening in between.
        assert second.applied == [(min(low, 800 * M), False)] and first.closed
        assert rt.loop is loop and loop.controller.floor == 5 * M   # retuned, not restarted
        assert loop.decision.state == "backed_off"
        # Training over: the loop's kernel sink ramps the new shaper up.
        write_tcp(tmp_path, [], [])
        assert wait_for(lambda: second.set_calls)
    finally:
        rt.stop()


def test_shaping_dropped_by_a_reload_is_cleared(tmp_path):
    FakeShaper.made.clear()
    policy = shaped(tmp_path)
    rt = ShapingRuntime(policy, Bucket(), sockets=None, make_shaper=FakeShaper).start()
    try:
        rt.reconcile(Policy(backoff=policy.backoff, state_dir=policy.state_dir))
        assert rt.shaper is None and rt.ceil is None
        assert FakeShaper.made[-1].cleared and FakeShaper.made[0].closed
    finally:
        rt.stop()


def test_periodic_reapply_repairs_with_the_live_ceil_and_reports_failures(tmp_path):
    results = [ApplyReport(), ApplyReport(actions=(SetLinkUp("wg-eth0"),), notes=("a note",)),
               ShapingError("no interface 'eth0' on this host")]
    policy = shaped(tmp_path, enabled=False)
    rt = ShapingRuntime(policy, Bucket(), sockets=None,
                        make_shaper=lambda p, s: FakeShaper(p, s, results)).start()
    rt.set_ceil(5 * M)
    rt.verify()                    # the scheduler's job runs it every VERIFY_EVERY
    assert rt.shaper.applied[-1] == (None, True) and rt.ceil == 5 * M
    assert rt.repairs == 1 and rt.notes == ("a note",)
    rt.verify()
    assert rt.error == "re-applying the caps failed: no interface 'eth0' on this host"
    rt.stop()
