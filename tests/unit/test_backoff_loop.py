import threading

from agent.policy.model import Backoff, Policy, Shaping
from agent.yielding.backoff import BackoffLoop, Knob, cap_for
from agent.yielding.controller import Controller
from agent.yielding.detect import Detectors
from agent.yielding.detect.link import LinkDetector
from agent.yielding.detect.ports import ESTABLISHED, PortsDetector
from shaping.observed import LinkCounters
from tests.backoff_helpers import Bucket, Windows, set_netdev, tcp_line, write_tcp

M = 10**6
G = 10**9
POLICY = Backoff(tick=0.1, floor=10 * M, increase=300 * M, quiet=0.5, nccl_processes=False)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class Sink:
    def __init__(self, fail=0):
        self.calls = []
        self.fail = fail

    def __call__(self, bps):
        if self.fail:
            self.fail -= 1
            raise OSError("Operation not permitted")
        self.calls.append(bps)


def node(tmp_path):
    write_tcp(tmp_path, [], [])
    set_netdev(tmp_path, "eth0", 0, 0)
    return Detectors(link=LinkDetector(tmp_path, ("eth0",)),
                     ports=PortsDetector(POLICY.training_ports, tmp_path))


def training(tmp_path, on):
    lines = [tcp_line(0, "0200000A:D000", "0100000A:733C", ESTABLISHED)] if on else []
    write_tcp(tmp_path, lines, [])


def test_both_sides_get_the_same_rate_at_the_same_tick(tmp_path):
    clock, ceil, pull = Clock(), Sink(), Sink()
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), set_kernel_ceil=ceil,
                       set_pull_rate=pull, distribution=lambda: {"eth0": LinkCounters(0, 0)},
                       tick=0.1, clock=clock)
    assert loop.tick().rate_bps == G
    assert ceil.calls == pull.calls == [G]
    training(tmp_path, True)
    clock.t = 0.1
    d = loop.tick()
    assert d.state == "backed_off" and ceil.calls == pull.calls == [G, 10 * M]
    clock.t = 0.2
    loop.tick()
    assert ceil.calls == [G, 10 * M]                      # unchanged: not sent again
    assert loop.events == 1
    status = loop.status()
    assert status.training_connections == 1 and status.events == 1
    assert status.reason.startswith("a TCP connection on training port 29500 (10.0.0.1")
    assert status.events_by_signal == {"training_port": 1}


def test_failed_side_is_retried_and_the_other_still_moves(tmp_path):
    clock, ceil, pull = Clock(), Sink(fail=2), Sink()
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), set_kernel_ceil=ceil,
                       set_pull_rate=pull, clock=clock)
    loop.tick()
    assert pull.calls == [G] and ceil.calls == [] and loop.apply_errors == 1
    assert "setting kernel ceil to 1 Gbit/s: Operation not permitted" in loop.last_error
    clock.t = 1.0
    loop.tick()
    clock.t = 2.0
    loop.tick()
    assert ceil.calls == [G] and pull.calls == [G] and loop.apply_errors == 2


def test_other_traffic_on_the_link_counts_net_of_distribution(tmp_path):
    clock, pull = Clock(), Sink()
    dist = {"eth0": LinkCounters(0, 0)}
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), set_pull_rate=pull,
                       distribution=lambda: dist, clock=clock)
    loop.tick()
    # 1 s later: 120 MB in, all of it the distribution's: nothing else on the link.
    set_netdev(tmp_path, "eth0", 120 * M, 0)
    dist = {"eth0": LinkCounters(120 * M, 0)}
    clock.t = 1.0
    assert loop.tick().state == "full"
    set_netdev(tmp_path, "eth0", 240 * M, 0)
    dist = {"eth0": LinkCounters(140 * M, 0)}
    clock.t = 2.0
    d = loop.tick()
    assert d.state == "backed_off"
    assert d.reason == "other traffic 800 Mbit/s on eth0 (not wagent's, any port)"


def test_a_failing_detector_or_counter_does_not_stop_the_loop(tmp_path):
    class Broken:
        def sample(self, now):
            raise RuntimeError("boom")

    clock = Clock()
    dets = Detectors(rdma=Broken(), ports=PortsDetector(POLICY.training_ports, tmp_path))

    def no_stats():
        raise OSError("no such device")

    loop = BackoffLoop(Controller(POLICY, G), dets, distribution=no_stats, clock=clock)
    training(tmp_path, True)
    assert loop.tick().state == "backed_off"
    assert loop.readings.errors == ("rdma detector: boom",)


