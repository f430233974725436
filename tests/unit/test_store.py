import hashlib
import json
import os

import pytest

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece, to_json
from agent.store import Store, StoreError, space


def entry(path, data):
    sha = hashlib.sha256(data).hexdigest()
    return FileEntry(path, len(data), sha, (Piece(0, len(data), sha),) if data else ())


def bid(data):
    """The blob id of ``data`` as a file of one piece."""
    return blob_id(entry("x", data))


def put_version(store, model, version, files, published="2026-12-02T11:00:00Z", now=0.0):
    """Install a version the way a pull does: blobs first, then publish."""
    entries = []
    for path, data in files.items():
        e = entry(path, data)
        if not store.has_blob(blob_id(e)):
            tmp = store.partial / f"{blob_id(e)}.part"
            tmp.write_bytes(data)
            store.add_blob(tmp, blob_id(e), len(data))
        entries.append(e)
    m = Manifest(model, version, published, tuple(entries))
    return store.publish(m, to_json(m), now)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.ensure()
    return s


def test_publish_builds_relative_symlinks_and_keeps_manifest(store):
    d = put_version(store, "m", "v1", {"a/b.bin": b"hello", "c.json": b"{}"})
    assert (d / "a" / "b.bin").read_bytes() == b"hello"
    assert not os.path.isabs(os.readlink(d / "a" / "b.bin"))
    assert json.loads((d / "manifest.json").read_bytes())["version"] == "v1"
    assert store.installed("m", "v1") is not None
    assert [v.version for v in store.versions("m")] == ["v1"]
    assert not [n for n in os.listdir(store.model_dir("m")) if n.startswith(".")]
    # Publishing again is a no-op.
    assert put_version(store, "m", "v1", {"a/b.bin": b"hello", "c.json": b"{}"}) == d


def test_piece_index_points_into_blobs(store):
    put_version(store, "m", "v1", {"x": b"abc"})
    sha = hashlib.sha256(b"abc").hexdigest()
    assert store.piece_index() == {sha: (bid(b"abc"), 0)}


def test_missing_blob_means_not_installed(store):
    put_version(store, "m", "v1", {"x": b"abc"})
    os.unlink(store.blob_path(bid(b"abc")))
    assert store.installed("m", "v1") is None


def test_symlinks_in_the_store_are_refused(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, store.models / "m")
    with pytest.raises(StoreError, match="symlink"):
        store.check_writable("m", "v1")
    os.unlink(store.models / "m")
    (store.models / "m").mkdir()
    os.symlink(elsewhere, store.models / "m" / "v1")
    with pytest.raises(StoreError, match="symlink"):
        store.check_writable("m", "v1")
    assert os.listdir(elsewhere) == []


def test_evict_removes_versions_and_blobs_and_reports(store):
    put_version(store, "m", "v1", {"x": b"old", "s": b"shared"}, "2026-01-01T00:00:00Z", now=1)
    put_version(store, "m", "v2", {"x": b"mid", "s": b"shared"}, "2026-02-01T00:00:00Z", now=2)
    put_version(store, "m", "v3", {"x": b"new", "s": b"shared"}, "2026-03-01T00:00:00Z", now=3)
    before = store.usage()
    removed = space.evict(store, keep=1, pins={"m": ["v1"]}, max_size=None, now=10)
    assert [(r.kind, r.name) for r in removed] == [
        ("version", "m/v2"), ("blob", bid(b"mid"))]
    assert [v.version for v in store.versions("m")] == ["v3", "v1"]
    assert store.usage() < before
    assert store.installed("m", "v1") and store.installed("m", "v3")


def test_evict_is_deferred_while_a_pull_holds_the_store(store):
    put_version(store, "m", "v1", {"x": b"a"}, "2026-01-01T00:00:00Z")
    put_version(store, "m", "v2", {"x": b"b"}, "2026-02-01T00:00:00Z")
    with store.pull_lock():
        assert space.evict(store, keep=1, pins={}, max_size=None, now=10) == []
    assert len(space.evict(store, keep=1, pins={}, max_size=None, now=10)) == 2


def test_touch_orders_lru(store):
    put_version(store, "m", "v1", {"x": b"a"}, "2026-01-01T00:00:00Z", now=5)
    store.touch("m", "v1", 50)
    assert store.versions("m")[0].last_used == 50


