import json
import logging
import os
import socket
import threading

import pytest

from agent.control import (
    RESERVED_PERMITS,
    ControlError,
    ControlRequest,
    ControlServer,
    NotRunning,
    Peer,
    ProtocolError,
    authorized,
    call,
    dispatch,
    parse_request,
)
from tests.waiting import wait_for


class FakeController:
    def __init__(self):
        self.reloads = 0

    def status(self):
        return {"schema": 1}

    def reload(self):
        self.reloads += 1
        return {"reloaded": True}

    def pause(self):
        raise ControlError("nothing to pause", "state")

    def resume(self):
        raise RuntimeError("boom")


def test_parse_request():
    assert parse_request(b'{"cmd": "status"}') == ControlRequest("status", {})
    for bad in (b"nope", b"[]", b'{"cmd": 1}', b'{"cmd": "rm -rf"}', b'{"cmd": "status", '
                b'"args": 3}', b"\xff"):
        with pytest.raises(ProtocolError):
            parse_request(bad)


def test_authorized():
    assert authorized("status", 65534, [1000])
    assert authorized("reload", 0, [1000])
    assert authorized("reload", 1000, [1000])
    assert not authorized("reload", 65534, [1000])
    assert not authorized("pause", 65534, [1000])
    assert not authorized("resume", 65534, [])


def test_dispatch_maps_errors_to_replies():
    c = FakeController()
    nobody = Peer(1, 65534, 65534)
    assert dispatch(c, ControlRequest("status", {}), nobody, [0]) == {"ok": True,
                                                               "result": {"schema": 1}}
    r = dispatch(c, ControlRequest("reload", {}), nobody, [0])
    assert r["kind"] == "forbidden" and "uid 65534" in r["error"] and c.reloads == 0
    assert dispatch(c, ControlRequest("pause", {}), Peer(1, 0, 0), [])["kind"] == "state"
    assert dispatch(c, ControlRequest("resume", {}), Peer(1, 0, 0), [])["kind"] == "internal"


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "run" / "control.sock")
    c = FakeController()
    srv = ControlServer(path, c, group=None, read_timeout=0.5, max_clients=2)
    srv.start()
    yield srv, c
    srv.stop()


def test_socket_round_trip_and_mode(server):
    srv, c = server
    assert oct(os.stat(srv.path).st_mode & 0o777) == "0o660"
    assert call(srv.path, "status") == {"schema": 1}
    assert call(srv.path, "reload") == {"reloaded": True} and c.reloads == 1
    with pytest.raises(ControlError, match="nothing to pause"):
        call(srv.path, "pause")


def test_not_running(tmp_path):
    with pytest.raises(NotRunning):
        call(str(tmp_path / "none.sock"), "status")
    # a stale socket file from a killed daemon: nobody listening
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with pytest.raises(NotRunning):
        call(str(stale), "status")


def test_stale_socket_is_replaced_but_a_live_one_is_not(tmp_path, server):
    srv, _ = server
    with pytest.raises(ControlError, match="another wagent daemon"):
        ControlServer(srv.path, FakeController(), group=None).start()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    other = ControlServer(str(stale), FakeController(), group=None)
    other.start()
    try:
        assert call(str(stale), "ping") == {"pong": True}
    finally:
        other.stop()


def test_a_live_daemon_is_not_robbed_even_when_its_socket_does_not_answer(tmp_path, server):
    """The live daemon's socket replaced by a dead one (or caught between bind and listen):
    connecting says "stale", but the daemon still runs; its lock keeps a second one out, and
    stopping the first never unlinks a socket that isn't its own."""
    srv, _ = server
    os.unlink(srv.path)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(srv.path)                  # bound, never listening: connect() is refused
    try:
        with pytest.raises(ControlError, match=f"pid {os.getpid()}"):
            ControlServer(srv.path, FakeController(), group=None).start()
        srv.stop()
        assert os.path.exists(srv.path)  # not srv's socket: left alone
    finally:
        dead.close()


def test_slow_and_oversized_clients_dont_stall(server):
    srv, _ = server
    slow = []
    for _ in range(2 + RESERVED_PERMITS):  # every permit, root's reserve too, no line ever ends
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(srv.path)
        s.sendall(b'{"cmd": ')
        slow.append(s)
    assert wait_for(lambda: srv.connections() == 2 + RESERVED_PERMITS)   # each holds a permit
    # while the permits are full, a new client is told "busy" at once, not made to wait
    with pytest.raises(ControlError, match="busy"):
        call(srv.path, "status", timeout=2)
    assert srv.connections() == 2 + RESERVED_PERMITS
    # the read deadline (0.5 s) drops the slow ones, though they never close
    assert wait_for(lambda: srv.connections() == 0, timeout=3)
    assert call(srv.path, "status") == {"schema": 1}
    for s in slow:
        s.close()
    big = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    big.connect(srv.path)
    try:
        big.sendall(b"x" * (70 * 1024))
    except OSError:
        pass
    reply = json.loads(big.makefile("rb").readline())
    assert reply["kind"] == "protocol"
    big.close()