def test_run_keeps_a_tick_grid_and_stops(tmp_path):
    clock = Clock()
    seen = []

    def sleep(s):
        seen.append(round(clock.t, 3))
        clock.t += s + 0.01 if len(seen) == 2 else s   # one late wake-up
        if len(seen) == 6:
            loop.stop()

    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), tick=0.1, clock=clock,
                       sleep=sleep)
    loop.run()
    assert seen == [0.0, 0.1, 0.21, 0.3, 0.4, 0.5]
    assert loop.ticks == 6


def test_thread_start_stop_backs_off_and_ramps(tmp_path):
    ceil, pull = Sink(), Sink()
    loop = BackoffLoop(Controller(Backoff(tick=0.1, floor=10 * M, increase=500 * M, quiet=0.2,
                                          nccl_processes=False), G),
                       node(tmp_path), set_kernel_ceil=ceil, set_pull_rate=pull, tick=0.1)
    backed_off, full = threading.Event(), threading.Event()
    assert not loop.alive()
    loop.start()
    try:
        assert loop.alive()
        training(tmp_path, True)
        for _ in range(50):
            if loop.decision and loop.decision.state == "backed_off":
                backed_off.set()
                break
            threading.Event().wait(0.02)
        training(tmp_path, False)
        for _ in range(100):
            if loop.decision and loop.decision.state == "full" and pull.calls[-1] == G:
                full.set()
                break
            threading.Event().wait(0.02)
    finally:
        loop.stop()
    assert not loop.alive()
    assert backed_off.is_set() and full.is_set()
    assert 10 * M in pull.calls and ceil.calls == pull.calls


def test_windows_move_first_then_the_bucket_then_the_ceil(tmp_path):
    order = []
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path),
                       set_kernel_ceil=lambda b: order.append(("ceil", b)),
                       set_pull_rate=lambda b: order.append(("bucket", b)),
                       set_windows=lambda b: order.append(("windows", b)),
                       streams=Windows().sample, clock=Clock())
    loop.tick()
    assert order == [("windows", G), ("bucket", G), ("ceil", G)]
    status = loop.status()
    assert (status.pull_streams, status.pull_min_rtt_us, status.pull_window_bytes) == \
        (8, 40, 10_000)


def test_cap_for():
    p = Policy(shaping=Shaping(ceil=500 * M))
    assert cap_for(p) == 500 * M
    assert cap_for(p, rate=100 * M) == 100 * M
    assert cap_for(Policy(backoff=Backoff(cap=G), shaping=Shaping(ceil=500 * M))) == G


def test_bucket_moved_behind_the_loops_back_is_set_again(tmp_path):
    clock = Clock()
    bucket = Bucket()
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path),
                       set_pull_rate=Knob(bucket.set_rate, lambda: bucket.rate), clock=clock)
    loop.tick()
    bucket.set_rate(300 * M)          # e.g. a static --rate applied after the loop started
    clock.t = 0.1
    loop.tick()
    assert bucket.rates == [G, 300 * M, G] and bucket.rate == G


def test_update_keeps_the_state_and_takes_the_new_settings(tmp_path):
    clock = Clock()
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), clock=clock)
    training(tmp_path, True)
    assert loop.tick().state == "backed_off"
    new = Policy(backoff=Backoff(tick=0.5, floor=20 * M, cap=2 * G, quiet=0.5,
                                 training_ports=((29500, 29500),), nccl_processes=False,
                                 roots=(("root", str(tmp_path)),)))
    loop.update(new)
    assert loop.tick_s == 0.5 and loop.controller.cap == 2 * G
    clock.t = 0.5
    d = loop.tick()
    assert (d.state, d.rate_bps) == ("backed_off", 20 * M)


def test_detector_roots_from_the_policy(tmp_path):
    from pathlib import Path

    from agent.yielding.detect import roots_from

    assert roots_from(()) == (Path("/"), Path("/"))
    assert roots_from((("root", "/x"),)) == (Path("/x"), Path("/x"))
    assert roots_from((("proc", "/a/proc"), ("sys", "/b/sys"))) == (Path("/a"), Path("/b"))
    write_tcp(tmp_path, [tcp_line(0, "0200000A:D000", "0100000A:733C", ESTABLISHED)], [])
    dets = Detectors.from_policy(Backoff(roots=(("proc", str(tmp_path / "proc")),)))
    assert dets.ports.sample(0.0)[0].connections == 1