def test_journal_survives_reopen_and_ignores_torn_lines(tmp_path):
    from agent.store.partial import Partial, PartialBusy
    p = Partial(tmp_path, "f" * 64, 100, durable=False)
    p.write(0, b"x" * 10)
    p.record_etag("http://o", '"abc"')
    p.record_piece(0, 10, "a" * 64)
    with pytest.raises(PartialBusy):
        Partial(tmp_path, "f" * 64, 100)
    p.close()
    with open(p.journal_path, "a") as f:
        f.write("piece 10 10 ")                       # torn by a power cut
    q = Partial(tmp_path, "f" * 64, 100)
    assert q.done == {0: (10, "a" * 64)} and q.etags == {"http://o": '"abc"'}
    q.close()
    os.unlink(q.part_path)                           # journal without its part: trust nothing
    r = Partial(tmp_path, "f" * 64, 100)
    assert r.done == {} and r.etags == {"http://o": '"abc"'}
    r.close()
    s = Partial(tmp_path, "f" * 64, 200)              # another size: another file, start over
    assert s.done == {} and s.etags == {}
    s.close()


def test_publish_replaces_a_broken_version_directory(store, tmp_path):
    """A version directory that is a symlink, or lost a file, is not "installed": publishing
    puts a good one in its place instead of reporting success over it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.model_dir("m").mkdir()
    os.symlink(elsewhere, store.version_dir("m", "v1"))
    d = put_version(store, "m", "v1", {"a": b"1", "b/c": b"2"})
    assert not os.path.islink(d) and (d / "b" / "c").read_bytes() == b"2"
    assert os.listdir(elsewhere) == []
    os.unlink(d / "b" / "c")
    assert store.installed("m", "v1") is None
    put_version(store, "m", "v1", {"a": b"1", "b/c": b"2"})
    assert store.installed("m", "v1") is not None
    assert not [n for n in os.listdir(store.model_dir("m")) if n.startswith(".")]


def test_evict_cleans_what_crashes_leave(store):
    put_version(store, "m", "v1", {"x": b"a"})
    (store.model_dir("m") / ".tmp-v2-12345678").mkdir()
    (store.model_dir("m") / ".tmp-v2-12345678" / "f").write_text("x")
    (store.model_dir("m") / ".trash-v0-12345678").mkdir()
    (store.root / ".usage.json.tmp-12345678").write_text("{}")
    landed = bid(b"a")
    (store.partial / f"{landed}.journal").write_text("stale")      # crash after the move
    old, fresh = "1" * 64, "2" * 64
    for sha, mtime in ((old, 1000.0), (fresh, 99_000.0)):
        for ext in ("part", "journal"):
            (store.partial / f"{sha}.{ext}").write_bytes(b"x")
            os.utime(store.partial / f"{sha}.{ext}", (mtime, mtime))
    removed = space.evict(store, keep=1, pins={}, max_size=None, now=100_000.0,
                          partial_after=50_000)
    assert {(r.kind, r.name) for r in removed} == {
        ("partial", landed), ("partial", old), ("leftover", "models/m/.tmp-v2-12345678"),
        ("leftover", "models/m/.trash-v0-12345678"), ("leftover", ".usage.json.tmp-12345678")}
    assert sorted(os.listdir(store.partial)) == [f"{fresh}.journal", f"{fresh}.part"]
    assert os.listdir(store.model_dir("m")) == ["v1"]
    assert not (store.root / ".usage.json.tmp-12345678").exists()
    assert store.installed("m", "v1") is not None


def test_evict_keeps_the_blobs_of_a_kept_version_that_lost_one(store):
    put_version(store, "m", "v1", {"x": b"a", "y": b"b"}, "2026-01-01T00:00:00Z")
    os.unlink(store.blob_path(bid(b"b")))
    assert store.installed("m", "v1") is None
    assert space.evict(store, keep=1, pins={}, max_size=None, now=10) == []
    assert store.has_blob(bid(b"a"))


def test_a_symlink_in_blobs_is_not_a_blob(store, tmp_path):
    target = tmp_path / "t"
    target.write_bytes(b"a")
    os.symlink(target, store.blob_path(bid(b"a")))
    assert store.blob_sizes() == {}
