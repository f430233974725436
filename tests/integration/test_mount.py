"""`wagent mount`: a real FUSE mount, made by the root CLI and served by a running daemon,
read by a client this project did not write (safetensors' ``safe_open``, which mmaps) while the
version is still being pulled from a slow nginx origin; every tensor equals the origin's, and the
store holds the complete version afterwards. Bad requests leave nothing mounted.

Every mount the test makes (the binds, the daemon's root mount) is removed, even on failure."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent.commands.mount import mount_root
from agent.mount.kernel import mount_at, unmount
from agent.mount.service import FD_NAME
from tests.daemon_helpers import (
    ROOT,
    WAGENT,
    start_daemon,
    stop_daemon,
    wagent,
    wait_for_socket,
    write_policy,
)
from tests.pull_helpers import FaultyServer, LoopbackNginx, publish

# debian: the daemon serves the mount with Debian's pyfuse3 3.2.1 and trio 0.22 too (the
# safetensors test alone needs the venv: Debian 12 packages no safetensors)
pytestmark = [pytest.mark.netns, pytest.mark.debian]

MODEL = "lazy"


def _cleanup_mounts(paths: list[str]) -> None:
    for p in paths:
        while mount_at(p) is not None:
            unmount(p, lazy=True)


@contextlib.contextmanager
def daemon(d: Path, sources: list[str], **sections: object):
    """A daemon following MODEL from ``sources`` whose wave is hours away (only a mount makes
    it pull); yields its socket and two empty directories; every mount goes at the end."""
    name = f"run{len(list(d.glob('run*')))}"
    run = d / name
    run.mkdir()
    sock = run / "control.sock"
    policy = write_policy(run / "policy.yaml", run, sources=[{"url": u} for u in sources],
                          models=[{"name": MODEL, "version": "latest"}],
                          waves={"cache_lead": "6h"}, **sections)
    proc = start_daemon(policy, log=run / "daemon.log")
    dirs = [str(run / "a"), str(run / "b")]
    for m in dirs:
        os.mkdir(m)
    try:
        wait_for_socket(sock, proc)
        yield sock, dirs
    finally:
        for m in dirs:
            wagent("umount", "--lazy", m, "--socket", str(sock))
        _cleanup_mounts([*dirs, mount_root(str(sock))])
        stop_daemon(proc)
        print((run / "daemon.log").read_text()[-6000:])


@pytest.fixture
def origin():
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    d = Path(tempfile.mkdtemp(prefix="wagent-mount-"))
    d.chmod(0o755)
    # 8 layers of 512: about 70 MB in 4 shards; pieces of at most 4 MiB
    version_dir = publish(d / "origin", MODEL, "v1", piece_size=4 * 2**20, layers=8,
                          hidden=512, shards=4)
    try:
        yield d, version_dir
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def bed(origin):
    d, version_dir = origin
    # 8 streams at 1 MB/s each: the pull takes about 9 s, and every read below comes before
    # its last byte
    with LoopbackNginx(d / "origin", limit_rate="1m") as nginx, \
            daemon(d, [nginx.url]) as (sock, dirs):
        yield d, sock, version_dir, dirs


def _status(sock: Path) -> dict:
    r = wagent("status", "--json", "--socket", str(sock))
    return json.loads(r.stdout)


def test_safe_open_reads_every_tensor_while_the_pull_runs(bed):
    safetensors = pytest.importorskip("safetensors")
    d, sock, version_dir, (a, _) = bed
    started = time.monotonic()
    r = wagent("mount", MODEL, a, "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    info = mount_at(a)
    assert info is not None and info.fstype == "fuse.wagent" and "ro" in info.options.split(",")
    # the listing answers from the manifest, before a byte is pulled
    names = sorted(os.listdir(a))
    assert names == sorted(p.name for p in version_dir.iterdir() if p.name != "manifest.json")
    first_tensor = None
    t_mount = time.monotonic() - started
    shards = sorted(version_dir.glob("*.safetensors"))
    for shard in shards:
        with safetensors.safe_open(str(Path(a) / shard.name), framework="numpy") as got, \
                safetensors.safe_open(str(shard), framework="numpy") as want:
            assert sorted(got.keys()) == sorted(want.keys())
            for key in want.keys():
                # bytes, not values: generated float16 data holds NaNs, never equal to themselves
                assert got.get_tensor(key).tobytes() == want.get_tensor(key).tobytes(), key
                if first_tensor is None:
                    first_tensor = time.monotonic() - started
    config = json.loads((Path(a) / "config.json").read_text())
    assert config["num_hidden_layers"] == 8
    read_all = time.monotonic() - started
    print(f"mounted after {t_mount:.2f} s, first tensor {first_tensor:.2f} s, "
          f"every tensor {read_all:.2f} s")
    doc = _status(sock)
    (row,) = doc["mounts"]["mounts"]
    assert row["model"] == MODEL and row["version"] == "v1" and row["dirs"] == [a]
    assert doc["mounts"]["reads"] > 0 and doc["mounts"]["read_errors"] == 0
    # The reads came before the pull ended (else this proves nothing about laziness).
    assert doc["mounts"]["wanted"] > 0, doc["mounts"]
    # The background pull completes the version in the store.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _status(sock)["mounts"]["mounts"][0]["complete"]:
        time.sleep(0.5)
    from agent.store import Store
    store = Store(sock.parent / "store").version_dir(MODEL, "v1")
    for f in version_dir.rglob("*"):
        if f.is_file():
            assert (store / f.relative_to(version_dir)).read_bytes() == f.read_bytes(), f
    # ...and reads are then served from the blobs
    with open(Path(a) / shards[-1].name, "rb") as f:
        assert f.read() == shards[-1].read_bytes()
    r = wagent("umount", a, "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    assert mount_at(a) is None
    assert mount_at(mount_root(str(sock))) is None      # the last one: the root went too
    assert _status(sock)["mounts"]["mounts"] == []


def test_runai_model_streamer_reads_every_tensor_while_the_pull_runs(bed):
    """runai-model-streamer (its own native reader, many threads) on the mounted path."""
    streamer = pytest.importorskip("runai_model_streamer")
    st = pytest.importorskip("safetensors.numpy")
    d, sock, version_dir, (a, _) = bed
    r = wagent("mount", MODEL, a, "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    n = 0
    for shard in sorted(version_dir.glob("*.safetensors")):
        want = st.load_file(str(shard))
        with streamer.SafetensorsStreamer() as s:
            s.stream_file(str(Path(a) / shard.name))
            for name, tensor in s.get_tensors():
                assert tensor.numpy().tobytes() == want[name].tobytes(), name
                n += 1
    assert n == sum(len(st.load_file(str(f))) for f in version_dir.glob("*.safetensors"))
    doc = _status(sock)["mounts"]
    assert doc["wanted"] > 0 and doc["read_errors"] == 0, doc


def test_bad_requests_leave_nothing_mounted(bed):
    d, sock, _, (a, b) = bed
    cases = [
        (("mount", "nosuch", a), "unknown model"),
        (("mount", f"{MODEL}@v9", a), "neither the version the policy wants"),
        (("mount", MODEL, str(d / "missing")), "does not exist"),
        (("mount", MODEL, str(sock.parent / "policy.yaml")), "is not a directory"),
    ]
    (d / "full").mkdir()
    (d / "full" / "x").write_text("x")
    cases.append((("mount", MODEL, str(d / "full")), "not empty"))
    for args, words in cases:
        r = wagent(*args, "--socket", str(sock))
        assert r.returncode == 1 and words in r.stderr, (args, r.stderr)
    assert mount_at(a) is None
    # a second mount on the same directory
    r = wagent("mount", MODEL, a, "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    r = wagent("mount", MODEL, a, "--socket", str(sock))
    assert r.returncode == 1 and "mount point already" in r.stderr
    # not root
    r = wagent("mount", MODEL, b, "--socket", str(sock), user="nobody", group="nogroup")
    assert r.returncode == 1 and "root" in r.stderr
    assert mount_at(b) is None
    # no daemon
    r = wagent("mount", MODEL, b, "--socket", str(d / "nothing.sock"))
    assert r.returncode == 1 and "not running" in r.stderr
    assert mount_at(b) is None
    # umount of something that isn't one
    r = wagent("umount", b, "--socket", str(sock))
    assert r.returncode == 1 and "not a `wagent mount`" in r.stderr
    assert len(_status(sock)["mounts"]["mounts"]) == 1


def _read_all(directory: str, version_dir: Path) -> None:
    for f in sorted(version_dir.iterdir()):
        if f.name != "manifest.json":
            assert (Path(directory) / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_corrupt_source_never_reaches_a_reader(origin):
    """Every piece from the first source is corrupt: the reads wait for the mirror's."""
    d, version_dir = origin
    with FaultyServer(d / "origin", fault="corrupt") as bad, \
            LoopbackNginx(d / "origin", limit_rate="4m") as good, \
            daemon(d, [bad.url, good.url]) as (sock, (a, _)):
        r = wagent("mount", MODEL, a, "--socket", str(sock))
        assert r.returncode == 0, r.stderr
        _read_all(a, version_dir)
        assert bad.faults_done > 0          # the reads did meet corrupt pieces
        assert _status(sock)["mounts"]["read_errors"] == 0


