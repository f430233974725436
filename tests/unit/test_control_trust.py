"""Who could have put the control socket there (issue 11, item 5).

A user who can create names in the socket's directory can replace the socket with their own and
answer root's `reload` or `pause` with a success the daemon never heard. The daemon refuses to
serve a socket in such a directory (or under one), and a client refuses such a socket, and any
socket served by someone other than root, itself or the service's user, before it sends
anything. Real directories owned by a real other user (nobody), and a real server run as nobody.
"""

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import ownership
from agent.control import ControlError, ControlServer, call, socket_dir_problem
from tests.daemon_helpers import Impostor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody and "
                                "to run a server as nobody")

NOBODY = 65534


class FakeController:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def status(self) -> dict:
        return {"schema": 1}

    def reload(self) -> dict:
        self.calls.append("reload")
        return {"reloaded": True}

    def pause(self) -> dict:
        self.calls.append("pause")
        return {"paused": True}

    def resume(self) -> dict:
        return {"paused": False}


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 directory under /tmp (sticky, world-writable, root's) that nobody can
    reach: pytest's own tmp_path sits under a 0700 directory."""
    d = Path(tempfile.mkdtemp(prefix="wagent-trust-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def make_dir(path: Path, mode: int, uid: int = 0) -> Path:
    path.mkdir()
    os.chown(path, uid, uid)
    os.chmod(path, mode)      # after chown, which clears nothing here but keeps the order plain
    return path


UNSAFE = [   # owner, mode, why, the fix the message gives
    pytest.param(NOBODY, 0o755, "owned by uid 65534", "chown root", id="owned-by-nobody"),
    pytest.param(0, 0o777, "writable by its group and all users", "chmod go-w",
                 id="world-writable"),
    pytest.param(0, 0o1777, "sticky, but others can still create names", "chmod go-w",
                 id="sticky-tmp-like"),
    pytest.param(0, 0o775, "writable by its group,", "chmod go-w", id="group-writable"),
]


# -- the daemon's side ------------------------------------------------------------------------
@pytest.mark.parametrize(("uid", "mode", "why", "fix"), UNSAFE)
def test_daemon_refuses_a_socket_dir_others_can_write(base, uid, mode, why, fix):
    run = make_dir(base / "run", mode, uid)
    path = run / "control.sock"
    srv = ControlServer(str(path), FakeController(), group=None)
    with pytest.raises(ControlError) as e:
        srv.bind()
    assert e.value.kind == "unsafe"
    assert f"{run} is " in str(e.value) and why in str(e.value)
    assert f"fix: {fix} {run}" in str(e.value)          # and says how to fix it
    assert list(run.iterdir()) == []                     # neither the lock nor the socket made


def test_daemon_refuses_when_a_directory_above_is_unsafe(base):
    """A safe directory inside one everybody can write (not sticky): its name can be swapped
    for another directory holding another socket."""
    open_dir = make_dir(base / "open", 0o777)
    make_dir(open_dir / "run", 0o755)
    with pytest.raises(ControlError, match=f"{open_dir} is writable by its group and all users"):
        ControlServer(str(open_dir / "run" / "control.sock"), FakeController(),
                      group=None).bind()


def test_a_sticky_directory_above_is_fine_when_the_entry_is_trusted(base):
    """/tmp-like: others can't rename or remove root's entry in a sticky directory, so root's
    0755 directory there is safe; nobody's directory there isn't."""
    tmp = make_dir(base / "tmp", 0o1777)
    make_dir(tmp / "root-run", 0o755)
    srv = ControlServer(str(tmp / "root-run" / "control.sock"), FakeController(), group=None)
    srv.start()
    try:
        assert call(srv.path, "reload") == {"reloaded": True}
    finally:
        srv.stop()
    make_dir(tmp / "nobody-run", 0o755, NOBODY)
    with pytest.raises(ControlError, match=f"{tmp / 'nobody-run'} is owned by uid 65534"):
        ControlServer(str(tmp / "nobody-run" / "control.sock"), FakeController(),
                      group=None).bind()


def test_a_symlink_another_user_planted_is_refused(base):
    """nobody's symlink in a sticky directory, pointing at root's safe directory: the target
    passes, but nobody can point the link elsewhere at any time."""
    tmp = make_dir(base / "tmp", 0o1777)
    safe = make_dir(base / "safe", 0o755)
    link = tmp / "run"
    link.symlink_to(safe)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ControlError, match=f"{link} is owned by uid 65534"):
        ControlServer(str(link / "control.sock"), FakeController(), group=None).bind()
    # root's own symlink there (like /var/run -> /run) is fine
    os.lchown(link, 0, 0)
    assert socket_dir_problem(str(link / "control.sock")) is None


def test_the_service_users_runtime_directory_is_accepted(base, monkeypatch):
    """What RuntimeDirectory=wagent gives: /run/wagent owned by the service's user, 0750.
    nobody stands in for the `wagent` user, which this machine may not have."""
    run = make_dir(base / "run", 0o750, NOBODY)
    path = str(run / "control.sock")
    assert "owned by uid 65534" in (socket_dir_problem(path) or "")
    monkeypatch.setattr(ownership, "SERVICE_USER", "nobody")
    assert socket_dir_problem(path) is None
    srv = ControlServer(path, FakeController(), group=None)
    srv.start()
    srv.stop()


def test_missing_directories_are_made_0755_whatever_the_umask(base):
    """Under umask 000 (the CLI run by hand) the directories the daemon makes for its socket
    must not come out world-writable, the parents included."""
    old = os.umask(0)
    try:
        srv = ControlServer(str(base / "a" / "b" / "control.sock"), FakeController(),
                            group=None)
        srv.bind()
    finally:
        os.umask(old)
    try:
        for d in (base / "a", base / "a" / "b"):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o755, d
    finally:
        srv.stop()


# -- the client's side ------------------------------------------------------------------------
@pytest.mark.parametrize(("uid", "mode", "why", "fix"), UNSAFE[:3])
def test_client_refuses_a_socket_in_a_dir_others_can_write(base, uid, mode, why, fix):
    run = make_dir(base / "run", mode, uid)
    with Impostor(run / "control.sock") as impostor:
        for cmd in ("reload", "pause", "status"):
            with pytest.raises(ControlError) as e:
                call(str(run / "control.sock"), cmd)
            assert e.value.kind == "unsafe" and f"{run} is " in str(e.value) \
                and why in str(e.value)
        assert impostor.heard() == []


def test_client_refuses_an_answer_from_another_user(base):
    """The directory is safe now, but the socket in it is served by nobody (swapped in while
    it wasn't, or handed over): SO_PEERCRED says who listens, and nothing is sent to it."""
    run = make_dir(base / "run", 0o755, NOBODY)
    with Impostor(run / "control.sock") as impostor:
        os.chown(run, 0, 0)
        assert socket_dir_problem(str(run / "control.sock")) is None
        for cmd in ("reload", "pause", "resume", "status"):
            with pytest.raises(ControlError, match="served by uid 65534") as e:
                call(str(run / "control.sock"), cmd)
            assert e.value.kind == "untrusted"
        assert impostor.heard() == []


def test_client_trusts_a_daemon_running_as_the_service_user(base, monkeypatch):
    """The packaged setup: the daemon runs as `wagent` in /run/wagent (wagent's, 0750) and root
    asks. nobody stands in for the service's user."""
    run = make_dir(base / "run", 0o750, NOBODY)
    sock = str(run / "control.sock")
    with Impostor(run / "control.sock") as stand_in:
        with pytest.raises(ControlError, match="owned by uid 65534"):
            call(sock, "reload")               # while nobody isn't the service's user
        monkeypatch.setattr(ownership, "SERVICE_USER", "nobody")
        assert call(sock, "reload")["reloaded"] is True
        assert len(stand_in.heard()) == 1


@pytest.mark.parametrize("swap", ["unsafe-dir", "other-user"])
def test_cli_reload_and_pause_dont_print_success_for_an_impostor(base, capsys, swap):
    from agent.cli import main

    run = make_dir(base / "run", 0o1777 if swap == "unsafe-dir" else 0o755,
                   0 if swap == "unsafe-dir" else NOBODY)
    sock = str(run / "control.sock")
    with Impostor(run / "control.sock") as impostor:
        if swap == "other-user":
            os.chown(run, 0, 0)
        assert main(["reload", "--socket", sock]) == 1
        assert main(["pause", "--socket", sock]) == 1
        out, err = capsys.readouterr()
        assert "reloaded" not in out and "paused" not in out
        assert err.count("not trusting the control socket") == 2
        assert impostor.heard() == []
