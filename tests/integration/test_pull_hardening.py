"""Pulls where something goes wrong at a bad moment: a local blob rotted on disk, a crash between
two steps of landing a file, a server that stalls or compresses, an empty file, a progress callback
that raises. Real servers on loopback, real files."""

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from agent import manifest
from agent.blob_id import blob_id
from agent.policy.model import Source
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, pull_version
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket
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
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    publish(root, "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    modelgen.next_version(root / "m" / "v1", root / "m" / "v2", change_layers=[1],
                          resize={"model.layers.1.self_attn.q_proj.weight": [320, 256]})
    publish_dir(root / "m" / "v2", piece_size=2**20)
    return root


def sha_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_empty_file_is_published_empty(tmp_path):
    root = tmp_path / "o"
    d = root / "m" / "v1"
    d.mkdir(parents=True)
    (d / "empty.txt").write_bytes(b"")
    (d / "data.bin").write_bytes(b"x" * 5000)
    publish_dir(d, piece_size=4096)
    store = Store(tmp_path / "store")
    with LoopbackNginx(root) as ng:
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
    assert (r.path / "empty.txt").read_bytes() == b""
    same_files(r.path, d)


def test_a_rotten_local_blob_is_never_copied_into_a_new_version(origin, tmp_path):
    """Pieces copied from a local blob are verified like fetched ones; a bad one is fetched."""
    store = Store(tmp_path / "store")
    with LoopbackNginx(origin) as ng:
        pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        # Rot a byte in the middle of a piece that v2 copies from a v1 blob.
        v1 = manifest.parse((origin / "m" / "v1" / "manifest.json").read_bytes())
        v2 = manifest.parse((origin / "m" / "v2" / "manifest.json").read_bytes())
        v2_files = {blob_id(f) for f in v2.files}
        v2_pieces = {p.sha256 for f in v2.files if blob_id(f) not in {blob_id(g) for g in v1.files}
                     for p in f.pieces}
        f1, piece = next((f, p) for f in v1.files if blob_id(f) not in v2_files
                         for p in f.pieces if p.sha256 in v2_pieces and p.size > 2)
        blob = store.blob_path(blob_id(f1))
        os.chmod(blob, 0o644)
        with open(blob, "r+b") as f:
            f.seek(piece.offset + piece.size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        r = pull_version([Source(ng.url)], "m", "v2", store, options=FAST, connections=CONNECTIONS)
    assert r.bytes_reused > 0
    same_files(r.path, origin / "m" / "v2")


def test_a_crash_while_landing_a_file_keeps_its_verified_pieces(origin, tmp_path, monkeypatch):
    """Dying between the journal and the move into blobs/ must not cost the whole file."""
    store = Store(tmp_path / "store")
    landed = []

    def crash(self, src, name, size):
        landed.append(name)
        raise OSError(5, "simulated crash while moving into blobs/")

    with FaultyServer(origin) as srv:
        with monkeypatch.context() as mp:
            mp.setattr(Store, "add_blob", crash)
            with pytest.raises(PullError, match="simulated crash"):
                pull_version([Source(srv.url)], "m", "v1", store,
                             options=PullOptions(streams=1, retries=0), connections=CONNECTIONS)
        assert landed
        first = {p for p, _, _ in srv.requests}
        srv.requests.clear()
        r = pull_version([Source(srv.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        again = [p for p, _, _ in srv.requests]
    crashed_path = next(f.name for f in (origin / "m" / "v1").iterdir()
                        if f.is_file() and f.name != "manifest.json"
                        and blob_of(origin / "m" / "v1", f.name) == landed[0])
    assert f"/m/v1/{crashed_path}" in first
    assert f"/m/v1/{crashed_path}" not in again, "the landed file was fetched again"
    same_files(r.path, origin / "m" / "v1")


def test_a_server_compressing_ranges_is_named(origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "gzip") as bad:
        with pytest.raises(PullError, match="Content-Encoding"):
            pull_version([Source(bad.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
    assert not store.installed("m", "v1")


def test_a_body_that_stalls_times_out_and_moves_to_the_mirror(origin, tmp_path):
    store = Store(tmp_path / "store")
    quick = PullOptions(streams=2, retries=1, backoff_base=0.01, read_timeout=0.5,
                        connect_timeout=2)
    with FaultyServer(origin, "stall", times=2) as slow, LoopbackNginx(origin) as good:
        started = time.monotonic()
        r = pull_version([Source(slow.url), Source(good.url)], "m", "v1", store, options=quick,
                         connections=CONNECTIONS)
        assert slow.faults_done >= 1
        assert time.monotonic() - started < 15
    same_files(r.path, origin / "m" / "v1")
    with FaultyServer(origin, "stall") as slow:
        with pytest.raises(PullError, match="timed out"):
            pull_version([Source(slow.url)], "m", "v2", store, options=quick,
                         connections=CONNECTIONS)


def test_a_source_serving_another_size_of_the_file_is_named(origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "other_total") as bad:
        with pytest.raises(PullError, match="serves another version of the file"):
            pull_version([Source(bad.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)


def test_credentials_in_a_source_url_stay_out_of_the_journal(origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "error_500", after=1) as srv:
        url = srv.url.replace("http://", "http://user:s3cr3t@")
        with pytest.raises(PullError):
            pull_version([Source(url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
    journals = list(store.partial.glob("*.journal"))
    assert journals and all("s3cr3t" not in j.read_text() for j in journals)


def test_progress_calls_are_one_at_a_time_and_never_go_backwards(origin, tmp_path):
    store = Store(tmp_path / "store")
    inside, seen, overlaps, flights = [0], [], [], []

    def slow(p):
        inside[0] += 1
        overlaps.append(inside[0] > 1)
        seen.append(p.bytes_done)
        flights.append((p.event, p.bytes_in_flight, p.bytes_done, p.bytes_total))
        time.sleep(0.002)
        inside[0] -= 1

    with LoopbackNginx(origin) as ng:
        pull_version([Source(ng.url)], "m", "v1", store, progress=slow,
                     options=PullOptions(streams=4, request_size=2**16, retries=0),
                     connections=CONNECTIONS)
    assert not any(overlaps) and seen == sorted(seen) and len(seen) > 2
    # Bytes in flight are never negative, never more than what is left, and none at the end.
    assert all(0 <= f <= total - done for _, f, done, total in flights)
    assert flights[-1][:2] == ("done", 0)


def test_a_progress_callback_that_raises_neither_breaks_nor_leaks_the_pull(origin, tmp_path):
    store = Store(tmp_path / "store")
    before = threading.active_count()

    def broken(p):
        raise RuntimeError("the terminal went away")

    with LoopbackNginx(origin) as ng:
        r = pull_version([Source(ng.url)], "m", "v1", store, options=FAST, progress=broken,
                         connections=CONNECTIONS)
    same_files(r.path, origin / "m" / "v1")
    assert threading.active_count() == before


def test_an_interrupt_in_the_progress_loop_leaves_no_stream_running(origin, tmp_path):
    """Ctrl-C lands in the main thread: the streams must be gone before the partial files are
    closed (a stream writing to a closed, reused descriptor would write into another file)."""
    store = Store(tmp_path / "store")

    def interrupt(p):
        if p.event == "progress":
            raise KeyboardInterrupt

    with LoopbackNginx(origin) as ng, pytest.raises(KeyboardInterrupt):
        pull_version([Source(ng.url)], "m", "v1", store, progress=interrupt,
                     bucket=TokenBucket(16_000_000), options=PullOptions(streams=2, retries=0),
                     connections=CONNECTIONS)
    assert not [t for t in threading.enumerate() if t.name.startswith("pull-")]


def test_two_pulls_of_one_version_at_once_leave_one_good_copy(origin, tmp_path):
    store = Store(tmp_path / "store")
    results = []

    def pull():
        try:
            results.append(pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                                        connections=CONNECTIONS))
        except PullError as e:
            results.append(str(e))

    with LoopbackNginx(origin, limit_rate="20m") as ng:
        threads = [threading.Thread(target=pull) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert any(not isinstance(r, str) for r in results), results
        assert all("another pull is already fetching" in r for r in results
                   if isinstance(r, str)), results
        again = pull_version([Source(ng.url)], "m", "v1", store, options=FAST,
                             connections=CONNECTIONS)
    assert again.bytes_fetched == 0
    same_files(again.path, origin / "m" / "v1")


def test_a_symlink_planted_as_a_partial_file_is_never_followed(origin, tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    sha = blob_of(origin / "m" / "v1", SHARD)
    for ext in ("part", "journal"):
        os.symlink(victim, store.partial / f"{sha}.{ext}")
        with LoopbackNginx(origin) as ng, pytest.raises(PullError, match="symbolic link"):
            pull_version([Source(ng.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        for left in store.partial.iterdir():
            left.unlink()
    assert victim.read_bytes() == b"precious"
    assert not store.version_dir("m", "v1").exists()


# A goodput floor that a trickle of 16 bytes per 50 ms (320 B/s) stays far under, judged fast.
TRICKLE = PullOptions(streams=2, retries=1, backoff_base=0.01, read_timeout=5, connect_timeout=2,
                      min_goodput=64 * 1024, goodput_average_over=0.5, goodput_grace=0.5)


def test_a_trickling_source_is_abandoned_for_the_mirror(origin, tmp_path, caplog):
    """Each read gets a few bytes well inside the read timeout; the floor still catches it."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "trickle") as slow, LoopbackNginx(origin) as good:
        started = time.monotonic()
        r = pull_version([Source(slow.url), Source(good.url)], "m", "v1", store, options=TRICKLE,
                         connections=CONNECTIONS)
        took = time.monotonic() - started
        assert slow.faults_done >= 1
    assert took < 10, took
    same_files(r.path, origin / "m" / "v1")
    assert any(f"source {slow.url} sent at most" in m and "trying the next source" in m
               for m in caplog.messages), caplog.messages


def test_a_pull_whose_only_source_trickles_fails_in_bounded_time(origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "trickle") as slow:
        started = time.monotonic()
        with pytest.raises(PullError, match=r"sent at most [\d.]+ \w+/s for [\d.]+ s on "
                                            r"model-0000\d-of-00002\.safetensors bytes \d+\+\d+"):
            pull_version([Source(slow.url)], "m", "v1", store, options=TRICKLE,
                         connections=CONNECTIONS)
        assert time.monotonic() - started < 10
    assert not store.installed("m", "v1")


def test_a_pull_held_slow_by_the_rate_limit_is_not_abandoned(origin, tmp_path):
    """Time waiting for the token bucket isn't the source's slowness: a pull capped far under
    the floor (4 MB/s over 2 streams; floor 64 MiB/s per request) runs to the end."""
    store = Store(tmp_path / "store")
    strict = PullOptions(streams=2, retries=0, read_timeout=5, connect_timeout=2,
                         min_goodput=64 * 2**20, goodput_average_over=0.3, goodput_grace=0.3)
    with LoopbackNginx(origin) as ng:
        started = time.monotonic()
        r = pull_version([Source(ng.url)], "m", "v1", store, options=strict,
                         bucket=TokenBucket(32_000_000), connections=CONNECTIONS)
        took = time.monotonic() - started
    assert took > 1.5, f"the bucket did not hold the pull ({took:.2f} s)"
    same_files(r.path, origin / "m" / "v1")