def test_slots_kept_for_root_and_the_service_user_only(server):
    """Members of the socket's group holding every ordinary permit can't lock out root's
    `wagent reload` (systemd's ExecReload); they can't take the kept permits themselves."""
    srv, _ = server
    reader, root = Peer(pid=1, uid=4321, gid=4321), Peer(pid=1, uid=0, gid=0)
    taken = [srv.permit_for(reader), srv.permit_for(reader)]   # max_clients=2 in the fixture
    assert all(taken)
    assert srv.permit_for(reader) is None
    kept = [srv.permit_for(root) for _ in range(RESERVED_PERMITS)]
    assert all(kept) and srv.permit_for(root) is None
    for permit in taken + kept:
        permit.release()


def test_concurrent_status_calls(server):
    srv, _ = server
    errors = []

    def one():
        try:
            call(srv.path, "status")
        except ControlError as e:
            if e.kind != "busy":
                errors.append(e)

    ts = [threading.Thread(target=one) for _ in range(10)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_status_exit_codes_for_a_killed_daemon_and_a_live_one(tmp_path, server, capsys):
    """3 when only a stale socket file is left (a daemon killed with -9), and the JSON says
    so; 1 when the daemon answers with a degraded or unreadable status."""
    from agent.cli import main

    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    assert main(["status", "--json", "--socket", str(stale)]) == 3
    assert json.loads(capsys.readouterr().out)["running"] is False
    assert main(["status", "--socket", str(tmp_path / "none.sock")]) == 3
    srv, _ = server
    assert main(["status", "--json", "--socket", srv.path]) == 1   # {"schema": 1}: no health


def raw(path, data):
    """The daemon's answer to bytes sent as they are, as a dict (None: closed unanswered)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(data)
        line = s.makefile("rb").readline()
    return json.loads(line) if line else None


def test_requests_python_cannot_decode_are_protocol_errors():
    deep = b"[" * 60_000
    huge = b'{"cmd": "status", "args": {"n": ' + b"7" * 5000 + b"}}"
    for bad in (deep, huge, b'{"cmd": "status", "args": {"n": -' + b"1" * 200 + b"}}"):
        with pytest.raises(ProtocolError):
            parse_request(bad)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_request(deep)
    with pytest.raises(ProtocolError, match="5000 digits"):
        parse_request(huge)
    assert parse_request(b'{"cmd": "ping", "args": {"n": -12, "f": 1e400}}').cmd == "ping"


def test_undecodable_requests_are_answered_not_fatal(server, caplog):
    """Issue 21: deep nesting (RecursionError) or a 5000-digit integer (ValueError) killed the
    connection's thread with a traceback and no answer."""
    srv, _ = server
    caplog.set_level(logging.INFO, logger="agent.control")
    for bad, why in ((b"[" * 60_000 + b"\n", "nested too deeply"),
                     (b'{"cmd": "status", "n": ' + b"9" * 5000 + b"}\n", "5000 digits")):
        reply = raw(srv.path, bad)
        assert reply is not None and reply["kind"] == "protocol" and why in reply["error"]
        assert [r for r in caplog.records if why in r.getMessage()], why
    assert call(srv.path, "status") == {"schema": 1}        # its permits were all given back
    assert call(srv.path, "status") == {"schema": 1}
    assert call(srv.path, "status") == {"schema": 1}
    assert not [r for r in caplog.records if r.exc_info]


def test_an_unexpected_failure_in_a_connection_is_answered_and_logged_once(tmp_path, caplog):
    class Unencodable(FakeController):
        def status(self):
            return {"when": {1, 2}}          # a set: json can't encode it

    srv = ControlServer(str(tmp_path / "run" / "c.sock"), Unencodable(), group=None,
                        read_timeout=0.5, max_clients=1)
    srv.start()
    try:
        for _ in range(3):                   # the one permit is given back each time
            with pytest.raises(ControlError) as e:
                call(srv.path, "status")
            assert e.value.kind == "internal", e.value
    finally:
        srv.stop()
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 3 and all(r.exc_info for r in failures)
