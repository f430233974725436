"""The daemon speaks systemd's notify protocol: READY once shaped, WATCHDOG while its workers
live, STATUS lines, RELOADING/READY around reloads, STOPPING; all from the daemon's main pid."""

import signal
import time

import pytest

from tests.daemon_helpers import (
    NotifySocket,
    start_daemon,
    stop_daemon,
    wagent,
    write_policy,
)

pytestmark = pytest.mark.debian


def test_notify_sequence_from_main_pid(tmp_path):
    policy = write_policy(tmp_path / "policy.yaml", tmp_path)
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start_daemon(policy, env={"NOTIFY_SOCKET": str(notify.path),
                                     "WATCHDOG_USEC": "400000"},
                        log=tmp_path / "daemon.log")
    try:
        pid, _ = notify.wait_for("READY=1", timeout=20)
        assert pid == proc.pid
        # WATCHDOG every WATCHDOG_USEC/2 = 0.2 s: a few within a second
        first = notify.wait_for("WATCHDOG=1", timeout=3)
        t0 = time.monotonic()
        notify.wait_for("WATCHDOG=1", timeout=3)
        notify.wait_for("WATCHDOG=1", timeout=3)
        assert time.monotonic() - t0 < 2.0
        assert first[0] == proc.pid
        statuses = [m for p, m in notify.messages if m.startswith("STATUS=")]
        assert any(m == "STATUS=idle" for m in statuses), statuses

        proc.send_signal(signal.SIGHUP)
        pid, msg = notify.wait_for("RELOADING=1", timeout=5)
        assert pid == proc.pid and "MONOTONIC_USEC=" in msg
        notify.wait_for("READY=1", timeout=5)

        # `wagent reload` goes through the control socket and waits for the answer
        r = wagent("reload", "--socket", str(tmp_path / "control.sock"))
        assert r.returncode == 0, r.stderr
        notify.wait_for("RELOADING=1", timeout=5)
        notify.wait_for("READY=1", timeout=5)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        pid, _ = notify.wait_for("STOPPING=1", timeout=5)
        assert pid == proc.pid
        assert proc.wait(5) == 0
        assert time.monotonic() - t0 < 5.0
        assert all(p == proc.pid for p, _ in notify.messages), notify.messages
    finally:
        stop_daemon(proc)
        notify.close()
        print((tmp_path / "daemon.log").read_text())


def test_invalid_policy_refuses_to_start_and_says_where(tmp_path):
    policy = write_policy(tmp_path / "policy.yaml", tmp_path, pulls={"streams": "many"})
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start_daemon(policy, env={"NOTIFY_SOCKET": str(notify.path)},
                        log=tmp_path / "daemon.log")
    try:
        assert proc.wait(20) == 1
        log = (tmp_path / "daemon.log").read_text()
        assert f"{policy}:" in log and "streams" in log, log
        assert not any(m == "READY=1" for _, m in notify.messages)
    finally:
        stop_daemon(proc)
        notify.close()
