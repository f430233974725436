"""agent.announce: a cache node's `latest`, only for versions it holds, never backwards."""

from __future__ import annotations

import hashlib
import os
import stat
import time

import pytest

from agent.announce import announce, latest_sources, parse_latest
from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, ManifestError, Piece, to_json
from agent.policy.model import Source
from agent.store import Store, space


def put_version(store: Store, model: str, version: str, data: bytes, published: str) -> None:
    """Install a version as a pull does: its blob, then the version published."""
    sha = hashlib.sha256(data).hexdigest()
    e = FileEntry("w.bin", len(data), sha, (Piece(0, len(data), sha),))
    if not store.has_blob(blob_id(e)):
        tmp = store.partial / f"{blob_id(e)}.part"
        tmp.write_bytes(data)
        store.add_blob(tmp, blob_id(e), len(data))
    m = Manifest(model, version, published, (e,))
    store.publish(m, to_json(m), 0.0)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.ensure()
    return s


def latest_file(store: Store, model: str = "m"):
    return store.models / model / "latest"


def announced(root, model: str) -> str | None:
    """The version the store at ``root`` announces for ``model``, as its cluster reads it."""
    try:
        return parse_latest(latest_file(Store(root), model).read_bytes())[0]
    except (OSError, ManifestError):
        return None


def test_a_complete_version_is_announced_durably_and_readable_by_nginx(store):
    old = os.umask(0o077)
    try:
        put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
        assert announce(store.root, "m", "v1") is True
    finally:
        os.umask(old)
    f = latest_file(store)
    assert f.read_text() == "v1\n"
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert announced(store.root, "m") == "v1"
    assert announce(store.root, "m", "v1") is False              # unchanged
    assert not [n for n in os.listdir(store.models / "m") if n.startswith(".")]
    # the store still sees one version: `latest` is not one
    assert [v.version for v in store.versions("m")] == ["v1"]


def test_a_version_not_held_completely_is_never_announced(store):
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    assert announce(store.root, "m", "v2") is False               # not in the store at all
    put_version(store, "m", "v2", b"two", "2026-12-02T00:00:00Z")
    for blob in store.blobs.iterdir():                            # v2 loses its bytes
        if blob.read_bytes() == b"two":
            blob.unlink()
    assert store.installed("m", "v2") is None
    assert announce(store.root, "m", "v2") is False
    assert not latest_file(store).exists()
    assert announced(store.root, "m") is None


def test_never_backwards_while_the_newer_one_is_held(store):
    put_version(store, "m", "v2", b"two", "2026-12-02T00:00:00Z")
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    assert announce(store.root, "m", "v2") is True
    assert announce(store.root, "m", "v1") is False               # published before v2
    assert announced(store.root, "m") == "v2"
    put_version(store, "m", "v3", b"three", "2026-12-03T00:00:00Z")
    assert announce(store.root, "m", "v3") is True
    assert announced(store.root, "m") == "v3"
    # the announced version evicted: an older one that is held may take its place
    os.rename(store.models / "m" / "v3", store.models / "m" / ".trash-v3")
    assert announce(store.root, "m", "v1") is True
    assert announced(store.root, "m") == "v1"


def test_nothing_is_written_through_a_symlink(store, tmp_path):
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep\n")
    os.symlink(elsewhere, latest_file(store))          # a link planted at `latest`
    assert announce(store.root, "m", "v1") is True
    assert not latest_file(store).is_symlink() and latest_file(store).read_text() == "v1\n"
    assert elsewhere.read_text() == "keep\n"
    # a model directory swapped for a symlink holds no version of the store's: nothing written
    outside = tmp_path / "outside"
    os.rename(store.models / "m", outside)
    (outside / "latest").unlink()
    os.symlink(outside, store.models / "m")
    assert announce(store.root, "m", "v1") is False
    assert not (outside / "latest").exists()


def test_a_crash_leftover_is_cleaned_by_the_store(store):
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    (store.models / "m" / ".tmp-latest-0badf00d").write_text("v9\n")
    # no lock covers an announcement's temporary file: a young one may be another process's
    space.clean(store, time.time())
    assert (store.models / "m" / ".tmp-latest-0badf00d").exists()
    space.clean(store, time.time() + space.LEFTOVER_AFTER)
    assert not (store.models / "m" / ".tmp-latest-0badf00d").exists()


def test_cache_nodes_poll_past_the_cache_tier():
    tier, origin = Source("http://wcache:8080", cache=True), Source("https://origin/models")
    assert latest_sources([tier, origin], cache_node=False) == (tier, origin)
    assert latest_sources([tier, origin], cache_node=True) == (origin,)
    assert latest_sources([tier], cache_node=True) == (tier,)    # nothing else to ask


def test_the_announcement_says_which_node_wrote_it_and_readers_take_the_first_line(store):
    from agent.announce import latest_text, parse_latest
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    assert announce(store.root, "m", "v1") is True               # an older wagent's: no author
    assert announce(store.root, "m", "v1", "node-a") is True     # the same version, now signed
    assert latest_file(store).read_bytes() == latest_text("v1", "node-a")
    assert latest_file(store).read_text().splitlines()[0] == "v1"   # what any reader takes
    assert parse_latest(latest_file(store).read_bytes()) == ("v1", "node-a")
    assert announce(store.root, "m", "v1", "node-a") is False
    assert parse_latest(b"v7\n") == ("v7", None)                 # a publisher's `latest`
    with pytest.raises(ValueError):
        parse_latest(b"../etc\nwagent-announced-by x\n")
