"""What a buggy or hostile manifest, a careless umask, a full disk or a power cut must never do to
the store: publish wrong bytes, leave a tree others can write, hold space for ever, or report a
version that a power cut can take back. Real nginx on loopback, real files, loop-mounted ext4."""

import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from agent import manifest
from agent.policy.model import Source
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, StoreFull, pull_version
from agent.store import Store, space
from agent.store.partial import Partial
from tests.pull_helpers import LoopbackNginx, blob_of, publish, publish_dir, same_files

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

pytestmark = pytest.mark.debian

FAST = PullOptions(streams=2, retries=0, backoff_base=0.01, read_timeout=5, connect_timeout=2)
SHARD = "model-00001-of-00002.safetensors"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a file system needs root")


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    publish(root, "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    return root


def claims(root: Path, model: str, version: str, files: dict[str, bytes],
           lie: dict[str, dict]) -> None:
    """Publish ``files`` as model/version, then overwrite fields of its manifest entries."""
    d = root / model / version
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    publish_dir(d, piece_size=2**16)
    doc = json.loads((d / "manifest.json").read_bytes())
    for f in doc["files"]:
        f.update(lie.get(f["path"], {}))
    (d / "manifest.json").write_text(json.dumps(doc))


def real_sha(origin: Path) -> tuple[str, int]:
    m = manifest.parse((origin / "m" / "v1" / "manifest.json").read_bytes())
    f = next(f for f in m.files if f.path == SHARD)
    return f.sha256, f.size


@pytest.mark.parametrize("verify_files", [False, True])
def test_a_manifest_claiming_a_real_files_sha256_never_lends_it_its_bytes(origin, tmp_path,
                                                                          verify_files):
    """Another model's file claims the sha256 of m's shard over bytes of its own (its pieces
    hash right); a second claims it with size 0 and no pieces. m, pulled after both (and after
    they are evicted), is m's own bytes."""
    sha, _ = real_sha(origin)
    root = tmp_path / "o"
    shutil.copytree(origin, root)
    claims(root, "evil", "v1", {"x.bin": b"not the shard" * 5000}, {"x.bin": {"sha256": sha}})
    claims(root, "evil", "v2", {"e.bin": b""}, {"e.bin": {"sha256": sha}})
    store = Store(tmp_path / "store")
    with LoopbackNginx(root) as ng:
        for v in ("v1", "v2"):
            pull_version([Source(ng.url)], "evil", v, store, options=FAST, connections=CONNECTIONS)
        opts = PullOptions(streams=2, retries=0, verify_files=verify_files)
        r = pull_version([Source(ng.url)], "m", "v1", store, options=opts, connections=CONNECTIONS)
        same_files(r.path, origin / "m" / "v1")
        assert r.bytes_fetched > 0
        shutil.rmtree(store.models / "m")
        space.evict(store, keep={"evil": 0, "m": 0}, pins={}, max_size=None, now=time.time())
        r = pull_version([Source(ng.url)], "m", "v1", store, options=opts, connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")


def test_a_larger_claim_never_leaves_trailing_bytes_in_the_real_file(origin, tmp_path):
    """A manifest claims the shard's sha256 with a larger size and a piece no source serves:
    it fails, and the honest pull after it publishes the shard exactly."""
    sha, size = real_sha(origin)
    root = tmp_path / "o"
    shutil.copytree(origin, root)
    d = root / "big" / "v1"
    d.mkdir(parents=True)
    shutil.copy(origin / "m" / "v1" / SHARD, d / SHARD)
    publish_dir(d, piece_size=2**20)
    doc = json.loads((d / "manifest.json").read_bytes())
    f = doc["files"][0]
    f["size"] += 2**20
    f["pieces"].append({"offset": size, "size": 2**20, "sha256": "0" * 64})
    (d / "manifest.json").write_text(json.dumps(doc))
    store = Store(tmp_path / "store")
    with LoopbackNginx(root) as ng:
        with pytest.raises(PullError):
            pull_version([Source(ng.url)], "big", "v1", store, options=FAST,
                         connections=CONNECTIONS)
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")


def test_a_part_file_longer_than_its_file_is_cut_to_size(tmp_path):
    part = tmp_path / f"{'a' * 64}.part"
    part.write_bytes(b"x" * 100)
    p = Partial(tmp_path, "a" * 64, 10, durable=False)
    try:
        assert os.fstat(p.fd).st_size == 10
    finally:
        p.close()


def test_the_store_has_explicit_modes_and_a_swapped_subdirectory_is_not_installed(tmp_path):
    """Under umask 000 nothing in the store is writable by others; a version whose subdirectory
    was swapped for a symlink (with links that read the same) is not installed."""
    root = tmp_path / "o"
    d = root / "m" / "v1"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "w.bin").write_bytes(b"weights" * 1000)
    (d / "top.json").write_bytes(b"{}")
    publish_dir(d, piece_size=4096)
    store = Store(tmp_path / "store")
    old = os.umask(0)
    try:
        with LoopbackNginx(root) as ng:
            r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
    finally:
        os.umask(old)
    for path in [store.root, *store.root.rglob("*")]:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            assert not st.st_mode & 0o022, f"{path} is {oct(st.st_mode)}"
    # An attacker's copy of sub/ whose link reads the same text but lands elsewhere.
    fake = tmp_path / "fake" / "a" / "b"
    fake.mkdir(parents=True)
    os.symlink(os.readlink(r.path / "sub" / "w.bin"), fake / "w.bin")
    os.rename(r.path / "sub", tmp_path / "real-sub")
    os.symlink(fake, r.path / "sub")
    assert store.installed("m", "v1") is None


@contextlib.contextmanager
def small_ext4(tmp_path: Path, mib: int):
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(mib * 2**20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@root_only
def test_a_manifest_claiming_more_than_the_disk_takes_nothing(origin, tmp_path):
    root = tmp_path / "o"
    shutil.copytree(origin, root)
    d = root / "huge" / "v1"
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(b"w")
    publish_dir(d)
    doc = json.loads((d / "manifest.json").read_bytes())
    piece = 2**26
    doc["files"][0].update(size=160 * piece, pieces=[
        {"offset": i * piece, "size": piece, "sha256": "1" * 64} for i in range(160)])
    (d / "manifest.json").write_text(json.dumps(doc))        # 10 GiB
    with small_ext4(tmp_path, 32) as mnt, LoopbackNginx(root) as ng:
        store = Store(mnt / "store")
        store.ensure()
        before = free(mnt)
        with pytest.raises(StoreFull, match="no space left in the store.*`wagent store gc`"):
            pull_version([Source(ng.url)], "huge", "v1", store, options=FAST,
                         connections=CONNECTIONS)
        assert free(mnt) >= before - 2**20
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        same_files(r.path, origin / "m" / "v1")


@root_only
def test_a_failed_preallocation_gives_its_space_back(tmp_path):
    with small_ext4(tmp_path, 16) as mnt:
        before = free(mnt)
        p = Partial(mnt, "b" * 64, 64 * 2**20, durable=False)
        try:
            with pytest.raises(OSError):
                p.preallocate()
            assert os.fstat(p.fd).st_blocks == 0
        finally:
            p.close()
        assert free(mnt) >= before - 2**20


@root_only
def test_a_full_disk_gives_back_stale_partials_and_crash_leftovers(origin, tmp_path):
    """Another version's partial file holds most of the disk (nobody pulls it): the pull that
    needs the space takes it back, and every pull start removes what a crash left."""
    with small_ext4(tmp_path, 16) as mnt, LoopbackNginx(origin) as ng:
        store = Store(mnt / "store")
        store.ensure()
        stale = Partial(store.partial, "c" * 64, 12 * 2**20, durable=False)
        stale.preallocate()
        stale.close()
        leftover = store.model_dir("m") / ".tmp-v0-12345678"
        leftover.mkdir(parents=True)
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        same_files(r.path, origin / "m" / "v1")
        assert not leftover.exists()
        assert not list(store.partial.iterdir())


def test_a_published_version_is_durable_before_the_pull_returns(origin, tmp_path, monkeypatch):
    """The order that makes a version absent or complete after a power cut: each blob's rename
    then an fsync of blobs/; the new tree fsynced before its rename; the model directory
    fsynced after it; and all of it before pull_version returns. (The calls are watched, and
    made for real.)"""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b, **kw):
        events.append(("rename", str(b)))
        return real_rename(a, b, **kw)

    def replace(a, b, **kw):
        events.append(("rename", str(b)))
        return real_replace(a, b, **kw)

    store = Store(tmp_path / "store")
    with LoopbackNginx(origin) as ng:
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        monkeypatch.undo()
    blobs, model_dir, final = str(store.blobs), str(store.model_dir("m")), str(r.path)

    def index(event, start=0):
        return events.index(event, start)

    publish_at = index(("rename", final))
    for name in (blob_of(origin / "m" / "v1", SHARD),):
        landed = index(("rename", f"{blobs}/{name}"))
        assert landed < index(("fsync", blobs), landed) < publish_at
    tmp_synced = [i for i, (kind, path) in enumerate(events)
                  if kind == "fsync" and os.path.basename(path).startswith(".tmp-v1-")]
    assert tmp_synced and max(tmp_synced) < publish_at
    assert index(("fsync", model_dir), publish_at) > publish_at


def test_planning_is_linear_in_the_number_of_pieces(tmp_path):
    """One request may hold thousands of small pieces: CPU for 8x the pieces stays near 8x
    (planning and landing pieces were quadratic in the pieces of a request: 64x)."""
    cpu = {}
    for n in (2_000, 16_000):
        root = tmp_path / f"o{n}"
        d = root / "m" / "v1"
        d.mkdir(parents=True)
        (d / "data.bin").write_bytes(os.urandom(n * 64))
        publish_dir(d, piece_size=64)
        with LoopbackNginx(root) as ng:
            t = time.process_time()
            pull_version([Source(ng.url)], "m", "v1", Store(tmp_path / f"s{n}"),
                         options=PullOptions(streams=1), connections=CONNECTIONS)
            cpu[n] = time.process_time() - t
    assert cpu[16_000] < 20 * cpu[2_000], cpu
