"""The metrics endpoint of a running daemon, scraped over loopback."""

import re
import time
import urllib.request

import pytest

from tests.daemon_helpers import (
    start_daemon,
    stop_daemon,
    wait_for_socket,
    write_policy,
)

pytestmark = pytest.mark.debian


def test_daemon_serves_metrics_and_writes_textfile(tmp_path):
    import socket

    with socket.socket() as s:         # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = write_policy(tmp_path / "policy.yaml", tmp_path,
                          metrics={"listen": f"127.0.0.1:{port}",
                                   "textfile": str(tmp_path / "tf" / "wagent.prom")})
    proc = start_daemon(policy, log=tmp_path / "daemon.log")
    try:
        wait_for_socket(tmp_path / "control.sock", proc)
        deadline = time.monotonic() + 10
        body = ""
        while time.monotonic() < deadline and "wagent_up" not in body:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=5).read().decode()
            time.sleep(0.2)
        assert re.search(r"^wagent_up 1\.0$", body, re.M), body
        assert 'wagent_backoff_state{state="full"} 1.0' in body
        assert "wagent_store_used_bytes" in body
        assert "wagent_up 1.0" in (tmp_path / "tf" / "wagent.prom").read_text()
    finally:
        stop_daemon(proc)
        print((tmp_path / "daemon.log").read_text())


def test_served_on_ipv6_loopback_and_idle_scrapers_are_dropped():
    import socket
    import urllib.request

    from agent.metrics import Metrics
    from agent.policy.model import MetricsSettings
    from agent.status import to_json
    from tests.unit.test_status import NOW, busy_state

    m = Metrics(MetricsSettings(listen="[::1]:0"))
    m.start()
    try:
        m.update(to_json(busy_state(), NOW), {})
        body = urllib.request.urlopen(f"http://[::1]:{m.port}/metrics", timeout=5).read()
        assert b"wagent_up 1.0" in body
        # a connection that sends nothing is closed by the server, not held for ever
        assert 0 < m._server.RequestHandlerClass.timeout <= 10
        with socket.create_connection(("::1", m.port), timeout=5) as s:
            s.settimeout(0.2)
            try:
                assert s.recv(1) == b""
            except TimeoutError:
                pass                     # still within the server's timeout: fine
    finally:
        m.stop()
