import pytest

from agent.yielding.detect.counters import MAX32, WRAP32
from agent.yielding.detect.rdma import RdmaDetector
from tests.backoff_helpers import remove_ib, set_ib_port, set_netdev


def test_port_counters_are_4_byte_words(tmp_path):
    set_ib_port(tmp_path, "mlx5_0", 1, rcv_words=0, xmit_words=0)
    det = RdmaDetector(tmp_path)
    assert det.sample(0.0) == ()
    # 12 Gbit/s received = 1.5 GB/s = 375 M words per second; a little sent.
    set_ib_port(tmp_path, "mlx5_0", 1, rcv_words=375_000_000, xmit_words=1000)
    (r,) = det.sample(1.0)
    assert (r.device, r.port, r.name) == ("mlx5_0", "1", "mlx5_0/1")
    assert r.bps == pytest.approx(12e9)
    assert not r.saturated


def test_transmit_counts_too_and_ports_are_separate(tmp_path):
    set_ib_port(tmp_path, "mlx5_0", 1, 0, 0)
    set_ib_port(tmp_path, "mlx5_0", 2, 0, 0)
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    set_ib_port(tmp_path, "mlx5_0", 1, 0, 250_000)           # 8 Mbit/s out over 1 s
    set_ib_port(tmp_path, "mlx5_0", 2, 0, 0)
    readings = {r.name: r for r in det.sample(1.0)}
    assert readings["mlx5_0/1"].bps == pytest.approx(8e6)
    assert readings["mlx5_0/2"].bps == 0.0


def test_hw_counters_bytes_and_requests(tmp_path):
    # An EFA-like device: no port data counters, bytes in hw_counters.
    set_ib_port(tmp_path, "efa_0", 1, hw={"rx_bytes": 0, "tx_bytes": 0})
    # An mlx5 RoCE port with request counters beside its port counters.
    set_ib_port(tmp_path, "mlx5_1", 1, 0, 0, hw={"rx_write_requests": 0, "rx_read_requests": 0})
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    set_ib_port(tmp_path, "efa_0", 1, hw={"rx_bytes": 10**9, "tx_bytes": 10})
    set_ib_port(tmp_path, "mlx5_1", 1, 0, 0, hw={"rx_write_requests": 3000,
                                                  "rx_read_requests": 1000})
    readings = {r.name: r for r in det.sample(2.0)}
    assert readings["efa_0/1"].bps == pytest.approx(4e9)
    assert readings["mlx5_1/1"].bps == 0.0
    assert readings["mlx5_1/1"].ops_per_s == pytest.approx(2000.0)


def test_32_bit_word_counter_wrap(tmp_path):
    set_ib_port(tmp_path, "mlx4_0", 1, WRAP32 - 1000, 0)
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    set_ib_port(tmp_path, "mlx4_0", 1, 1000, 0)
    (r,) = det.sample(1.0)
    assert r.bps == 2000 * 4 * 8


def test_saturated_32_bit_counter_falls_back_to_hw_counters(tmp_path):
    set_ib_port(tmp_path, "mlx4_0", 1, MAX32, MAX32, hw={"rx_bytes": 0})
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    set_ib_port(tmp_path, "mlx4_0", 1, MAX32, MAX32, hw={"rx_bytes": 125_000_000})
    (r,) = det.sample(1.0)
    assert r.saturated
    assert r.bps == pytest.approx(1e9)


def test_saturated_without_fallback_is_reported(tmp_path):
    set_ib_port(tmp_path, "mlx4_0", 1, MAX32, MAX32)
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    (r,) = det.sample(1.0)
    assert r.saturated and r.bps == 0.0


def test_devices_appear_and_vanish(tmp_path):
    set_netdev(tmp_path, "eth0", 0, 0)  # a tree without /sys/class/infiniband at first
    det = RdmaDetector(tmp_path)
    assert det.sample(0.0) == ()
    set_ib_port(tmp_path, "mlx5_0", 1, 5_000_000, 0)
    assert det.sample(1.0) == ()                             # new: a baseline first
    set_ib_port(tmp_path, "mlx5_0", 1, 6_000_000, 0)
    (r,) = det.sample(2.0)
    assert r.bps == pytest.approx(32e6)
    remove_ib(tmp_path, "mlx5_0")
    assert det.sample(3.0) == ()
    # Back after a driver reload, counters from zero: a baseline again, not a wrap.
    set_ib_port(tmp_path, "mlx5_0", 1, 10, 0)
    assert det.sample(4.0) == ()
    set_ib_port(tmp_path, "mlx5_0", 1, 10 + 250_000, 0)
    (r,) = det.sample(5.0)
    assert r.bps == pytest.approx(8e6)


def test_unreadable_counter_is_skipped(tmp_path):
    set_ib_port(tmp_path, "mlx5_0", 1, 0, 0)
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    counter = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_data"
    counter.write_text("garbage\n")
    set_ib_port(tmp_path, "mlx5_0", 1, xmit_words=250_000)
    (r,) = det.sample(1.0)
    assert r.bps == pytest.approx(8e6)


def test_device_recreated_within_one_tick_is_not_a_wrap(tmp_path):
    set_ib_port(tmp_path, "mlx5_0", 1, 6_000_000, 0)
    det = RdmaDetector(tmp_path)
    det.sample(0.0)
    keep = tmp_path / "keep"  # hold the old inode so the new directory can't reuse its number
    (tmp_path / "sys/class/infiniband/mlx5_0").rename(keep)
    set_ib_port(tmp_path, "mlx5_0", 1, 10, 0)
    assert det.sample(1.0) == ()
