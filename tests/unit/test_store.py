import hashlib
import json
import os
import stat
from types import SimpleNamespace

import pytest

from agent.blob_id import blob_id
from agent.manifest import FileEntry, Manifest, Piece, to_json
from agent.ownership import chain_problem, inner_problem
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


# -- who may change the store (issue 21, items 5 and 6) ---------------------------------------
def st(uid, mode):
    """A stat result as the ownership rule reads it."""
    return SimpleNamespace(st_uid=uid, st_mode=mode)


ROOT_DIR, TMP, LINK = 0o40755, 0o41777, 0o120777


def chain(*entries):
    return [(p, st(uid, mode)) for p, uid, mode in entries]


def test_the_rule_accepts_a_trusted_path_through_a_sticky_directory():
    path = chain(("/", 0, ROOT_DIR), ("/tmp", 0, TMP), ("/tmp/store", 0, ROOT_DIR))
    assert chain_problem(path, {0}, complete=True, risk="swap") is None
    # the service's user (here 998) owns the store: trusted too
    path = chain(("/", 0, ROOT_DIR), ("/var", 0, ROOT_DIR), ("/var/cache/wagent", 998, 0o40750))
    assert chain_problem(path, {0, 998}, complete=True, risk="swap") is None


@pytest.mark.parametrize(("entries", "says"), [
    pytest.param([("/tmp/x", 65534, ROOT_DIR), ("/tmp/x/store", 0, ROOT_DIR)],
                 "/tmp/x is owned by uid 65534", id="parent-owned-by-another"),
    pytest.param([("/tmp/x", 0, ROOT_DIR), ("/tmp/x/store", 65534, ROOT_DIR)],
                 "/tmp/x/store is owned by uid 65534", id="root-owned-by-another"),
    pytest.param([("/tmp/x", 0, 0o40777), ("/tmp/x/store", 0, ROOT_DIR)],
                 "/tmp/x is writable by its group and all users, mode 0777", id="open-parent"),
    pytest.param([("/tmp/x", 0, ROOT_DIR), ("/tmp/x/store", 0, TMP)],
                 "/tmp/x/store is writable by its group and all users, mode 1777 (sticky",
                 id="sticky-root"),
    pytest.param([("/tmp/x", 0, ROOT_DIR), ("/tmp/x/store", 0, 0o40775)],
                 "/tmp/x/store is writable by its group, mode 0775", id="group-writable-root"),
    pytest.param([("/tmp/link", 65534, LINK), ("/tmp/link/store", 0, ROOT_DIR)],
                 "/tmp/link is owned by uid 65534", id="another-users-symlink"),
])
def test_the_rule_names_the_directory_and_the_fix(entries, says):
    path = chain(("/", 0, ROOT_DIR), ("/tmp", 0, TMP), *entries)
    problem = chain_problem(path, {0}, complete=True, risk="swap the files", also=", or not")
    assert problem is not None and problem.startswith(says), problem
    assert "they can swap the files" in problem or "that user can swap the files" in problem
    assert problem.endswith(", or not")
    bad = says.split(" is ")[0]
    assert (f"fix: chmod go-w {bad}" in problem) if "writable" in says \
        else (f"root {bad}" in problem and "fix: chown" in problem)


def test_the_rule_ignores_a_symlinks_mode_and_waits_for_a_missing_target():
    path = chain(("/", 0, ROOT_DIR), ("/tmp", 0, TMP), ("/tmp/link", 0, LINK))
    assert chain_problem(path, {0}, complete=True, risk="swap") is None
    # /tmp is the last that exists, but it is an ancestor of the store still to be made
    assert chain_problem(path[:2], {0}, complete=False, risk="swap") is None
    assert "sticky" in chain_problem(path[:2], {0}, complete=True, risk="swap")


@pytest.mark.parametrize(("uid", "mode", "says"), [
    (1000, 0o40755, None), (0, 0o40755, None), (1000, 0o40700, None), (1000, LINK, None),
    (65534, 0o40755, "is owned by uid 65534"), (65534, LINK, "chown -Rh"),
    (1000, 0o40775, "writable by its group, mode 0775"),
    (1000, 0o100666, "writable by its group and all users"),
])
def test_what_the_store_keeps_must_be_its_owners(uid, mode, says):
    problem = inner_problem("/s/blobs", st(uid, mode), 1000, risk="swap")
    assert problem is None if says is None else says in problem, problem


