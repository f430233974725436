"""The pull sockets' registry: receive windows set live on real (loopback) TCP sockets."""

import gc
import socket
import threading

import pytest

from agent.pull.sockets import (
    MIN_SEGMENTS,
    TCP_WINDOW_CLAMP,
    PullSockets,
    buffer_for,
    parse_tcp_info,
    registering,
    window_for,
)

M = 10**6
G = 10**9


def test_window_is_rate_times_rtt_plus_budget_over_streams():
    assert window_for(G, 100e-6, 8, budget_s=0.001) == 17188    # 125 MB/s x 1.1 ms / 8
    assert window_for(25 * G, 50e-6, 8, budget_s=0.001) == 410157
    assert window_for(10 * M, 100e-6, 8) == MIN_SEGMENTS * 1448  # a few segments at least
    assert window_for(None, 100e-6, 8) is None
    assert window_for(G, None, 0, budget_s=0.001) == 125000      # no RTT yet, no socket yet


def test_buffer_gives_the_window_at_the_kernels_ratio():
    assert buffer_for(10_000) == 10_000        # half of a buffer is window: 2 x 10000 bytes
    assert buffer_for(10_000, 1.0) == 5000


@pytest.fixture
def pair():
    """A connected TCP pair on loopback; the client side is the pull's socket."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    yield client, peer
    client.close()
    peer.close()


def clamp(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_WINDOW_CLAMP)


def test_clamp_follows_the_rate_on_live_sockets(pair):
    client, peer = pair
    reg = PullSockets(budget_s=0.001)
    reg.set_rate(G)
    reg.register(client)                              # registered: the current window at once
    assert clamp(client) == 125000
    assert client.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 * 125000
    reg.set_rate(10 * M)                              # backed off: a few segments
    assert clamp(client) == MIN_SEGMENTS * 1448
    small = client.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert small < 4 * MIN_SEGMENTS * 1448
    reg.set_rate(None)                                # released: as big as autotuning allows
    assert clamp(client) > 10 * MIN_SEGMENTS * 1448


def test_sample_reads_tcp_info_and_counts_bytes_of_closed_sockets(pair):
    client, peer = pair
    reg = PullSockets()
    reg.register(client)
    peer.sendall(b"x" * 100_000)
    got = 0
    while got < 100_000:
        got += len(client.recv(65536))
    s = reg.sample()
    assert s.streams == 1 and s.bytes_received == 100_000
    assert s.min_rtt_us is None or s.min_rtt_us > 0
    client.close()
    del client
    gc.collect()
    s = reg.sample()
    assert s.streams == 0 and s.bytes_received == 100_000    # gone, still counted


def test_sockets_of_other_kinds_are_ignored():
    reg = PullSockets()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        reg.register(udp)
    assert reg.sample().streams == 0


def test_tcp_info_of_an_old_kernel_is_partial():
    info = parse_tcp_info(bytes(104))                  # Linux 4.0's struct: no byte counters
    assert info.rtt_us == 0 and info.bytes_received is None and info.min_rtt_us is None


def test_registering_connection_class_registers_once_connected(pair, monkeypatch):
    from agent.pull import sockets

    reg = PullSockets()
    monkeypatch.setattr(sockets, "REGISTRY", reg)

    class Conn:
        def __init__(self, sock):
            self._sock = sock
            self.sock = None

        def connect(self):
            self.sock = self._sock

    cls = registering(Conn)
    assert registering(Conn) is cls                   # one subclass per connection class
    cls(pair[0]).connect()
    assert reg.sample().streams == 1


def test_concurrent_registration_and_rate_changes(pair):
    reg = PullSockets()
    client, _ = pair
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            reg.set_rate(G)
            reg.set_rate(10 * M)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(200):
            reg.register(client)
            reg.sample()
    finally:
        stop.set()
        t.join()
    assert reg.errors == 0


def test_a_socket_registered_twice_counts_once(pair):
    reg = PullSockets()
    reg.register(pair[0])
    reg.register(pair[0])
    assert reg.sample().streams == 1