def test_a_read_fails_with_eio_at_the_deadline_when_no_source_is_good(origin):
    d, version_dir = origin
    with FaultyServer(d / "origin", fault="corrupt") as bad, \
            daemon(d, [bad.url], mounts={"read_deadline": "3s"}) as (sock, (a, _)):
        r = wagent("mount", MODEL, a, "--socket", str(sock))
        assert r.returncode == 0, r.stderr
        shard = sorted(version_dir.glob("*.safetensors"))[0]
        # small files are not faulted: they read
        assert (Path(a) / "config.json").read_bytes() == (version_dir / "config.json").read_bytes()
        started = time.monotonic()
        with pytest.raises(OSError) as e:
            (Path(a) / shard.name).read_bytes()
        assert e.value.errno == errno.EIO
        assert 2.5 < time.monotonic() - started < 30
        doc = _status(sock)["mounts"]
        assert doc["read_errors"] >= 1
        assert "not verified within 3 s" in doc["errors"][-1]["error"], doc["errors"]


class FdStore:
    """systemd's side of the notify socket, as far as the fd store goes: keeps the descriptors
    sent with FDSTORE=1, by FDNAME."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.fds: dict[str, int] = {}

    def wait_for(self, name: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while name not in self.fds:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 4096, 4)
            except TimeoutError:
                raise AssertionError(f"no FDSTORE {name} within {timeout} s") from None
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if fields.get("FDSTORE") == "1" and fds:
                self.fds[fields.get("FDNAME", "stored")] = fds[0]
            else:
                for fd in fds:
                    os.close(fd)
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


READER = """
import sys
from pathlib import Path
mount, origin = Path(sys.argv[1]), Path(sys.argv[2])
for f in sorted(origin.iterdir()):
    if f.name == "manifest.json":
        continue
    with open(mount / f.name, "rb") as got:
        data = b"".join(iter(lambda: got.read(1 << 20), b""))
    assert data == f.read_bytes(), f.name