def test_locks_and_partial_are_out_of_readers_reach(store):
    """flock works on a read-only descriptor: what others can open they can hold."""
    with store.exclusive():
        pass
    store.touch("m", "v1", 1.0)
    assert stat.S_IMODE(os.stat(store.partial).st_mode) == 0o700
    for name in (".lock", ".usage.lock"):
        assert stat.S_IMODE(os.stat(store.root / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(store.blobs).st_mode) == 0o755       # readers still read these
    assert stat.S_IMODE(os.stat(store.models).st_mode) == 0o755


def test_an_older_wagents_store_is_closed_on_ensure(store):
    with store.exclusive():
        store.touch("m", "v1", 1.0)
    os.chmod(store.partial, 0o755)                 # as wagent made them before issue 21
    for name in (".lock", ".usage.lock"):
        os.chmod(store.root / name, 0o644)
    Store(store.root).ensure()
    assert stat.S_IMODE(os.stat(store.partial).st_mode) == 0o700
    for name in (".lock", ".usage.lock"):
        assert stat.S_IMODE(os.stat(store.root / name).st_mode) == 0o600, name


def test_missing_parents_are_made_0755_whatever_the_umask(tmp_path):
    """Under umask 000 os.makedirs made the store's parents 0777, which anyone could swap."""
    old = os.umask(0)
    try:
        Store(tmp_path / "a" / "b" / "store").ensure()
    finally:
        os.umask(old)
    for d in ("a", "a/b", "a/b/store", "a/b/store/blobs"):
        assert stat.S_IMODE(os.stat(tmp_path / d).st_mode) == 0o755, d


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody")


@pytest.fixture
def sticky(tmp_path):
    """A /tmp-like directory (root's, 1777)."""
    d = tmp_path / "tmp"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


@root_only
def test_a_store_another_user_owns_is_refused_before_anything_is_written(sticky):
    root = sticky / "store"
    root.mkdir()
    os.chown(root, 65534, 65534)
    for op in (Store(root).ensure, lambda: Store(root).check_writable("m", "v1"),
               lambda: space.gc(Store(root), 0.0)):
        with pytest.raises(StoreError, match=f"{root} is owned by uid 65534.*fix: chown root"):
            op()
    assert os.listdir(root) == []
    # a store to be made in a directory another user owns: not made
    os.chown(root, 0, 0)
    os.mkdir(root / "x")
    os.chown(root / "x", 65534, 65534)
    with pytest.raises(StoreError, match=f"{root / 'x'} is owned by uid 65534"):
        Store(root / "x" / "store").ensure()
    assert os.listdir(root / "x") == []


@root_only
@pytest.mark.parametrize("inner", ["blobs", "models", "partial", "models/m", ".lock"])
def test_what_the_store_keeps_owned_by_another_user_is_refused(store, inner):
    """The root is root's again, but nobody made blobs/ (or a model) while it was theirs."""
    with store.exclusive():
        pass
    (store.models / "m").mkdir()
    os.lchown(store.root / inner, 65534, 65534)
    with pytest.raises(StoreError, match=f"{store.root / inner} is owned by uid 65534"
                                         r".*fix: chown -R root"):
        store.ensure()
    with pytest.raises(StoreError, match="owned by uid 65534"):
        space.gc(store, 0.0)


# -- issue 21: a damaged blob is never kept; the current pointer's temporary link ---------------

def corrupt(store, data):
    """Flip one byte of the blob holding ``data`` (a disk's rot, or a hand's edit)."""
    path = store.blob_path(bid(data))
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(1)
        f.write(bytes([data[1] ^ 0xFF]))
    os.chmod(path, 0o444)


def test_verify_removes_a_damaged_blob_and_its_versions_become_incomplete(store):
    from agent.store.verify import Checker

    shared, other = b"shared bytes" * 100, b"other" * 100
    put_version(store, "m", "v1", {"w.bin": shared, "o.bin": other})
    put_version(store, "m", "v2", {"w.bin": shared})
    corrupt(store, shared)
    checker = Checker(store, remove=True)
    bad = [p for m in store.every_manifest() for p in checker.verify(m)]
    assert [(p.version, p.path, p.removed) for p in bad] == [("v1", "w.bin", True),
                                                             ("v2", "w.bin", True)]
    assert all("do not match" in p.why for p in bad)
    assert not store.has_blob(bid(shared)) and store.has_blob(bid(other))
    assert [n for n in os.listdir(store.blobs) if n.startswith(".")] == []
    for v in ("v1", "v2"):                 # incomplete: never served, pulled again
        assert store.installed("m", v) is None
        assert store.missing(store.version_manifest("m", v)) == ["w.bin"]
    # gc doesn't hold on to it, and keeps what the incomplete versions still use
    space.gc(store, 0.0)
    assert store.has_blob(bid(other))
    # verified again: said missing, nothing more to remove
    again = Checker(store, remove=True).verify(store.version_manifest("m", "v1"))
    assert [(p.path, p.removed) for p in again] == [("w.bin", False)]
    assert "missing" in again[0].why


def test_a_wrong_whole_file_sha256_is_the_manifests_fault_and_the_blob_stays(store):
    from agent.store.verify import verify

    put_version(store, "m", "v1", {"a.bin": b"abc"})
    m = store.version_manifest("m", "v1")
    lying = Manifest(m.model, m.version, m.published,
                     (FileEntry("a.bin", 3, "0" * 64, m.files[0].pieces),))
    (p,) = verify(store, lying, remove=True)
    assert "manifest is wrong" in p.why and not p.removed
    assert store.has_blob(bid(b"abc"))


def test_a_pull_that_distrusts_the_store_drops_bad_blobs_another_version_would_share(store):
    from agent.store.verify import drop_bad_blobs

    put_version(store, "m", "v1", {"w.bin": b"weights" * 50, "x.bin": b"x" * 10})
    corrupt(store, b"weights" * 50)
    new = Manifest("m", "v2", "2026-12-03T11:00:00Z",
                   (entry("w.bin", b"weights" * 50), entry("y.bin", b"not here yet")))
    (p,) = drop_bad_blobs(store, new)
    assert (p.version, p.path, p.removed) == ("v2", "w.bin", True)
    assert not store.has_blob(bid(b"weights" * 50)) and store.has_blob(bid(b"x" * 10))
    assert drop_bad_blobs(store, new) == []          # nothing present is bad any more


def test_drop_blob_leaves_a_blob_a_pull_put_in_place_since(store):
    put_version(store, "m", "v1", {"a.bin": b"abc"})
    st = os.lstat(store.blob_path(bid(b"abc")))
    tmp = store.partial / "fresh"
    tmp.write_bytes(b"abc")
    store.add_blob(tmp, bid(b"abc"), 3)             # a new inode under the same name
    assert not store.drop_blob(bid(b"abc"), (st.st_dev, st.st_ino))
    assert store.installed("m", "v1") is not None
    assert [n for n in os.listdir(store.blobs) if n.startswith(".")] == []


def test_clean_leaves_a_fresh_temporary_link_to_whoever_is_making_it(store):
    """Issue 21: a pull's start took another pull's `.current-*` link between its creation and
    its rename (`pull --current` then failed with FileNotFoundError). A temporary link or file
    that no lock covers goes only once it is stale."""
    put_version(store, "m", "v1", {"a.bin": b"abc"})
    d = store.model_dir("m")
    os.symlink("v1", d / ".current-0123abcd")
    (d / ".tmp-latest-0123abcd").write_text("v1\n")
    os.mkdir(d / ".tmp-v2-0123abcd")               # a crashed publish: under the lock, goes
    (store.blobs / ".bad-x-0123abcd").write_bytes(b"x")
    now = os.lstat(store.blobs / ".bad-x-0123abcd").st_ctime      # made last
    gone = {r.name for r in space.clean(store, now)}
    assert gone == {"models/m/.tmp-v2-0123abcd"}
    assert os.path.lexists(d / ".current-0123abcd")
    gone = {r.name for r in space.clean(store, now + space.LEFTOVER_AFTER)}
    assert gone == {"models/m/.current-0123abcd", "models/m/.tmp-latest-0123abcd",
                    "blobs/.bad-x-0123abcd"}


def test_set_current_refuses_a_directory_in_the_pointers_place(store):
    """A version an older wagent published as `current`: a clear error, not IsADirectoryError."""
    from agent.store import pointers

    put_version(store, "m", "v1", {"a.bin": b"abc"})
    os.mkdir(store.model_dir("m") / "current")
    with pytest.raises(StoreError, match="is a directory, not the current pointer"):
        pointers.set_current(store, "m", "v1")
    assert [n for n in os.listdir(store.model_dir("m")) if n.startswith(".")] == []


def test_set_current_beside_cleans_never_loses_its_link(store):
    """Cleans that would take any leftover at once (a far-future clock) run beside switches of
    the pointer: set_current holds the store, so no clean sees its link half made."""
    import threading

    from agent.store import pointers

    for v in ("v1", "v2"):
        put_version(store, "m", v, {"a.bin": v.encode() * 3})
    errors, done = [], threading.Event()

    def cleaner():
        while not done.is_set():
            try:
                space.clean(store, 1e12)
            except Exception as e:      # any failure is the test's answer
                errors.append(e)

    t = threading.Thread(target=cleaner)
    t.start()
    try:
        for i in range(300):
            pointers.set_current(store, "m", ("v1", "v2")[i % 2])
    finally:
        done.set()
        t.join()
    assert errors == [] and os.readlink(store.model_dir("m") / "current") == "v2"
