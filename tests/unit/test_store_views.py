"""A complete version's view: hard links to its blobs, made whole or not at all, and gone with
its last mount (``agent.store.views``)."""

import os

import pytest

from agent.store import Store, StoreError
from agent.store.views import drop_stale, drop_view, make_view, view_names
from tests.unit.test_store import put_version


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.ensure()
    return s


def test_a_view_links_the_blobs_of_an_installed_version(store):
    put_version(store, "m", "v1", {"a.safetensors": b"abc", "sub/config.json": b"{}"})
    view = make_view(store, "m", "v1")
    assert view == store.views / "m@v1"
    vdir = store.version_dir("m", "v1")
    for path, data in (("a.safetensors", b"abc"), ("sub/config.json", b"{}")):
        st = os.lstat(view / path)
        assert st.st_ino == os.stat(vdir / path).st_ino and (view / path).read_bytes() == data
        assert oct(st.st_mode & 0o777) == "0o444"
    assert make_view(store, "m", "v1") == view          # there already: the same one
    assert view_names(store) == ["m@v1"]
    drop_view(store, "m", "v1")
    assert view_names(store) == [] and (vdir / "a.safetensors").read_bytes() == b"abc"


def test_no_view_of_a_version_not_complete_and_no_leftover(store):
    put_version(store, "m", "v1", {"a": b"abc"})
    os.unlink(store.blob_path(store.linked_blobs(store.installed("m", "v1"))["a"]))
    with pytest.raises(StoreError, match="not complete"):
        make_view(store, "m", "v1")
    assert view_names(store) == []
    with pytest.raises(ValueError):
        make_view(store, "../m", "v1")


def test_stale_views_go_and_shown_ones_stay(store):
    put_version(store, "m", "v1", {"a": b"1"})
    put_version(store, "m", "v2", {"a": b"2"})
    make_view(store, "m", "v1")
    make_view(store, "m", "v2")
    (store.views / ".tmp-0123").mkdir()             # a crash while making one
    assert drop_stale(store, {"m@v2"}) == [".tmp-0123", "m@v1"]
    assert view_names(store) == ["m@v2"]


def test_a_blob_failing_verification_leaves_its_views_until_pulled_again(store):
    put_version(store, "m", "v1", {"a": b"abc", "b": b"keep"})
    view = make_view(store, "m", "v1")
    bad = store.linked_blobs(store.installed("m", "v1"))["a"]
    st = os.stat(store.blob_path(bad))
    assert store.drop_blob(bad, (st.st_dev, st.st_ino))
    assert not (view / "a").exists() and (view / "b").read_bytes() == b"keep"
    assert store.installed("m", "v1") is None
    put_version(store, "m", "v1", {"a": b"abc", "b": b"keep"})    # pulled again
    assert make_view(store, "m", "v1") == view
    assert (view / "a").read_bytes() == b"abc"
    assert os.stat(view / "a").st_ino == os.stat(store.blob_path(bad)).st_ino
