from pathlib import Path

from agent.yielding.detect.ports import (
    ESTABLISHED,
    SYN_RECV,
    SYN_SENT,
    PortsDetector,
    parse_addr,
    parse_proc_net_tcp,
)
from tests.backoff_helpers import TCP_HEADER, tcp_line, write_tcp

LISTEN, TIME_WAIT, CLOSE_WAIT = 0x0A, 0x06, 0x08

DATA = Path(__file__).parent / "data" / "detect"

# A node's namespace during `iperf3 -c 10.77.0.1 -p 29500 -R`, in the kernel's format (x86, so
# little-endian words): the control and data connections to port 29500, two pulls' connections
# to nginx on 8080 (one with bytes waiting in rx_queue), sshd listening.
RECORDED_TCP = (DATA / "node_proc_net_tcp").read_text()

RECORDED_TCP6 = (DATA / "node_proc_net_tcp6").read_text()


def test_parse_addresses():
    assert parse_addr("0100007F:0CEA") == ("127.0.0.1", 3306)
    assert parse_addr("02004D0A:B2C4") == ("10.77.0.2", 45764)
    assert parse_addr("B80D0120000000000000000001000000:733C") == ("2001:db8::1", 29500)
    assert parse_addr("0000000000000000FFFF00000100007F:733C") == ("127.0.0.1", 29500)


def test_recorded_iperf3_connections_on_29500(tmp_path):
    (tmp_path / "proc" / "net").mkdir(parents=True)
    (tmp_path / "proc" / "net" / "tcp").write_text(RECORDED_TCP)
    det = PortsDetector([(29500, 29500)], tmp_path)
    (r,) = det.sample(0.0)
    assert r.port == 29500 and r.connections == 2
    assert r.peers == ("10.77.0.1:29500",)
    assert r.bps is None


def test_ipv6_and_both_ends_count(tmp_path):
    (tmp_path / "proc" / "net").mkdir(parents=True)
    (tmp_path / "proc" / "net" / "tcp6").write_text(RECORDED_TCP6)
    (r,) = PortsDetector([(29500, 29500)], tmp_path).sample(0.0)
    # One accepted (local port 29500), one being opened (SYN_SENT to [2001:db8::2]:29500).
    assert r.connections == 2
    assert r.peers == ("127.0.0.2:54321", "[2001:db8::2]:29500")


def test_states_that_count(tmp_path):
    lines = [tcp_line(i, "0100007F:733C", f"0200007F:{0xC000 + i:04X}", st)
             for i, st in enumerate((ESTABLISHED, SYN_SENT, SYN_RECV, LISTEN, TIME_WAIT,
                                     CLOSE_WAIT))]
    write_tcp(tmp_path, lines)
    (r,) = PortsDetector([(29500, 29500)], tmp_path).sample(0.0)
    assert r.connections == 3


def test_ranges_and_other_ports(tmp_path):
    write_tcp(tmp_path, [
        tcp_line(0, "0100007F:C350", "0200007F:D000", ESTABLISHED),   # 50000 local
        tcp_line(1, "0100007F:D001", "0200007F:C3B4", ESTABLISHED),   # 50100 remote
        tcp_line(2, "0100007F:D002", "0200007F:1F90", ESTABLISHED),   # 8080: distribution
    ])
    det = PortsDetector([(29500, 29500), (50000, 51000)], tmp_path)
    assert [(r.port, r.connections) for r in det.sample(0.0)] == [(50000, 1), (50100, 1)]
    assert PortsDetector([], tmp_path).sample(0.0) == ()


def test_connections_come_and_go(tmp_path):
    det = PortsDetector([(29500, 29500)], tmp_path)
    assert det.sample(0.0) == ()                                        # no /proc/net at all
    write_tcp(tmp_path, [tcp_line(0, "0100007F:D000", "0200007F:733C", SYN_SENT)], [])
    assert det.sample(1.0)[0].connections == 1
    write_tcp(tmp_path, [tcp_line(0, "0100007F:D000", "0200007F:733C", TIME_WAIT)], [])
    assert det.sample(2.0) == ()


def test_malformed_lines_are_skipped():
    text = TCP_HEADER + "garbage\n   0: zz:zz 00:00 01 0 0 0 0 0 0\n" + tcp_line(
        1, "0100007F:733C", "0200007F:D000", ESTABLISHED)
    socks = list(parse_proc_net_tcp(text))
    assert len(socks) == 1 and socks[0].local == ("127.0.0.1", 29500)


def test_live_proc_of_this_namespace_parses():
    # Whatever this host has open: the parser must not choke on the real file.
    assert all(s.remote[1] >= 0 for s in PortsDetector([(1, 65535)]).sockets())
