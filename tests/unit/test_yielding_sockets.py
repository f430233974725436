"""The pull sockets' registry: receive windows set live on real (loopback) TCP sockets."""

import gc
import socket
import threading

import pytest

from agent.policy.model import Backoff
from agent.yielding.base_rtt import BaseRtts
from agent.yielding.sockets import (
    BURST_SHARE,
    MIN_SEGMENTS,
    TCP_WINDOW_CLAMP,
    PullSockets,
    buffer_for,
    most_in_flight,
    most_unannounced,
    parse_tcp_info,
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


def connect(address, mss: int | None = 1460) -> socket.socket:
    """A client on loopback whose segments are a 1500-byte MTU's (``mss``: 1448 bytes of data
    with timestamps), as on the networks the windows are sized for: loopback's own 65483-byte
    segments would put every window at its floor of four segments (``MIN_SEGMENTS``)."""
    s = socket.socket()
    if mss is not None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
    s.connect(address)
    return s


@pytest.fixture
def pair():
    """A connected TCP pair on loopback; the client side is the pull's socket."""
    server = socket.create_server(("127.0.0.1", 0))
    client = connect(server.getsockname())
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
    handshake = reg.bases.base("127.0.0.1", reg.clock())  # the path's RTT, from its handshake
    assert handshake is not None and handshake < 0.01
    assert clamp(client) == window_for(G, handshake, 1, budget_s=0.001)   # 125000 + 125/us
    assert client.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 * 125000
    reg.set_rate(10 * M)                              # slower: 20 ms of it (a reader's stall)
    assert clamp(client) == window_for(10 * M, handshake, 1, budget_s=0.001) >= 25_000
    reg.set_rate(1 * M)                               # backed off: a few segments
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


def test_a_connection_registers_in_its_owners_registry_once_connected(pair):
    # The HTTP layer's connection class (agent.pull.urllib3_adapter), built per owner: each
    # registry sees its own connections only (no process-wide registry).
    from agent.pull.urllib3_adapter import connection_class

    mine, other = PullSockets(), PullSockets()

    class Conn:
        def __init__(self, sock):
            self._sock = sock
            self.sock = None

        def connect(self):
            self.sock = self._sock

    connection_class(Conn, other.register)
    conn = connection_class(Conn, mine.register)(pair[0])
    assert mine.sample().streams == 0                 # not before it is connected
    conn.connect()
    assert mine.sample().streams == 1
    assert other.sample().streams == 0


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


def test_base_rtt_is_the_smallest_of_the_last_ten_minutes_per_peer():
    b = BaseRtts()
    b.observe("a", 3e-3, now=0.0)
    b.observe("a", 9e-6, now=59.0)            # the path idle once: that is its base
    b.observe("a", 2.5e-3, now=400.0)         # a queue standing since: not the path
    assert b.base("a", 400.0) == 9e-6
    assert b.base("b", 400.0) is None         # another peer knows nothing of it
    assert b.base("a", 599.0) == 9e-6
    assert b.base("a", 600.0) == 2.5e-3       # ten minutes on, the path is believed to have grown
    b.observe("a", 0.0, now=600.0)            # no sample (a kernel without min_rtt)
    assert b.base("a", 600.0) == 2.5e-3


def test_base_rtts_forget_the_least_recently_seen_peer():
    b = BaseRtts(max_peers=2)
    b.observe("a", 1e-3, 0.0)
    b.observe("b", 1e-3, 1.0)
    b.observe("a", 1e-3, 2.0)
    b.observe("c", 1e-3, 3.0)
    assert b.base("b", 3.0) is None and b.base("a", 3.0) and b.base("c", 3.0)


def test_a_latecomer_sizes_its_window_for_the_path_not_for_the_queue_it_found(pair):
    """A connection opened while another host's pull fills the bottleneck reads that queue in
    every RTT sample; the base seen earlier on the same path (an idle poll) sizes its window."""
    client, _ = pair
    now = [1000.0]
    bases = BaseRtts()
    bases.observe("127.0.0.1", 1e-6, now=now[0] - 120)     # two minutes ago, idle: 1 us
    reg = PullSockets(budget_s=0.0, clock=lambda: now[0], bases=bases)
    reg.set_rate(100 * G)                       # budget 0: the window is all round trip
    reg.register(client)                        # its own handshake took longer than 1 us
    assert clamp(client) == window_for(100 * G, 1e-6, 1, budget_s=0.0)
    now[0] += 11 * 60                           # the idle sample is out of the history
    reg.sample()
    own = bases.base("127.0.0.1", now[0])
    assert own is not None and own > 1e-6
    assert clamp(client) == window_for(100 * G, own, 1, budget_s=0.0)


def test_each_socket_is_sized_for_the_path_to_its_own_peer(pair):
    """A near cache and a farther mirror at once: each socket carries its share over its own
    round trip, not over the nearest one's."""
    near, _ = pair
    server = socket.create_server(("127.0.0.2", 0))
    far = connect(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    try:
        bases = BaseRtts()
        bases.observe("127.0.0.1", 1e-6, now=0.0)       # nearer than loopback's handshake
        reg = PullSockets(budget_s=0.0, clock=lambda: 0.0, bases=bases)
        reg.set_rate(100 * G)
        reg.register(near)
        reg.register(far)                               # known by its handshake alone
        far_rtt = bases.base("127.0.0.2", 0.0)
        assert far_rtt is not None and far_rtt > 2e-6
        assert clamp(near) == window_for(100 * G, 1e-6, 2, budget_s=0.0)
        assert clamp(far) == window_for(100 * G, far_rtt, 2, budget_s=0.0) > clamp(near)
        assert reg.sample().window == clamp(far)        # status shows the largest
    finally:
        far.close()
        accepted.close()


def test_the_windows_together_hold_at_most_a_share_of_the_smallest_burst():
    """Issue 23: what a window granted still arrives after a cut, so the windows together stay
    under 3% of the smallest burst the policy protects, at any rate; null lifts the bound."""
    assert most_in_flight(Backoff()) == int(BURST_SHARE * 4 * 10**6) == 120_000
    assert most_in_flight(Backoff(smallest_burst=None)) is None
    per = window_for(10**11, 50e-6, 8, most=most_in_flight(Backoff()))
    assert per * 8 == 120_000                               # 12.6 MB by rate alone
    assert window_for(10**11, 50e-6, 8) * 8 > 12_000_000
    assert window_for(10**7, 50e-6, 8, most=120_000) == 4 * 1448   # the floor still holds
    reg = PullSockets()
    reg.configure(Backoff(queue_budget=0.002, smallest_burst=8 * 10**6))
    assert (reg.budget_s, reg.most) == (0.002, 240_000)


def test_a_node_without_training_lifts_the_bound():
    """The bound protects bursts; a node the backoff loop finds without training (no training
    port, no libnccl, the controller full) pulls at the link's rate on any path."""
    reg = PullSockets(most=120_000)
    reg.set_rate(100 * G)
    assert reg.sample().window == 120_000                   # training assumed until told
    reg.guard(False)
    assert reg.sample().window == window_for(100 * G, None, 0) == 12_500_000
    reg.guard(True)
    assert reg.sample().window == 120_000


def test_a_slow_links_stall_floor_reaches_up_to_the_burst_rules_share():
    """Issue 27: on a slow link the windows keep 20 ms of the rate for a stalled reader, up to
    what the burst rule allows them together (3% of the smallest burst: 120 kB), not only the
    detector's 64 KiB; a policy that names no burst keeps 64 KiB. Training bounds them as
    before, and a rate backed off to a trickle keeps 20 ms of that trickle."""
    reg = PullSockets()
    reg.configure(Backoff())                                  # smallest burst 4 MB
    reg.guard(False)
    reg.set_rate(40 * M)
    assert reg.sample().window == window_for(40 * M, None, 0, least=120_000) == 100_000
    reg.set_rate(100 * M)
    assert reg.sample().window == 120_000                     # 20 ms would be 250 kB
    reg.set_rate(2 * M)
    assert reg.sample().window == MIN_SEGMENTS * 1448        # 20 ms of 2 Mbit/s is 5 kB
    reg.configure(Backoff(smallest_burst=None))
    reg.set_rate(100 * M)
    assert reg.sample().window == 64 * 1024
    reg.configure(Backoff())
    reg.expect_cuts(64 * 1024)
    reg.guard(True, announced=False)                          # training: its bound holds
    assert reg.sample().window == 43_616


def test_bursts_that_come_unannounced_meet_smaller_windows():
    """A burst the detector sees meets the windows twice (the queue at its start, what they
    granted before the cut) and about half the bucket: twice the windows and half the bucket
    stay under the share. Once the rhythm is known the readers stop before each burst."""
    assert most_unannounced(120_000, 64 * 1024) == (120_000 - 32_768) // 2
    assert most_unannounced(120_000, None) == 120_000          # no fast path
    assert most_unannounced(None, 64 * 1024) is None           # no bound at all
    assert most_unannounced(30_000, 64 * 1024) == 1            # the floor of segments then
    reg = PullSockets()
    reg.configure(Backoff())
    reg.set_rate(100 * G)
    assert reg.sample().window == 120_000                      # no fast path yet
    reg.expect_cuts(64 * 1024)
    assert reg.sample().window == 43_616
    reg.guard(True, announced=True)
    assert reg.sample().window == 120_000
    reg.guard(True, announced=False)
    assert reg.sample().window == 43_616
    reg.configure(Backoff(smallest_burst=8 * 10**6))          # a reload keeps the bucket
    assert reg.sample().window == (240_000 - 32_768) // 2
    reg.expect_cuts(None)
    assert reg.sample().window == 240_000


def test_a_window_is_never_under_four_of_the_paths_own_segments():
    """Loopback's (or a jumbo-frame network's) segments are larger than a 1500-byte MTU's: a
    window of four 1448-byte segments there is under two of its own, and the sender's
    silly-window avoidance would wait for delayed ACKs (measured: 0.5 MB/s from 8 streams)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = connect(server.getsockname(), mss=None)
    peer, _ = server.accept()
    try:
        reg = PullSockets(budget_s=0.0)
        reg.set_rate(10**7)
        reg.register(client)
        mss = parse_tcp_info(client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)).advmss
        assert mss is not None and mss > 8000
        assert clamp(client) == MIN_SEGMENTS * mss
    finally:
        for s in (client, peer, server):
            s.close()