print("read", flush=True)
"""


AS_SYSTEMD = f"""
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3, inheritable=True)
os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="{FD_NAME}")
os.execv(sys.argv[2], sys.argv[2:])
"""


def test_the_mount_and_its_reader_outlive_a_kill_9_of_the_daemon(origin):
    """The descriptor waits in the fd store (as systemd's) while the daemon is killed and
    started again; the reader reading meanwhile ends with every byte right."""
    d, version_dir = origin
    run = d / "restart"
    run.mkdir()
    store = FdStore(run / "notify.sock")
    sock = run / "control.sock"
    a = run / "a"
    a.mkdir()
    with LoopbackNginx(d / "origin", limit_rate="1m") as nginx:
        policy = write_policy(run / "policy.yaml", run, sources=[{"url": nginx.url}],
                              models=[{"name": MODEL, "version": "latest"}],
                              waves={"cache_lead": "6h"})
        env = {"NOTIFY_SOCKET": str(store.path)}
        procs = [start_daemon(policy, env=env, log=run / "daemon.log")]
        reader = None
        try:
            wait_for_socket(sock, procs[0])
            r = wagent("mount", MODEL, str(a), "--socket", str(sock))
            assert r.returncode == 0, r.stderr
            fd = store.wait_for(FD_NAME)
            reader = subprocess.Popen([sys.executable, "-c", READER, str(a), str(version_dir)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(1.5)                 # it reads pieces the pull hasn't fetched yet
            assert reader.poll() is None, reader.communicate()
            procs[0].kill()                 # kill -9: no clean stop
            procs[0].wait()
            time.sleep(1.0)                 # the reader waits: no server
            assert reader.poll() is None, reader.communicate()
            # as systemd starts the next process: the stored descriptor as fd 3, LISTEN_*
            # as systemd starts the next process: the stored descriptor as fd 3, LISTEN_*
            procs.append(subprocess.Popen(
                [sys.executable, "-c", AS_SYSTEMD, str(fd), *WAGENT, "run", "--policy",
                 str(policy)],
                pass_fds=(fd,), cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                stdout=open(run / "daemon2.log", "ab"), stderr=subprocess.STDOUT))
            out, err = reader.communicate(timeout=120)
            assert reader.returncode == 0 and "read" in out, err
            assert "took over the mount (1 versions shown)" in (run / "daemon2.log").read_text()
        finally:
            if reader is not None and reader.poll() is None:
                reader.kill()
            wagent("umount", "--lazy", str(a), "--socket", str(sock))
            _cleanup_mounts([str(a), mount_root(str(sock))])
            for p in procs:
                stop_daemon(p)
            store.close()
            for log in ("daemon.log", "daemon2.log"):
                if (run / log).exists():
                    print(log, (run / log).read_text()[-4000:])


def test_a_waiting_reader_lifts_the_pull_over_other_traffic(origin, testbed):
    """``mounts.read_floor``: an iperf3 flow fills the node's link (a port no policy names), the
    daemon backs off to its floor (0.2% of 100 Mbit/s: 25 kB/s, where the first tensor's 4 MiB
    piece would take minutes); a reader of the mount lifts the pull to half the link while it
    waits, and gets its tensor in seconds. Status and the journal say why."""
    safetensors = pytest.importorskip("safetensors")
    from tests.testbed import WAGENT as NODE_WAGENT
    d, version_dir = origin
    o, n = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(o, n, rate="100mbit")
    srv = testbed.nginx(o, root=d / "origin", port=8080)
    testbed.iperf3_server(o, port=5201)
    run = d / "lift"
    run.mkdir()
    sock, a = run / "control.sock", str(run / "a")
    os.mkdir(a)
    policy = write_policy(run / "policy.yaml", run, sources=[{"url": srv.url_for(link.a)}],
                          models=[{"name": MODEL, "version": "latest"}],
                          waves={"cache_lead": "6h"},
                          shaping={"interfaces": [link.b.ifname], "link_rate": "100mbit"})
    log = run / "daemon.log"
    with open(log, "ab") as out:
        proc = n.popen([NODE_WAGENT, "run", "--policy", str(policy)], stdout=out,
                       stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        wait_for_socket(sock, proc)
        flow = testbed.iperf3_start(n, server=link.a.ip4, port=5201, seconds=40, reverse=True)
        deadline = time.monotonic() + 15
        while _status(sock).get("backoff", {}).get("state") != "backed_off":
            assert time.monotonic() < deadline, _status(sock).get("backoff")
            time.sleep(0.2)
        shard = sorted(version_dir.glob("*.safetensors"))[0]
        with safetensors.safe_open(str(shard), framework="numpy") as want:
            key = sorted(want.keys())[0]
            expected = want.get_tensor(key).tobytes()
        started = time.monotonic()
        r = wagent("mount", MODEL, a, "--socket", str(sock))
        assert r.returncode == 0, r.stderr
        with safetensors.safe_open(str(Path(a) / shard.name), framework="numpy") as got:
            assert got.get_tensor(key).tobytes() == expected
        took = time.monotonic() - started
        print(f"first tensor {took:.2f} s after `wagent mount`, the flow running")
        # at the floor the tensor's piece alone would take over 2 minutes
        assert took < 30, took
        assert "a reader of a mount waits" in log.read_text()
        assert flow.proc.poll() is None          # the other traffic ran throughout
    finally:
        wagent("umount", "--lazy", a, "--socket", str(sock))
        _cleanup_mounts([a, mount_root(str(sock))])
        stop_daemon(proc)
        print(log.read_text()[-6000:])


def test_a_complete_version_is_bound_from_the_store_and_outlives_a_restart(origin):
    """A version the store holds whole is bound from the store's view (hard links to its
    blobs): no FUSE mount, the blobs' own inodes, every byte the origin's. A restart shows it
    again with no fd store; the last unmount removes the view."""
    d, version_dir = origin
    run = d / "whole"
    run.mkdir()
    sock, a, b = run / "control.sock", run / "a", run / "b"
    a.mkdir()
    b.mkdir()
    with LoopbackNginx(d / "origin") as nginx:
        r = wagent("pull", f"{nginx.url}/{MODEL}/v1", "--store", str(run / "store"),
                   timeout=120)
        assert r.returncode == 0, r.stderr
        policy = write_policy(run / "policy.yaml", run, sources=[{"url": nginx.url}],
                              models=[{"name": MODEL, "version": "latest"}],
                              waves={"cache_lead": "6h"})
        procs = [start_daemon(policy, log=run / "daemon.log")]
        view = run / "store" / "views" / f"{MODEL}@v1"
        try:
            wait_for_socket(sock, procs[0])
            for m in (a, b):
                r = wagent("mount", MODEL, str(m), "--socket", str(sock))
                assert r.returncode == 0, r.stderr
                assert "from the store" in r.stdout
                info = mount_at(str(m))
                assert info is not None and info.fstype != "fuse.wagent", info
                assert "ro" in info.options.split(","), info
            assert mount_at(mount_root(str(sock))) is None      # no FUSE mount at all
            names = sorted(p.name for p in version_dir.iterdir() if p.name != "manifest.json")
            assert sorted(os.listdir(a)) == names
            store_dir = run / "store" / "models" / MODEL / "v1"
            for n in names:
                assert (a / n).read_bytes() == (version_dir / n).read_bytes(), n
                assert os.stat(a / n).st_ino == os.stat(store_dir / n).st_ino   # the blob
            (row,) = _status(sock)["mounts"]["mounts"]
            assert row["from"] == "store" and row["complete"] and row["dirs"] == [str(a), str(b)]
            # a restart with no fd store: the binds stay, the daemon shows them again
            stop_daemon(procs[0])
            procs.append(start_daemon(policy, log=run / "daemon2.log"))
            wait_for_socket(sock, procs[1])
            (row,) = _status(sock)["mounts"]["mounts"]
            assert row["from"] == "store" and row["dirs"] == [str(a), str(b)], row
            assert (b / names[0]).read_bytes() == (version_dir / names[0]).read_bytes()
            r = wagent("umount", str(a), "--socket", str(sock))
            assert r.returncode == 0, r.stderr
            assert view.is_dir()                        # b still shows it
            r = wagent("umount", str(b), "--socket", str(sock))
            assert r.returncode == 0, r.stderr
            assert not view.exists() and _status(sock)["mounts"]["mounts"] == []
            assert (store_dir / names[0]).read_bytes() == (version_dir / names[0]).read_bytes()
        finally:
            for m in (a, b):
                wagent("umount", "--lazy", str(m), "--socket", str(sock))
            _cleanup_mounts([str(a), str(b), mount_root(str(sock))])
            for p in procs:
                stop_daemon(p)
            for log in ("daemon.log", "daemon2.log"):
                if (run / log).exists():
                    print(log, (run / log).read_text()[-4000:])
