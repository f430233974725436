"""sock_diag against this kernel: a loopback connection in the test's own process, no root."""

import socket

import pytest

from agent.yielding.detect.ports import PortsDetector
from agent.yielding.detect.sockdiag import dump_tcp

pytestmark = pytest.mark.debian


def test_dump_sees_a_loopback_connection_and_its_bytes():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:
            a, _ = srv.accept()
            with a:
                c.sendall(b"x" * 300_000)
                got = 0
                while got < 300_000:
                    got += len(a.recv(1 << 20))
                socks = {(s.local, s.remote): s for s in dump_tcp()}
                mine = socks[(a.getsockname(), c.getsockname())]
                assert mine.state == 1 and mine.bytes_received == 300_000
                det = PortsDetector([(port, port)])
                det.sample(0.0)
                c.sendall(b"y" * 100_000)
                got = 0
                while got < 100_000:
                    got += len(a.recv(1 << 20))
                (r,) = det.sample(0.5)
                # Both ends are on this port: 100 kB received at one, acked at the other (the
                # ACK may still be on its way back).
                assert r.connections == 2
                assert 100_000 * 8 / 0.5 <= r.bps <= 2 * 100_000 * 8 / 0.5


def test_a_known_connection_is_looked_up_and_its_end_seen_without_a_dump():
    from agent.yielding.detect.sockdiag import lookup_tcp

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        c = socket.create_connection(("127.0.0.1", port))
        a, _ = srv.accept()
        det = PortsDetector([(port, port)])
        assert det.sample(0.0)[0].connections == 2          # a full dump: both ends
        # by both ends: a TIME_WAIT socket of an earlier test may hold the same local port
        mine = [s for s in dump_tcp()
                if (s.local, s.remote) == (c.getsockname(), c.getpeername())]
        assert [s.remote for s in lookup_tcp(mine)] == [("127.0.0.1", port)]
        assert det.refresh(0.1)[0].connections == 2
        c.close()
        a.close()
        assert det.refresh(0.2) == ()                       # gone: seen by lookups alone
        assert all(s.state not in (1, 2, 3) for s in lookup_tcp(mine))   # TIME_WAIT at most
