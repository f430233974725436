import pytest

from agent.yielding.detect.counters import WRAP32, WRAP64, CounterRates, counter_delta
from agent.yielding.detect.link import LinkDetector
from shaping.observed import LinkCounters
from tests.backoff_helpers import remove_netdev, set_netdev

MB = 10**6


def test_other_traffic_is_link_minus_distribution(tmp_path):
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    assert det.sample(0.0, {"eth0": LinkCounters(0, 0)}) == ()          # baseline
    # 1 s: 100 MB in, 60 MB of it distribution; 5 MB out.
    set_netdev(tmp_path, "eth0", rx=100 * MB, tx=5 * MB)
    (r,) = det.sample(1.0, {"eth0": LinkCounters(60 * MB, 0)})
    assert r.ifname == "eth0"
    assert r.rx_bps == 800e6 and r.tx_bps == 40e6
    assert r.other_bps == pytest.approx(320e6)
    assert r.distribution_bps == pytest.approx(480e6)


def test_pull_acks_are_not_other_traffic(tmp_path):
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    # A pull at 940 Mbit/s, nothing else: its ACKs (about 2.3%) leave unshaped.
    set_netdev(tmp_path, "eth0", rx=117_500_000, tx=2_700_000)
    (r,) = det.sample(1.0, {"eth0": LinkCounters(117_500_000, 0)})
    assert r.other_bps == 0.0


def test_no_distribution_counter_means_no_reading(tmp_path):
    # Without the distribution's bytes our own pull would look like other traffic.
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path)
    det.sample(0.0)
    set_netdev(tmp_path, "eth0", rx=10 * MB, tx=0)
    assert det.sample(1.0) == ()
    det_all = LinkDetector(tmp_path, count_all=True)
    det_all.sample(0.0)
    set_netdev(tmp_path, "eth0", rx=20 * MB, tx=0)
    (r,) = det_all.sample(1.0)
    assert r.other_bps == 80e6 and r.distribution_bps is None


def test_interfaces_default_to_all_but_loopback_and_ifb(tmp_path):
    for name in ("lo", "eth0", "ifb0", "wg-eth0", "eth1"):
        set_netdev(tmp_path, name, 0, 0)
    assert LinkDetector(tmp_path).interfaces() == ("eth0", "eth1")
    assert LinkDetector(tmp_path, interfaces=("eth1",)).interfaces() == ("eth1",)
    assert LinkDetector(tmp_path / "nothing").interfaces() == ()


def test_32_bit_counter_wrap(tmp_path):
    set_netdev(tmp_path, "eth0", rx=WRAP32 - 10 * MB, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=15 * MB, tx=0)          # wrapped past 2^32
    (r,) = det.sample(1.0, {"eth0": LinkCounters(5 * MB, 0)})
    assert r.rx_bps == 25 * MB * 8
    assert r.other_bps == 20 * MB * 8


def test_64_bit_counter_wrap(tmp_path):
    set_netdev(tmp_path, "eth0", rx=WRAP64 - MB, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=MB, tx=0)
    (r,) = det.sample(1.0, {"eth0": LinkCounters(0, 0)})
    assert r.other_bps == 2 * MB * 8


def test_device_vanishes_and_reappears(tmp_path):
    set_netdev(tmp_path, "eth0", rx=50 * MB, tx=0, ifindex=2)
    set_netdev(tmp_path, "eth1", rx=0, tx=0, ifindex=3)
    det = LinkDetector(tmp_path, ack_share=0.0)
    dist = {"eth0": LinkCounters(0, 0), "eth1": LinkCounters(0, 0)}
    det.sample(0.0, dist)
    remove_netdev(tmp_path, "eth0")
    set_netdev(tmp_path, "eth1", rx=MB, tx=0, ifindex=3)
    assert [r.ifname for r in det.sample(1.0, dist)] == ["eth1"]
    # Re-created with counters from zero and a new ifindex: a baseline, not a wrap or a rate.
    set_netdev(tmp_path, "eth0", rx=10, tx=0, ifindex=7)
    assert [r.ifname for r in det.sample(2.0, dist)] == ["eth1"]
    set_netdev(tmp_path, "eth0", rx=10 + MB, tx=0, ifindex=7)
    readings = {r.ifname: r for r in det.sample(3.0, dist)}
    assert readings["eth0"].other_bps == 8 * MB


def test_same_ifindex_reset_is_not_taken_for_a_wrap(tmp_path):
    set_netdev(tmp_path, "eth0", rx=5 * 10**12, tx=0)       # 64-bit, far from a wrap
    det = LinkDetector(tmp_path)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=100, tx=0)
    assert det.sample(1.0, {"eth0": LinkCounters(0, 0)}) == ()


