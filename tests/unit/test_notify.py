import socket

import pytest

from agent.notify import Notifier, WatchdogGate, watchdog_interval


def test_watchdog_interval_is_half_of_usec():
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}, 10) == 2.0
    assert watchdog_interval({}, 10) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, 10) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "11"}, 10) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "10"}, 10) == 2.0


def test_gate_pings_on_interval_only_while_workers_live():
    g = WatchdogGate(2.0)
    assert g.next_in(0.0) == 0.0
    assert g.due(0.0, True)
    assert not g.due(1.0, True)
    assert g.next_in(1.0) == 1.0
    assert g.due(2.0, True)
    assert not g.due(5.0, False)  # a dead worker: no ping, systemd restarts us
    assert not WatchdogGate(None).due(0.0, True)


def test_a_withheld_ping_is_looked_at_again_a_recheck_later_not_at_once():
    """A ping withheld for a dead worker stays due: the main loop, which waits next_in(), must
    not spin at 100% CPU until systemd restarts the daemon."""
    g = WatchdogGate(10.0)
    assert g.due(0.0, True)
    assert not g.due(12.0, False)
    assert g.next_in(12.0) == WatchdogGate.RECHECK
    assert g.next_in(12.5) == WatchdogGate.RECHECK - 0.5
    assert g.due(13.0, True)          # the worker is back (a reload): the ping goes out
    assert g.next_in(13.0) == 10.0


def test_sequence_and_status_dedup():
    sent = []
    n = Notifier(sent.append, monotonic=lambda: 12.5)
    n.status("starting")
    n.ready()
    n.status("idle")
    n.status("idle")
    n.watchdog()
    n.reloading()
    n.ready()
    n.stopping()
    assert sent == ["STATUS=starting", "READY=1", "STATUS=idle", "WATCHDOG=1",
                    "RELOADING=1\nMONOTONIC_USEC=12500000", "READY=1", "STOPPING=1"]


def test_sends_to_notify_socket_and_is_silent_without_one(monkeypatch, tmp_path):
    """Through sdnotify to the socket systemd names; with no NOTIFY_SOCKET (not under systemd)
    nothing is sent anywhere and nothing raised. A datagram is queued by the time send returns,
    so the non-blocking reads below see at once what was (or wasn't) sent."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        Notifier().ready()
        assert systemd.recv(256, socket.MSG_DONTWAIT) == b"READY=1"
        monkeypatch.delenv("NOTIFY_SOCKET")
        quiet = Notifier()
        quiet.ready()
        quiet.status("idle")
        with pytest.raises(BlockingIOError):
            systemd.recv(256, socket.MSG_DONTWAIT)