def test_the_account_says_what_yielding_left_unused(tmp_path):
    """Issue 23's figure in production: while held under its cap, the share of the capacity
    other traffic left free that the pull used; and the bursts the ticks saw."""
    clock = Clock()
    dist = {"eth0": LinkCounters(0, 0)}
    loop = BackoffLoop(Controller(POLICY, G, link_bps=G), node(tmp_path),
                       distribution=lambda: dist, clock=clock)
    link = pulled = 0

    def second(other, pull):
        nonlocal link, pulled
        link, pulled = link + other + pull, pulled + pull
        set_netdev(tmp_path, "eth0", link, 0)
        dist["eth0"] = LinkCounters(pulled, 0)
        clock.t += 1.0
        return loop.tick()

    loop.tick()
    assert second(0, 100 * M).state == "full"            # a pull alone: nothing yielded
    assert second(100 * M, 0).state == "backed_off"      # a burst: 800 Mbit/s
    assert second(0, M).state != "full"                  # the gap: 1 MB of 125 MB pulled
    assert second(100 * M, 0).state == "backed_off"      # the next burst, while ramping
    a = loop.status().account
    assert a.bursts == 2 and a.yielded_s == 2.0          # the two ticks held under the cap
    assert a.idle_bits == (1000 * M) + (1000 * M - 800 * M)
    assert a.pulled_bits == 8 * M
    assert a.idle_used == 8 * M / (1200 * M)


def test_time_yielded_counts_without_a_link_reading(tmp_path):
    """A node that knows training by its port alone still says how long it yielded; the idle
    capacity needs the link's counters, so its share stays unknown (None), not 0%."""
    clock = Clock()
    loop = BackoffLoop(Controller(POLICY, G), Detectors(ports=PortsDetector(
        POLICY.training_ports, tmp_path)), clock=clock)
    training(tmp_path, True)
    assert loop.tick().state == "backed_off"
    clock.t = 0.1
    loop.tick()
    a = loop.status().account
    assert a.yielded_s == 0.1 and a.idle_used is None and a.bursts == 0


def test_the_pull_sockets_hear_whether_training_is_on(tmp_path):
    clock, windows = Clock(), Windows()
    loop = BackoffLoop(Controller(POLICY, G), Detectors(ports=PortsDetector(
        POLICY.training_ports, tmp_path)), set_windows=windows.set_rate,
        training_present=windows.guard, clock=clock)
    training(tmp_path, False)
    loop.tick()
    training(tmp_path, True)
    clock.t = 0.1
    loop.tick()                                   # a connection on the training port
    training(tmp_path, False)
    for t in (0.2, 0.3):                          # backed off, quiet: still training
        clock.t = t
        loop.tick()
    clock.t = 5.0
    while loop.tick().state != "full":            # ramped back up: no training any more
        clock.t += 0.1
    assert windows.training == [False, True, False]    # told on change only


def test_a_waiting_reader_lifts_the_pull_above_other_traffic_but_not_above_training(tmp_path):
    """``mounts.read_floor``: while a reader of a mount waits (and ``READERS_GRACE`` after),
    the link's other traffic no longer holds the pull at the floor; identified training (a
    training port) still does, for ``quiet`` after it was last seen; the fast path's gate lets
    the lifted rate through."""
    clock, pull = Clock(), Sink()
    dist = {"eth0": LinkCounters(0, 0)}
    waiting = [False]
    loop = BackoffLoop(Controller(POLICY, G), node(tmp_path), set_pull_rate=pull,
                       distribution=lambda: dist, readers_waiting=lambda: waiting[0],
                       read_floor=500 * M, clock=clock)

    def tick(t):
        clock.t = t
        set_netdev(tmp_path, "eth0", int(100 * M * t), 0)   # 800 Mbit/s of someone else's
        return loop.tick()

    tick(0.0)
    d = tick(1.0)
    assert (d.state, d.rate_bps, d.lifted) == ("backed_off", 10 * M, False)
    assert loop.hold_floor == 10 * M
    waiting[0] = True
    d = tick(1.1)
    assert (d.state, d.rate_bps, d.lifted) == ("backed_off", 500 * M, True)
    assert d.reason.endswith("a reader of a mount waits: 500 Mbit/s (mounts.read_floor)")
    assert pull.calls[-1] == 500 * M and loop.hold_floor == 500 * M
    assert loop.status().rate_bps == 500 * M
    waiting[0] = False
    assert tick(1.2).rate_bps == 500 * M            # between two reads: still lifted
    assert tick(2.1).rate_bps == 10 * M and pull.calls[-1] == 10 * M   # READERS_GRACE on
    # a training connection: the reader waits at the floor, and for ``quiet`` after it went
    waiting[0] = True
    training(tmp_path, True)
    d = tick(2.2)
    assert (d.rate_bps, d.identified, d.lifted) == (10 * M, True, False)
    training(tmp_path, False)
    assert tick(2.4).rate_bps == 10 * M
    assert tick(2.8).lifted                         # quiet (0.5 s) after the last connection


def test_read_floor_is_a_share_of_the_link_and_null_turns_it_off():
    from agent.policy.model import Mounts
    from agent.yielding.backoff import read_floor_for
    assert read_floor_for(Policy(shaping=Shaping(link_rate=10 * G))) == 5 * G
    assert read_floor_for(Policy(mounts=Mounts(read_floor=None))) == 0
