import pytest

from agent.policy.model import Backoff
from agent.yielding.controller import BACKED_OFF, FULL, RAMPING, Controller, assess
from agent.yielding.detect.readings import (
    LinkReading,
    NcclReading,
    PortReading,
    RdmaReading,
    Readings,
)

M = 10**6
G = 10**9
POLICY = Backoff(floor=10 * M, increase=200 * M, quiet=3.0, link_threshold=50 * M,
                 rdma_threshold=M)


def quiet(t, other=0.0):
    return Readings(at=t, links=(LinkReading("eth0", other, other, 0.0, 0.0),))


def port(t, bps=None, other=0.0):
    return Readings(at=t, ports=(PortReading(29500, 1, bps, ("10.0.0.1:29500",)),),
                    links=(LinkReading("eth0", other, other, 0.0, 0.0),))


def run(c, readings_at):
    return [c.step(r, r.at) for r in readings_at]


def test_connection_alone_cuts_to_floor_at_once():
    c = Controller(POLICY, cap_bps=G)
    assert c.step(quiet(0.0), 0.0).rate_bps == G
    d = c.step(port(1.0), 1.0)      # no bytes yet: a starved flow carries little
    assert (d.rate_bps, d.state, d.changed, d.since) == (10 * M, BACKED_OFF, True, 1.0)
    assert d.reason == "a TCP connection on training port 29500 (10.0.0.1:29500)"
    assert d.signals == ("training_port",)
    assert c.events == 1 and c.events_by_signal == {"training_port": 1}


@pytest.mark.parametrize(("readings", "reason"), [
    (Readings(at=1.0, ports=(PortReading(29500, 1, 830e6, ()),)),
     "training traffic 830 Mbit/s on port 29500"),
    (port(1.0, other=830e6),
     "a TCP connection on training port 29500 (10.0.0.1:29500; other traffic 830 Mbit/s on "
     "eth0 (not wagent's, any port))"),
    (Readings(at=1.0, rdma=(RdmaReading("mlx5_0", "1", 12e9),)),
     "RDMA traffic 12 Gbit/s on mlx5_0/1"),
    (Readings(at=1.0, rdma=(RdmaReading("mlx5_0", "1", 0.0, ops_per_s=5000.0),)),
     "RDMA 5000 requests/s on mlx5_0/1"),
    (Readings(at=1.0, nccl=(NcclReading(4242, "python"),)), "NCCL process 4242 (python)"),
    (quiet(1.0, other=600e6), "other traffic 600 Mbit/s on eth0 (not wagent's, any port)"),
])
def test_each_detector_triggers_with_its_reason(readings, reason):
    c = Controller(POLICY, cap_bps=G)
    d = c.step(readings, 1.0)
    assert d.state == BACKED_OFF and d.rate_bps == 10 * M
    assert d.reason == reason


def test_several_causes_are_summed_up():
    r = Readings(at=0.0, nccl=(NcclReading(1, "a"), NcclReading(2, "b"), NcclReading(3, "c")))
    assert assess(r, POLICY).reason == "NCCL process 1 (a); NCCL process 2 (b) (+1 more)"


def test_nccl_can_be_turned_off():
    r = Readings(at=0.0, nccl=(NcclReading(1, "python"),))
    assert assess(r, Backoff(nccl_processes=False)).level == "quiet"


def test_quiet_period_then_additive_increase_to_cap():
    c = Controller(POLICY, cap_bps=G)
    c.step(port(0.0), 0.0)
    ds = run(c, [quiet(t) for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)])
    assert [d.rate_bps for d in ds] == [10 * M, 10 * M, 210 * M, 410 * M, 610 * M, 810 * M,
                                        G, G]
    assert [d.state for d in ds] == [BACKED_OFF] * 2 + [RAMPING] * 4 + [FULL] * 2
    assert [d.changed for d in ds] == [False, False] + [True] * 5 + [False]
    assert ds[2].reason == "quiet for 3.0s: ramping up by 200 Mbit/s per tick"
    assert ds[-1].reason == "no training traffic" and ds[-1].since == 7.0
    assert "was: a TCP connection on training port 29500" in ds[0].reason


def test_training_during_ramp_cuts_again():
    c = Controller(POLICY, cap_bps=G)
    run(c, [port(0.0), quiet(3.0), quiet(4.0)])
    assert c.step(quiet(4.5), 4.5).state == RAMPING
    d = c.step(port(5.0, other=900e6), 5.0)
    assert (d.rate_bps, d.state) == (10 * M, BACKED_OFF)
    assert c.events == 2
    # The quiet period starts again from the last training tick.
    assert c.step(quiet(7.0), 7.0).state == BACKED_OFF
    assert c.step(quiet(8.0), 8.0).state == RAMPING