def test_distribution_counter_reset_skips_one_tick(tmp_path):
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    det.sample(0.0, {"eth0": LinkCounters(5 * 10**12, 0)})
    set_netdev(tmp_path, "eth0", rx=MB, tx=0)
    assert det.sample(1.0, {"eth0": LinkCounters(0, 0)}) == ()  # class re-created: no false alarm
    set_netdev(tmp_path, "eth0", rx=2 * MB, tx=0)
    (r,) = det.sample(2.0, {"eth0": LinkCounters(MB, 0)})
    assert r.other_bps == 0.0


def test_counter_delta_and_rates():
    assert counter_delta(10, 30, 100) == 20
    assert counter_delta(WRAP32 - 5, 5, 100) == 10
    assert counter_delta(WRAP64 - 5, 5, 100) == 10
    assert counter_delta(1000, 5, 100) is None               # a reset
    c = CounterRates()
    assert c.rate("k", 1, 0, 0.0) is None
    assert c.rate("k", 1, 100, 0.0) is None                  # no time passed
    assert c.rate("k", 1, 300, 2.0) == 100.0


def test_rates_are_averaged_over_the_window(tmp_path):
    set_netdev(tmp_path, "eth0", 0, 0)
    det = LinkDetector(tmp_path, ack_share=0.0, average_over=0.5)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    rx = dist = 0
    others = []
    for i in range(1, 11):
        rx += 12_500_000                       # 1 Gbit/s over a 100 ms tick
        dist += 12_500_000 if i != 3 else 10_000_000   # one tick's reads 20 ms apart
        set_netdev(tmp_path, "eth0", rx, 0)
        (r,) = det.sample(i / 10, {"eth0": LinkCounters(dist, 0)})
        others.append(round(r.other_bps / 1e6))
    # 200 Mbit/s over one tick is 40 Mbit/s over the 0.5 s window (more while the detector has
    # seen less than the window), for the window's length.
    assert others == [0, 0, 67, 50, 40, 40, 40, 0, 0, 0]


def test_a_sudden_flow_crosses_the_threshold_within_a_tick(tmp_path):
    set_netdev(tmp_path, "eth0", 0, 0)
    det = LinkDetector(tmp_path, ack_share=0.0, average_over=0.5)
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", 0, 0)
    det.sample(0.1, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", 11_250_000, 0)            # 900 Mbit/s of training
    (r,) = det.sample(0.2, {"eth0": LinkCounters(0, 0)})
    assert r.other_bps == pytest.approx(450e6)             # over the 0.2 s seen so far


def test_distribution_callable_is_read_between_two_link_reads(tmp_path):
    set_netdev(tmp_path, "eth0", 0, 0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    det.sample(0.0, lambda: {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", 100 * MB, 0)

    def slow_stats():
        # The link moves on by 10 MB while the class counters are read (a busy host).
        set_netdev(tmp_path, "eth0", 110 * MB, 0)
        return {"eth0": LinkCounters(105 * MB, 0)}

    (r,) = det.sample(1.0, slow_stats)
    assert r.other_bps == 0.0
    assert r.rx_bps == 105 * MB * 8


def test_exact_counters_from_the_ingress_hook(tmp_path):
    # A pull at 900 Mbit/s and a 40 Mbit/s flow on another port. The HTB class counts every
    # segment's headers (4.5% more than a veth's rx_bytes for the same packets): link minus
    # class hides the flow; the ingress hook counts both sides alike and sees it.
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)
    det.sample(0.0, {"eth0": LinkCounters(rx_dist=0, tx_dist=0, rx_seen=0)})
    set_netdev(tmp_path, "eth0", rx=117_500_000, tx=0)            # 940 Mbit/s arrived
    (r,) = det.sample(1.0, {"eth0": LinkCounters(rx_dist=112_500_000, tx_dist=0,
                                                 rx_seen=117_500_000)})
    assert r.other_bps == pytest.approx(40e6)
    hidden = LinkDetector(tmp_path, ack_share=0.0)
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    hidden.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=117_500_000, tx=0)
    (r,) = hidden.sample(1.0, {"eth0": LinkCounters(int(112_500_000 * 1.045), 0)})
    assert r.other_bps < 5e6                                       # the blind spot


def test_rates_are_the_last_ticks(tmp_path):
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det = LinkDetector(tmp_path, ack_share=0.0)                   # window 0: the last tick
    det.sample(0.0, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=0, tx=0)
    det.sample(0.1, {"eth0": LinkCounters(0, 0)})
    set_netdev(tmp_path, "eth0", rx=6_250_000, tx=0)              # a flow starts: 500 Mbit/s
    (r,) = det.sample(0.2, {"eth0": LinkCounters(0, 0)})
    assert r.other_bps == pytest.approx(500e6)
