"""The burst generator's wire format and report (the netns run is in the integration tests)."""

import socket
import threading

from tests.testbed.bursts import Burst, parse, receive, send


def test_send_and_receive_over_loopback(capsys):
    # The sender listens on a free port; the receiver acks each burst.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    got = {}
    out = []

    class Lines:
        def write(self, text):
            out.append(text)

        def flush(self):
            pass

    t = threading.Thread(target=lambda: send(port, 100_000, 0.01, 3, None, Lines()))
    t.start()
    for _ in range(100):
        try:
            got["n"] = receive("127.0.0.1", port)
            break
        except ConnectionRefusedError:
            threading.Event().wait(0.02)
    t.join(10)
    bursts = parse("".join(out))
    assert got["n"] == 3 and [b.index for b in bursts] == [0, 1, 2]
    assert all(b.size == 100_000 and b.seconds > 0 for b in bursts)
    assert bursts[0].started < bursts[1].started


def test_burst_rate():
    assert Burst(0, 24_000_000, 0.0, 0.2).bps == 960e6
