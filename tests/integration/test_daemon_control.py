"""The control socket as deployed: mode 0660, and commands that change anything (reload, pause,
resume) only for root or the service's user, checked with SO_PEERCRED; a socket another user
could have replaced is neither served by `wagent run` nor believed by `wagent reload`/`pause`."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    ROOT,
    Impostor,
    start_daemon,
    stop_daemon,
    wagent,
    wait_for_socket,
    write_policy,
)

pytestmark = [pytest.mark.netns, pytest.mark.debian]   # root: to run the client as nobody


@pytest.fixture
def daemon_dir():
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    d = Path(tempfile.mkdtemp(prefix="wagent-ctl-"))
    d.chmod(0o755)   # nobody must be able to reach the socket to be refused by the daemon
    policy = write_policy(d / "policy.yaml", d)
    proc = start_daemon(policy, log=d / "daemon.log")
    try:
        wait_for_socket(d / "control.sock", proc)
        yield d
    finally:
        stop_daemon(proc)
        print((d / "daemon.log").read_text())
        shutil.rmtree(d, ignore_errors=True)


def test_socket_mode_and_nobody_cannot_connect(daemon_dir):
    sock = daemon_dir / "control.sock"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    r = wagent("reload", "--socket", str(sock), user="nobody", group="nogroup")
    assert r.returncode == 1
    assert "permission denied" in r.stderr


def test_peercred_refuses_reload_from_nobody_but_serves_status(daemon_dir):
    sock = daemon_dir / "control.sock"
    sock.chmod(0o666)   # an operator widened the mode: the SO_PEERCRED check still holds
    r = wagent("reload", "--socket", str(sock), user="nobody", group="nogroup")
    assert r.returncode == 1, r
    assert "refused" in r.stderr and "uid 65534" in r.stderr
    r = wagent("status", "--socket", str(sock), user="nobody", group="nogroup")
    assert r.returncode == 0, r
    assert "healthy" in r.stdout
    # root may
    r = wagent("reload", "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    assert "uid 65534" in (daemon_dir / "daemon.log").read_text()


def test_pause_and_resume_for_root_only(daemon_dir):
    from agent.control import ControlError, call

    sock = str(daemon_dir / "control.sock")
    os.chmod(sock, 0o666)
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        sys.executable, "-c",
                        f"from agent.control import call; call({sock!r}, 'pause')"],
                       capture_output=True, text=True, cwd=ROOT, timeout=30,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0 and "forbidden" not in r.stdout and "uid 65534" in r.stderr
    assert call(sock, "status")["daemon"]["paused"] is False
    assert call(sock, "pause") == {"paused": True}
    doc = call(sock, "status")
    assert doc["daemon"]["paused"] is True
    assert call(sock, "resume") == {"paused": False}
    assert call(sock, "status")["daemon"]["paused"] is False
    try:
        call(sock, "no-such-command")
    except ControlError as e:
        assert e.kind == "protocol"


def test_a_second_daemon_refuses_before_touching_anything(daemon_dir):
    """Same control socket as a live daemon: the second `wagent run` exits 1 naming the other
    daemon, before it applies shaping or creates its store, and the first keeps its socket."""
    other = daemon_dir / "other"
    other.mkdir()
    policy = write_policy(other / "policy.yaml", other,
                          control={"socket": str(daemon_dir / "control.sock")},
                          shaping={"enabled": True, "interfaces": ["nosuch0"],
                                   "link_rate": "1gbit", "rate": "1mbit", "ceil": "10mbit",
                                   "pull_ports": [8080]})
    before = os.stat(daemon_dir / "control.sock").st_ino
    res = wagent("run", "--policy", str(policy), timeout=30)
    assert res.returncode == 1 and "another wagent daemon" in res.stderr, res.stderr
    assert "nosuch0" not in res.stderr                 # refused before shaping was tried
    assert not (other / "store").exists() and not (other / "state").exists()
    assert os.stat(daemon_dir / "control.sock").st_ino == before
    assert wagent("status", "--socket", str(daemon_dir / "control.sock")).returncode in (0, 1)


def test_state_and_store_dirs_are_created_with_safe_modes(daemon_dir):
    assert stat.S_IMODE(os.stat(daemon_dir / "state").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(daemon_dir / "store").st_mode) == 0o755


@pytest.fixture
def open_base():
    """A root-owned 0755 directory nobody can reach, for directories others can write."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make directories another user owns")
    d = Path(tempfile.mkdtemp(prefix="wagent-ctl-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("uid", "mode"), [(65534, 0o755), (0, 0o1777), (0, 0o777)],
                         ids=["owned-by-nobody", "sticky-tmp-like", "world-writable"])
def test_run_refuses_a_socket_dir_others_can_write(open_base, uid, mode):
    """`wagent run` exits 1 naming the directory, before it makes its store or state or a
    socket, and before it would apply shaping."""
    run = open_base / "run"
    run.mkdir()
    os.chown(run, uid, uid)
    run.chmod(mode)
    policy = write_policy(open_base / "policy.yaml", open_base,
                          control={"socket": str(run / "control.sock")})
    res = wagent("run", "--policy", str(policy), timeout=30)
    assert res.returncode == 1, res.stderr
    assert "refusing to start" in res.stderr and f"{run} is " in res.stderr, res.stderr
    assert list(run.iterdir()) == []
    assert not (open_base / "store").exists() and not (open_base / "state").exists()


@pytest.mark.parametrize("cmd", ["reload", "pause", "resume"])
def test_root_is_not_told_success_by_an_impostor(open_base, cmd):
    """nobody swapped the daemon's socket while its directory was theirs; the directory is
    root's again, but the socket in it is nobody's: root's `wagent reload` and `pause` fail
    (exit 1), nothing is printed on stdout, and the request never reaches the impostor."""
    run = open_base / "run"
    run.mkdir()
    os.chown(run, 65534, 65534)
    with Impostor(run / "control.sock") as impostor:
        os.chown(run, 0, 0)
        res = wagent(cmd, "--socket", str(run / "control.sock"))
        assert res.returncode == 1, res
        assert res.stdout == ""
        assert "served by uid 65534" in res.stderr, res.stderr
        assert impostor.heard() == []
