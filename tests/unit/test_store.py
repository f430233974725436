import hashlib
import json
import os

import pytest

from agent.manifest import FileEntry, Manifest, Piece, to_json
from agent.store import Store, StoreError


def put_version(store, model, version, files, published="2026-12-02T11:00:00Z", now=0.0):
    """Install a version the way a pull does: blobs first, then publish."""
    entries = []
    for path, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        if not store.has_blob(sha):
            tmp = store.partial / f"{sha}.part"
            tmp.write_bytes(data)
            store.add_blob(tmp, sha)
        entries.append(FileEntry(path, len(data), sha, (Piece(0, len(data), sha),)
                                 if data else ()))
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
    assert store.piece_index() == {sha: (sha, 0)}


def test_missing_blob_means_not_installed(store):
    put_version(store, "m", "v1", {"x": b"abc"})
    os.unlink(store.blob_path(hashlib.sha256(b"abc").hexdigest()))
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
    removed = store.evict(keep=1, pins={"m": ["v1"]}, max_size=None, now=10)
    assert [(r.kind, r.name) for r in removed] == [
        ("version", "m/v2"), ("blob", hashlib.sha256(b"mid").hexdigest())]
    assert [v.version for v in store.versions("m")] == ["v3", "v1"]
    assert store.usage() < before
    assert store.installed("m", "v1") and store.installed("m", "v3")


def test_evict_is_deferred_while_a_pull_holds_the_store(store):
    put_version(store, "m", "v1", {"x": b"a"}, "2026-01-01T00:00:00Z")
    put_version(store, "m", "v2", {"x": b"b"}, "2026-02-01T00:00:00Z")
    with store.pull_lock():
        assert store.evict(keep=1, pins={}, max_size=None, now=10) == []
    assert len(store.evict(keep=1, pins={}, max_size=None, now=10)) == 2


def test_touch_orders_lru(store):
    put_version(store, "m", "v1", {"x": b"a"}, "2026-01-01T00:00:00Z", now=5)
    store.touch("m", "v1", 50)
    assert store.versions("m")[0].last_used == 50


def test_journal_survives_reopen_and_ignores_torn_lines(tmp_path):
    from agent.pull.journal import Partial, PartialBusy
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
