"""The metrics endpoint of a running daemon, scraped over loopback."""

import hashlib
import re
import time
import urllib.request

import pytest

from agent import __version__
from agent.status import ERROR_KINDS
from agent.store import Store
from agent.store.pointers import set_current
from tests.daemon_helpers import (
    start_daemon,
    stop_daemon,
    wagent,
    wait_for_socket,
    write_policy,
)
from tests.unit.test_store import put_version

pytestmark = pytest.mark.debian


def test_daemon_serves_metrics_and_writes_textfile(tmp_path):
    import socket

    with socket.socket() as s:         # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a version the store's current pointer names before the daemon starts
    store = Store(tmp_path / "store")
    store.ensure()
    put_version(store, "bert", "v7", {"model.safetensors": b"weights"})
    set_current(store, "bert", "v7")
    textfile = tmp_path / "tf" / "wagent.prom"
    policy = write_policy(tmp_path / "policy.yaml", tmp_path,
                          metrics={"listen": f"127.0.0.1:{port}", "textfile": str(textfile)})
    sha256 = hashlib.sha256(policy.read_bytes()).hexdigest()
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
        assert f'wagent_build_info{{version="{__version__}"}} 1.0' in body
        assert f'wagent_policy_info{{sha256="{sha256}"}} 1.0' in body
        assert re.search(r"^wagent_policy_loaded_timestamp_seconds \S+$", body, re.M), body
        assert 'wagent_model_current_info{model="bert",version="v7"} 1.0' in body
        for kind in ERROR_KINDS:
            assert f'wagent_errors_total{{kind="{kind}"}} 0.0' in body, kind
        assert "wagent_up 1.0" in textfile.read_text()
    finally:
        stop_daemon(proc)
        print((tmp_path / "daemon.log").read_text())
    assert proc.returncode == 0
    # a stopped daemon leaves no values behind for node_exporter to go on exporting
    assert not textfile.exists()


def test_slow_scrapers_leave_the_daemon_its_descriptors(tmp_path):
    """Issue 21, as reported: connections to the metrics port that each trickle a header byte
    took the daemon to its descriptor limit; `wagent status` timed out and the control socket
    failed to accept. Now the daemon holds at most the endpoint's cap of them."""
    import contextlib
    import os
    import socket
    import threading

    from agent.metrics_http import MAX_CONNECTIONS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = write_policy(tmp_path / "policy.yaml", tmp_path,
                          metrics={"listen": f"127.0.0.1:{port}"})
    proc = start_daemon(policy, log=tmp_path / "daemon.log")
    clients, done = [], threading.Event()

    def trickle():
        while not done.wait(0.2):
            for c in list(clients):
                with contextlib.suppress(OSError):
                    c.send(b"E")

    trickler = threading.Thread(target=trickle)
    try:
        wait_for_socket(tmp_path / "control.sock", proc)
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        trickler.start()
        for _ in range(300):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"G")
            clients.append(c)
        time.sleep(1)
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= fds + MAX_CONNECTIONS + 1
        status = wagent("status", "--json", "--socket", str(tmp_path / "control.sock"),
                        timeout=10)
        assert status.returncode in (0, 1) and '"daemon"' in status.stdout, status
        # answered (empty until the daemon's first metrics tick)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).status == 200
    finally:
        done.set()
        if trickler.is_alive():
            trickler.join()
        for c in clients:
            c.close()
        stop_daemon(proc)
    log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log and "Too many open files" not in log, log


def test_served_on_ipv6_loopback_and_idle_scrapers_are_dropped():
    import socket
    import urllib.request

    from agent.metrics import Metrics
    from agent.metrics_http import REQUEST_DEADLINE
    from agent.policy.model import MetricsSettings
    from tests.unit.test_status import busy_state

    assert 0 < REQUEST_DEADLINE <= 10
    m = Metrics(MetricsSettings(listen="[::1]:0"), deadline=0.5)
    m.start()
    try:
        m.update(busy_state(), {})
        body = urllib.request.urlopen(f"http://[::1]:{m.port}/metrics", timeout=5).read()
        assert b"wagent_up 1.0" in body
        # a connection that sends nothing is closed by the server, not held for ever
        with socket.create_connection(("::1", m.port), timeout=5) as s:
            assert s.recv(1) == b""
    finally:
        m.stop()
