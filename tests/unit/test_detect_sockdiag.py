import socket
import struct

import pytest

from agent.yielding.detect.ports import PortsDetector, TcpSocket
from agent.yielding.detect.sockdiag import (
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HDR,
    SOCK_DIAG_BY_FAMILY,
    SockDiagError,
    build_request,
    parse_messages,
)


def diag_msg(family, local, remote, state, inode, acked, received, info_len=232):
    src = socket.inet_pton(family, local[0]).ljust(16, b"\0")
    dst = socket.inet_pton(family, remote[0]).ljust(16, b"\0")
    body = struct.pack("=BBBB", family, state, 0, 0)
    body += struct.pack("!HH16s16s", local[1], remote[1], src, dst) + struct.pack("=III", 0, 0, 0)
    body += struct.pack("=IIIII", 0, 0, 0, 0, inode)
    info = bytearray(info_len)
    if info_len >= 136:
        struct.pack_into("=QQ", info, 120, acked, received)
    attr = struct.pack("=HH", 4 + info_len, 2) + bytes(info)
    body += attr + b"\0" * (-len(attr) % 4)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, 2, 7, 0) + body


def done(seq=7):
    return NLMSG_HDR.pack(NLMSG_HDR.size + 4, NLMSG_DONE, 2, seq, 0) + b"\0" * 4


def test_parse_a_dump():
    data = (diag_msg(socket.AF_INET, ("10.77.0.2", 45764), ("10.77.0.1", 29500), 1, 5521,
                     100, 1_180_000_000)
            + diag_msg(socket.AF_INET6, ("::ffff:127.0.0.1", 29500), ("2001:db8::2", 4000), 2,
                       5522, 0, 0, info_len=104)      # an old kernel's short tcp_info
            + done())
    finished, socks = parse_messages(data, seq=7)
    assert finished
    a, b = socks
    assert (a.local, a.remote, a.state, a.inode) == (("10.77.0.2", 45764),
                                                     ("10.77.0.1", 29500), 1, 5521)
    assert (a.bytes_acked, a.bytes_received) == (100, 1_180_000_000)
    assert b.local == ("127.0.0.1", 29500) and b.remote == ("2001:db8::2", 4000)
    assert b.bytes_acked is None


def test_errors_and_other_sequences():
    err = NLMSG_HDR.pack(NLMSG_HDR.size + 4, NLMSG_ERROR, 0, 7, 0) + struct.pack("=i", -1)
    with pytest.raises(SockDiagError, match="Operation not permitted"):
        parse_messages(err, seq=7)
    assert parse_messages(done(seq=3), seq=7) == (False, [])
    with pytest.raises(SockDiagError, match="bad message length"):
        parse_messages(NLMSG_HDR.pack(9999, NLMSG_DONE, 0, 7, 0))


def test_request_layout():
    req = build_request(socket.AF_INET6, 0xFFF, seq=5)
    length, mtype, flags, seq, _ = NLMSG_HDR.unpack_from(req)
    assert (length, mtype, flags, seq) == (len(req), 20, 0x301, 5) and len(req) == 16 + 56


class FakeSockets(PortsDetector):
    """The byte accounting on top of whatever lists the sockets."""

    def __init__(self, socks):
        super().__init__([(29500, 29500)], "/nonexistent", use_sockdiag=False)
        self.socks = socks

    def sockets(self):
        return iter(self.socks)


def conn(lport, rport, nbytes, inode=1):
    return TcpSocket(("10.0.0.2", lport), ("10.0.0.1", rport), 1, inode, nbytes)


def test_port_bytes_become_a_rate():
    det = FakeSockets([conn(50000, 29500, 10**9)])
    (r,) = det.sample(0.0)
    assert r.bps is None                                   # first tick: no rate yet
    det.socks = [conn(50000, 29500, 10**9 + 10**8), conn(50001, 29500, 5 * 10**6, inode=2),
                 conn(50002, 8080, 10**10, inode=3)]       # not a training port
    (r,) = det.sample(1.0)
    assert r.connections == 2 and r.bps == pytest.approx(840e6)
    det.socks = [conn(50001, 29500, 5 * 10**6, inode=2)]   # one closed
    (r,) = det.sample(2.0)
    assert r.bps == 0.0
