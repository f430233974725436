"""Pulls against real servers on loopback: nginx, and a ranged server with deliberate faults."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.policy.model import Source
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, pull_version
from agent.store import Store
from tests import modelgen
from tests.pull_helpers import (
    FaultyServer,
    LoopbackNginx,
    blob_of,
    publish,
    publish_dir,
    same_files,
)

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

pytestmark = pytest.mark.debian

FAST = PullOptions(streams=2, retries=1, backoff_base=0.01, read_timeout=5, connect_timeout=2)


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    publish(root, "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    modelgen.next_version(root / "m" / "v1", root / "m" / "v2", change_layers=[1, 3],
                          resize={"model.layers.1.self_attn.q_proj.weight": [320, 256]})
    publish_dir(root / "m" / "v2", piece_size=2**20)
    return root


def shard_blobs_absent(store: Store, version_dir: Path) -> None:
    for f in version_dir.glob("*.safetensors"):
        assert not store.has_blob(blob_of(version_dir, f.name))
    assert not store.version_dir("m", version_dir.name).exists()


def test_pull_then_again_transfers_nothing_then_delta(origin, tmp_path):
    store = Store(tmp_path / "store")
    with LoopbackNginx(origin) as ng:
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        assert r.bytes_fetched == r.bytes_total
        same_files(r.path, origin / "m" / "v1")
        sent = ng.bytes_sent()
        again = pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
        assert again.bytes_fetched == 0 and ng.bytes_sent() == sent
        r2 = pull_version([Source(ng.url)], "m", "latest", store, options=FAST,
                          connections=CONNECTIONS)
        assert r2.version == "v2"
        same_files(r2.path, origin / "m" / "v2")
        assert r2.bytes_reused > 0
        assert r2.bytes_fetched < r2.bytes_total / 2
        overhead = (origin / "m" / "v2" / "manifest.json").stat().st_size + len("v2\n")
        assert ng.bytes_sent() - sent == r2.bytes_fetched + overhead


FAULT_MESSAGES = {
    "more": "Content-Length",
    "fewer": "body ended|connection broke",
    "bad_range": "Content-Range",
    "full_200": "answered 200",
    "corrupt": "do not match their sha256",
    "error_500": "HTTP 500",
}


@pytest.mark.parametrize("fault", sorted(FAULT_MESSAGES))
def test_a_misbehaving_source_never_reaches_a_published_file(fault, origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, fault) as bad:
        with pytest.raises(PullError, match=FAULT_MESSAGES[fault]):
            pull_version([Source(bad.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        assert bad.faults_done > 0
    shard_blobs_absent(store, origin / "m" / "v1")
    # With a mirror behind it, each bad piece is fetched from the mirror instead.
    with FaultyServer(origin, fault, times=3) as bad, LoopbackNginx(origin) as good:
        r = pull_version([Source(bad.url), Source(good.url)], "m", "v1", store, options=FAST,
                         connections=CONNECTIONS)
        assert bad.faults_done >= 1
    same_files(r.path, origin / "m" / "v1")


def test_bytes_beyond_the_range_never_land(origin, tmp_path):
    """A close-delimited body running past the range: only the range is read and verified."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "more_unframed") as bad:
        r = pull_version([Source(bad.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        assert bad.faults_done > 0
    same_files(r.path, origin / "m" / "v1")


def test_etag_change_mid_pull_keeps_the_verified_pieces(origin, tmp_path):
    """An ETag is a hint, each piece's sha256 the authority: a source whose ETag changed while
    its bytes still verify is pulled from without If-Range, and no verified piece is fetched
    again (a file that really changed: tests/integration/test_pull_hostile.py)."""
    store = Store(tmp_path / "store")
    one_piece = PullOptions(streams=1, request_size=1, retries=0, backoff_base=0.01)
    shard = "model-00001-of-00002.safetensors"
    with FaultyServer(origin, "etag_change", fault_on=shard, after=1, times=1) as bad:
        r = pull_version([Source(bad.url)], "m", "v1", store, options=one_piece,
                         connections=CONNECTIONS)
        statuses = [status for path, _, status in bad.requests if path.endswith(shard)]
    assert statuses[:3] == [206, 200, 206]     # the second carried If-Range: refused, sent again
    assert 200 not in statuses[2:]             # and no If-Range to that source since
    assert r.bytes_fetched == r.bytes_total
    same_files(r.path, origin / "m" / "v1")


def test_bad_manifests_are_refused_before_writing(origin, tmp_path):
    root = tmp_path / "o"
    (root / "m" / "v1").mkdir(parents=True)
    manifest_path = root / "m" / "v1" / "manifest.json"
    good = (origin / "m" / "v1" / "manifest.json").read_text()
    cases = {
        good.replace('"path": "config.json"', '"path": "../../evil"'): "'..' part",
        good.replace('"path": "config.json"', '"path": "/etc/evil"'): "absolute",
        good[: len(good) // 2]: "not valid JSON",
        "": "not valid JSON",
    }
    with LoopbackNginx(root) as ng:
        for text, msg in cases.items():
            manifest_path.write_text(text)
            store = Store(tmp_path / "store")
            with pytest.raises(PullError, match=msg):
                pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
            assert not list(store.partial.iterdir()) and not list(store.blobs.iterdir())
    assert not (tmp_path / "evil").exists()


def test_a_symlink_in_the_store_is_refused(origin, tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, store.models / "m")
    with LoopbackNginx(origin) as ng, pytest.raises(PullError, match="symlink"):
        pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
    assert os.listdir(elsewhere) == [] and os.listdir(store.partial) == []


def test_a_store_served_by_nginx_is_an_origin(origin, tmp_path):
    cache = Store(tmp_path / "cache")
    with LoopbackNginx(origin) as ng:
        pull_version([Source(ng.url)], "m", "v1", cache, options=FAST, connections=CONNECTIONS)
    node = Store(tmp_path / "node")
    with LoopbackNginx(cache.models) as ng:
        r = pull_version([Source(ng.url)], "m", "v1", node, options=FAST, connections=CONNECTIONS)
        assert ng.bytes_sent() > r.bytes_total
    same_files(r.path, origin / "m" / "v1")


def test_mirror_after_a_dead_source_and_credentials(origin, tmp_path):
    creds = tmp_path / "creds"
    creds.write_text("bearer s3cr3t-token\n")
    store = Store(tmp_path / "store")
    with FaultyServer(origin, auth="Bearer s3cr3t-token") as srv:
        with pytest.raises(PullError, match="HTTP 401") as e:
            pull_version([Source(srv.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        assert "s3cr3t" not in str(e.value)
        dead = Source("http://127.0.0.1:9")            # nothing listens on the discard port
        r = pull_version([dead, Source(srv.url, credentials=str(creds))], "m", "v1", store,
                         options=FAST, connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_fails_clearly_then_resumes(origin, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        store = Store(mnt / "store")
        with LoopbackNginx(origin) as ng:
            with pytest.raises(PullError, match="no space left in the store"):
                pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
            assert store.installed("m", "v1") is None
            assert not store.version_dir("m", "v1").exists()
            subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
            r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
            same_files(r.path, origin / "m" / "v1")
            assert not list(store.partial.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_kill_9_then_resume_refetches_at_most_the_pieces_in_flight(origin, tmp_path):
    store = tmp_path / "store"
    total = sum(f.stat().st_size for f in (origin / "m" / "v1").iterdir()
                if f.name != "manifest.json")
    cmd = [sys.executable, "-m", "agent", "pull", "--store", str(store), "--streams", "2",
           "--piece-size", "1MiB", "--quiet"]
    with LoopbackNginx(origin) as ng:
        p = subprocess.Popen(cmd + [f"{ng.url}/m/v1", "--rate", "40mbit"])    # ~2 s
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and journaled(store) < total / 2:
                time.sleep(0.02)
        finally:
            p.kill()
            p.wait()
        assert p.returncode == -9
        done = journaled(store)
        assert 0 < done < total
        time.sleep(0.2)                                   # nginx logs a request as it ends
        first = files_sent(ng)
        subprocess.run(cmd + [f"{ng.url}/m/v1"], check=True, timeout=60)
        second = files_sent(ng) - first
    refetched = first + second - total
    assert refetched <= 2 * 2**20, (first, second, total)
    same_files(store / "models" / "m" / "v1", origin / "m" / "v1")


def files_sent(ng: LoopbackNginx) -> int:
    return ng.bytes_sent("/m/v1/") - ng.bytes_sent("/m/v1/manifest.json")


def journaled(store: Path) -> int:
    n = 0
    for j in (store / "partial").glob("*.journal"):
        for line in j.read_text().splitlines():
            if line.startswith("piece "):
                n += int(line.split()[2])
    for b in (store / "blobs").glob("*"):
        n += b.stat().st_size
    return n


def test_tls_is_verified_and_a_ca_bundle_makes_it_work(origin, tmp_path):
    store = Store(tmp_path / "store")
    with LoopbackNginx(origin, tls=True) as ng:
        with pytest.raises(PullError, match="TLS verification failed"):
            pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        r = pull_version([Source(ng.url, ca_bundle=ng.ca_bundle)], "m", "v1", store,
                         options=FAST, connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")


def test_a_source_behind_an_http_proxy(origin, tmp_path):
    store = Store(tmp_path / "store")
    with LoopbackNginx(origin) as ng, LoopbackNginx(tmp_path, forward_proxy=True) as proxy:
        r = pull_version([Source(ng.url, proxy=proxy.url)], "m", "v1", store, options=FAST,
                         connections=CONNECTIONS)
        assert proxy.bytes_sent() >= r.bytes_total
    same_files(r.path, origin / "m" / "v1")


def test_a_source_that_ignores_range_is_dropped_on_its_first_200(origin, tmp_path, caplog):
    """One message for the pull (not one per piece and retry), and the mirror takes over."""
    store = Store(tmp_path / "store")
    opts = PullOptions(streams=2, retries=3, backoff_base=0.01, read_timeout=5)
    with FaultyServer(origin, "full_200") as bad:
        with pytest.raises(PullError, match="ignores Range") as e:
            pull_version([Source(bad.url)], "m", "v1", store, options=opts, connections=CONNECTIONS)
        assert str(e.value).count("ignores Range") <= 2          # once per stream at most
        assert bad.faults_done <= 2 * opts.streams
    caplog.clear()
    with FaultyServer(origin, "full_200") as bad, LoopbackNginx(origin) as good:
        r = pull_version([Source(bad.url), Source(good.url)], "m", "v1", store, options=opts,
                         connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")
    assert sum("ignores Range" in m for m in caplog.messages) == 1


def test_a_whole_file_answer_is_taken_when_the_request_is_the_whole_file(tmp_path):
    root = tmp_path / "o"
    d = root / "m" / "v1"
    d.mkdir(parents=True)
    (d / "small.bin").write_bytes(b"s" * 3000)
    publish_dir(d, piece_size=4096)                     # one piece: one request, the whole file
    with FaultyServer(root, "full_200", fault_on=r"small\.bin$") as srv:
        r = pull_version([Source(srv.url)], "m", "v1", Store(tmp_path / "store"), options=FAST,
                         connections=CONNECTIONS)
        assert srv.faults_done == 1
    same_files(r.path, d)