def test_hysteresis_band_neither_triggers_nor_counts_as_quiet():
    c = Controller(POLICY, cap_bps=G)
    # 30 Mbit/s of other traffic: below the 50 Mbit/s trigger, above the 25 Mbit/s quiet line.
    assert c.step(quiet(0.0, other=30e6), 0.0).state == FULL
    c.step(quiet(1.0, other=60e6), 1.0)
    ds = run(c, [quiet(float(t), other=30e6) for t in range(2, 10)])
    assert all(d.state == BACKED_OFF and d.rate_bps == 10 * M for d in ds)
    assert ds[-1].reason == "holding: other traffic 30 Mbit/s on eth0 (not wagent's, any port)"
    ds = run(c, [quiet(float(t), other=20e6) for t in range(10, 14)])
    assert [d.state for d in ds] == [BACKED_OFF, BACKED_OFF, RAMPING, RAMPING]
    # Once ramping, the band pauses the climb without cutting.
    d = c.step(quiet(14.0, other=40e6), 14.0)
    assert (d.state, d.rate_bps, d.changed) == (RAMPING, 410 * M, False)


def test_flapping_traffic_stays_backed_off():
    # Bursty RDMA (an all-reduce every 2 s) never lets the quiet period run out.
    c = Controller(POLICY, cap_bps=G)
    states = []
    for t in range(20):
        bps = 5e9 if t % 2 == 0 else 0.0
        r = Readings(at=float(t), rdma=(RdmaReading("mlx5_0", "1", bps),))
        states.append(c.step(r, float(t)).state)
    assert set(states) == {BACKED_OFF}
    assert c.events == 1


def test_multiplicative_decrease_each_tick_down_to_floor():
    c = Controller(Backoff(floor=10 * M, decrease=0.5), cap_bps=G)
    rates = [c.step(port(float(t)), float(t)).rate_bps for t in range(9)]
    assert rates == [500 * M, 250 * M, 125 * M, 62_500_000, 31_250_000, 15_625_000, 10 * M,
                     10 * M, 10 * M]


def test_minimum_hold_outlasts_a_short_quiet_period():
    c = Controller(Backoff(quiet=0.5, increase=100 * M), cap_bps=G, min_hold=3.0)
    c.step(port(0.0), 0.0)
    assert [c.step(quiet(t), t).state for t in (1.0, 2.0, 3.0)] == [BACKED_OFF, BACKED_OFF,
                                                                     RAMPING]


def test_floor_never_above_cap_and_cap_changes():
    c = Controller(Backoff(floor=50 * M), cap_bps=20 * M)
    assert c.step(port(0.0), 0.0).rate_bps == 20 * M
    c = Controller(POLICY, cap_bps=G)
    c.step(quiet(0.0), 0.0)
    c.set_cap(500 * M)
    assert c.step(quiet(1.0), 1.0).rate_bps == 500 * M


def test_disabled_backoff_stays_full():
    c = Controller(Backoff(enabled=False), cap_bps=G)
    d = c.step(port(0.0, other=900e6), 0.0)
    assert (d.rate_bps, d.state, d.reason) == (G, FULL, "backoff disabled")


def test_sub_second_ticks():
    b = Backoff(tick=0.1, floor=10 * M, quiet=1.0, increase=250 * M)
    c = Controller(b, cap_bps=G)
    c.step(quiet(0.0), 0.0)
    assert c.step(port(0.1), 0.1).state == BACKED_OFF
    ts = [round(0.2 + 0.1 * i, 1) for i in range(14)]
    rates = [c.step(quiet(t), t).rate_bps for t in ts]
    assert rates[:9] == [10 * M] * 9            # until 1.0 s after the last training tick
    assert rates[9:] == [260 * M, 510 * M, 760 * M, G, G]


def test_shares_of_the_link_are_resolved_against_it():
    # The shipped defaults: floor 0.2%, threshold 5%, increase 10% of the link.
    c = Controller(Backoff(nccl_processes=False), cap_bps=25 * G, link_bps=25 * G)
    assert (c.floor, c.backoff.link_threshold, c.backoff.increase) == (50 * M, 1250 * M,
                                                                        2500 * M)
    assert c.step(quiet(0.0, other=1000 * M), 0.0).state == FULL       # 4% of the link: band
    d = c.step(quiet(0.1, other=1300 * M), 0.1)
    assert d.state == BACKED_OFF and d.rate_bps == 50 * M
    assert d.reason.endswith("(not wagent's, any port, 5% of the link)")


def test_events_are_counted_by_signal_kind():
    c = Controller(POLICY, cap_bps=G)
    c.step(Readings(at=0.0, nccl=(NcclReading(1, "python"),),
                    links=(LinkReading("eth0", 600e6, 600e6, 0.0, 0.0),)), 0.0)
    c.step(quiet(0.1, other=600e6), 0.1)              # still backed off: not a new event
    for t in (3.5, 4.0, 4.5, 5.0, 5.5, 6.0):           # quiet, ramp to the cap
        c.step(quiet(t), t)
    d = c.step(port(7.0), 7.0)
    assert d.signals == ("training_port",)
    assert c.events == 2
    assert c.events_by_signal == {"nccl": 1, "link": 1, "training_port": 1}
