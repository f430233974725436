"""`wagent store ls|verify|gc|pin|unpin` and `wagent wait`, through the real CLI against a store
filled by a real pull from nginx on loopback."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from agent.store import Store, pointers, space
from tests import modelgen
from tests.pull_helpers import LoopbackNginx, publish, publish_dir, same_files

pytestmark = pytest.mark.debian


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    publish(root, "m", "v1", piece_size=2**20, layers=2, hidden=128, shards=2)
    modelgen.next_version(root / "m" / "v1", root / "m" / "v2", change_layers=[1])
    publish_dir(root / "m" / "v2", piece_size=2**20)
    return root


def wagent(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True,
                       timeout=120)
    if check:
        assert r.returncode == 0, r
    return r


@pytest.fixture
def pulled(origin, tmp_path):
    store = tmp_path / "store"
    with LoopbackNginx(origin) as ng:
        for v in ("v1", "v2"):
            wagent("pull", f"{ng.url}/m/{v}", "--store", str(store), "--quiet")
    return store


def test_ls_names_versions_sizes_current_and_pins(pulled):
    s = Store(pulled)
    pointers.set_current(s, "m", "v2")
    wagent("store", "pin", "m", "v1", "--store", str(pulled))
    doc = json.loads(wagent("store", "ls", "--store", str(pulled), "--json").stdout)
    (m,) = doc["models"]
    assert m["current"] == "v2"
    by = {v["version"]: v for v in m["versions"]}
    assert by["v2"]["current"] and not by["v1"]["current"]
    assert by["v1"]["pinned"] and not by["v2"]["pinned"]
    assert all(v["size"] > 0 for v in by.values())
    text = wagent("store", "ls", "--store", str(pulled)).stdout
    assert "(current)" in text and "(pinned)" in text


def test_verify_names_each_bad_file(pulled):
    assert "0 bad file(s)" in wagent("store", "verify", "--store", str(pulled)).stdout
    shard = pulled / "models" / "m" / "v1" / "model-00002-of-00002.safetensors"
    blob = os.path.realpath(shard)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    r = wagent("store", "verify", "m/v1", "--store", str(pulled), "--json", check=False)
    assert r.returncode == 1
    bad = json.loads(r.stdout)["bad"]
    assert [(b["version"], b["path"]) for b in bad] == [("v1", shard.name)]
    assert "do not match" in bad[0]["why"]
    assert wagent("store", "verify", "m/v9", "--store", str(pulled), check=False).returncode == 1


def test_pins_and_the_current_version_survive_eviction(pulled):
    s = Store(pulled)
    wagent("store", "pin", "m", "v1", "--store", str(pulled))
    assert space.evict(s, keep=1, pins={}, max_size=None, now=time.time()) == []
    wagent("store", "unpin", "m", "v1", "--store", str(pulled))
    pointers.set_current(s, "m", "v1")          # older than v2: kept because it is current
    assert not [r for r in space.evict(s, keep=1, pins={}, max_size=None, now=time.time())
                if r.kind == "version"]
    pointers.set_current(s, "m", "v2")
    removed = space.evict(s, keep=1, pins={}, max_size=None, now=time.time())
    assert ("version", "m/v1") in {(r.kind, r.name) for r in removed}


def test_gc_dry_run_says_then_gc_removes(pulled):
    s = Store(pulled)
    os.rename(s.version_dir("m", "v1"), s.model_dir("m") / "gone")   # its own blobs: orphans
    os.rename(s.model_dir("m") / "gone", pulled / "elsewhere")
    (s.model_dir("m") / ".tmp-v3-12345678").mkdir()
    before = set(os.listdir(s.blobs))
    doc = json.loads(wagent("store", "gc", "--dry-run", "--store", str(pulled), "--json").stdout)
    kinds = {r["kind"] for r in doc["removed"]}
    assert kinds == {"blob", "leftover"} and doc["bytes"] > 0
    assert set(os.listdir(s.blobs)) == before          # a dry run removes nothing
    assert (s.model_dir("m") / ".tmp-v3-12345678").exists()
    wagent("store", "gc", "--store", str(pulled))
    assert len(os.listdir(s.blobs)) < len(before)
    assert not (s.model_dir("m") / ".tmp-v3-12345678").exists()
    assert s.installed("m", "v2") is not None
    assert "0 bad" in wagent("store", "verify", "--store", str(pulled)).stdout


def test_wait_returns_once_the_version_is_complete(origin, tmp_path):
    store = tmp_path / "store"
    r = wagent("wait", "m", "--version", "v1", "--timeout", "1s", "--store", str(store),
               check=False)
    assert r.returncode == 1 and "not complete" in r.stderr
    waiter = subprocess.Popen([sys.executable, "-m", "agent", "wait", "m", "--version", "v1",
                               "--timeout", "60s", "--store", str(store)],
                              stdout=subprocess.PIPE, text=True)
    try:
        with LoopbackNginx(origin) as ng:
            wagent("pull", f"{ng.url}/m/v1", "--store", str(store), "--quiet")
        out, _ = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
    assert waiter.returncode == 0 and out.strip().endswith("/models/m/v1")
    r = wagent("wait", "m", "--timeout", "1s", "--store", str(store), check=False)
    assert r.returncode == 1                         # no current version yet
    pointers.set_current(Store(store), "m", "v1")
    assert wagent("wait", "m", "--timeout", "1s", "--store", str(store)).returncode == 0


def test_pull_current_and_json(origin, tmp_path):
    store = tmp_path / "store"
    with LoopbackNginx(origin) as ng:
        r = wagent("pull", f"{ng.url}/m/v1", "--store", str(store), "--current", "--json")
        doc = json.loads(r.stdout)
        assert doc["ok"] and doc["version"] == "v1" and doc["current"] is True
        assert doc["bytes_fetched"] == doc["bytes_total"] > 0
        assert os.readlink(store / "models" / "m" / "current") == "v1"
        wagent("pull", f"{ng.url}/m/v2", "--store", str(store), "--quiet")
        assert os.readlink(store / "models" / "m" / "current") == "v1"   # not without --current
        r = wagent("pull", f"{ng.url}/m/v9", "--store", str(store), "--json", check=False)
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False


# -- issue 21: names the store uses itself; a damaged blob is never kept -----------------------

def flip_a_byte(store, rel, version="v1"):
    """One flipped byte in the blob behind ``rel`` (a disk's rot, or a hand's edit)."""
    blob = os.path.realpath(store / "models" / "m" / version / rel)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(blob, 0o444)
    return os.path.basename(blob)


SHARD = "model-00002-of-00002.safetensors"


def test_a_version_named_as_the_store_names_its_own_entries_is_refused(origin, tmp_path):
    """Before: `pull .../m/current` exited 0, then ls, verify and gc didn't see the version (gc
    deleted its blobs) and `--current` ended in IsADirectoryError. Now refused, saying why,
    wherever the name comes in: the URL, a `latest` that names it, a build, a wait."""
    src = tmp_path / "origin"
    shutil.copytree(origin / "m" / "v1", src / "m" / "current")   # an older publisher's
    doc = json.loads((src / "m" / "current" / "manifest.json").read_text())
    doc["version"] = "current"
    (src / "m" / "current" / "manifest.json").write_text(json.dumps(doc))
    (src / "m" / "latest").write_text("current\n")
    store = tmp_path / "store"
    with LoopbackNginx(src) as ng:
        for name in ("current", "latest"):
            r = wagent("pull", f"{ng.url}/m/{name}", "--store", str(store), "--current",
                       check=False)
            assert r.returncode == (2 if name == "current" else 1), r
            assert "'current' is reserved" in r.stderr and "Traceback" not in r.stderr
        fetched = ng.bytes_sent("/m/current/")
    assert fetched == 0                              # refused before any byte of it came
    assert not os.path.lexists(store / "models" / "m" / "current")
    r = wagent("manifest", "build", str(src / "m" / "current"), check=False)
    assert r.returncode != 0 and "'current' is reserved" in r.stderr
    r = wagent("wait", "m", "--version", "current", "--timeout", "1s", "--store", str(store),
               check=False)
    assert r.returncode == 2 and "reserved" in r.stderr


def test_verify_removes_a_damaged_blob_and_the_next_pull_fetches_it(origin, pulled):
    """Before: one flipped byte was named by verify, then `pull` reported the version installed
    and fetched nothing, and gc kept the blob. Now verify takes the blob out, the version says
    it is incomplete, and the next pull fetches that one file."""
    s = Store(pulled)
    pointers.set_current(s, "m", "v1")
    name = flip_a_byte(pulled, SHARD)
    r = wagent("store", "verify", "--store", str(pulled), "--json", check=False)
    assert r.returncode == 1
    bad = json.loads(r.stdout)["bad"]
    assert {(b["version"], b["path"], b["removed"]) for b in bad} >= {("v1", SHARD, True)}
    assert not (pulled / "blobs" / name).exists()
    text = wagent("store", "verify", "m/v1", "--store", str(pulled), check=False).stdout
    assert "missing" in text and "incomplete until pulled again: m/v1" in text
    assert "current, and missing a file meanwhile: m/v1" in text
    ls = json.loads(wagent("store", "ls", "--store", str(pulled), "--json").stdout)
    (m,) = ls["models"]
    assert m["current"] is None                      # not served as current silently
    assert [(v["version"], v["missing"], v["current"]) for v in m["incomplete"]] == [
        ("v1", [SHARD], True)]
    assert "incomplete: 1 file(s) missing" in wagent("store", "ls", "--store",
                                                     str(pulled)).stdout
    assert wagent("wait", "m", "--timeout", "1s", "--store", str(pulled),
                  check=False).returncode == 1
    wagent("store", "gc", "--store", str(pulled))
    with LoopbackNginx(origin) as ng:
        doc = json.loads(wagent("pull", f"{ng.url}/m/v1", "--store", str(pulled), "--json")
                         .stdout)
    size = (origin / "m" / "v1" / SHARD).stat().st_size
    assert doc["bytes_fetched"] + doc["bytes_reused"] == size   # that file, nothing else
    same_files(pulled / "models" / "m" / "v1", origin / "m" / "v1")
    assert "0 bad file(s)" in wagent("store", "verify", "--store", str(pulled)).stdout
    assert wagent("wait", "m", "--timeout", "1s", "--store", str(pulled)).returncode == 0


def test_pull_verify_files_re_fetches_a_damaged_blob(origin, pulled):
    """Before: `pull --verify-files` reported a version with a flipped byte installed and
    fetched nothing. Now every blob it would use that is there already is read again first:
    of the installed version, and one a new version shares with another."""
    name = flip_a_byte(pulled, SHARD, version="v2")
    shard = (origin / "m" / "v2" / SHARD).stat().st_size
    with LoopbackNginx(origin) as ng:
        r = wagent("pull", f"{ng.url}/m/latest", "--store", str(pulled), "--verify-files",
                   "--json")
        doc = json.loads(r.stdout)
        assert doc["version"] == "v2" and doc["bytes_fetched"] + doc["bytes_reused"] == shard
        assert f"m/v2/{SHARD}: bytes" in r.stderr      # said what it found and removed
        assert (pulled / "blobs" / name).exists()     # fetched again, right this time
        same_files(pulled / "models" / "m" / "v2", origin / "m" / "v2")
        # v2 gone, its shared file damaged through v1: pulling v2 doesn't link the bad blob
        shutil.rmtree(pulled / "models" / "m" / "v2")
        shared = "model.safetensors.index.json"
        flip_a_byte(pulled, shared, version="v1")
        wagent("pull", f"{ng.url}/m/v2", "--store", str(pulled), "--verify-files", "--quiet")
    for v in ("v1", "v2"):
        same_files(pulled / "models" / "m" / v, origin / "m" / v)
    assert "0 bad file(s)" in wagent("store", "verify", "--store", str(pulled)).stdout


def test_verify_repair_pulls_the_damaged_versions_again(origin, pulled, tmp_path):
    flip_a_byte(pulled, SHARD)                                           # v1's alone
    flip_a_byte(pulled, "model.safetensors.index.json", version="v2")    # both versions'
    # no source known (no policy, none given): the blob goes, and it says how to get it back
    r = wagent("store", "verify", "--repair", "--store", str(pulled), "--policy",
               str(tmp_path / "none.yaml"), "--json", check=False)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["repaired"] == []
    assert {u["version"] for u in doc["unrepaired"]} == {"m/v1", "m/v2"}
    assert all("give --source" in u["why"] for u in doc["unrepaired"])
    with LoopbackNginx(origin) as ng:
        r = wagent("store", "verify", "--repair", "--source", ng.url, "--store", str(pulled),
                   check=False)
    assert r.returncode == 0, r
    assert "repaired m/v1" in r.stdout and "repaired m/v2" in r.stdout
    for v in ("v1", "v2"):
        same_files(pulled / "models" / "m" / v, origin / "m" / v)
    assert "0 bad file(s)" in wagent("store", "verify", "--store", str(pulled)).stdout


def test_pull_current_over_a_directory_in_the_pointers_place_says_so(origin, tmp_path):
    store = tmp_path / "store"
    (store / "models" / "m" / "current").mkdir(parents=True)   # an older wagent's version
    with LoopbackNginx(origin) as ng:
        r = wagent("pull", f"{ng.url}/m/v1", "--store", str(store), "--current", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "is a directory, not the current pointer" in r.stderr


def test_the_daemon_refuses_a_latest_that_names_current_and_fetches_nothing(origin, tmp_path):
    """Before: the daemon pulled a version `latest` named `current`, couldn't make it current,
    evicted its blobs and downloaded it again at every poll, healthy all along. Now `latest` is
    refused as it is read: status names the reason, and no byte of the version comes."""
    from tests.daemon_helpers import start_daemon, stop_daemon, wait_for_socket, write_policy

    src = tmp_path / "origin"
    shutil.copytree(origin / "m" / "v1", src / "m" / "current")
    (src / "m" / "latest").write_text("current\n")
    with LoopbackNginx(src) as ng:
        policy = write_policy(tmp_path / "policy.yaml", tmp_path, sources=[{"url": ng.url}],
                              models=[{"name": "m"}], poll_interval="1s")
        proc = start_daemon(policy, log=tmp_path / "daemon.log")
        try:
            wait_for_socket(tmp_path / "control.sock", proc)
            deadline = time.monotonic() + 20
            while True:
                r = wagent("status", "--json", "--socket", str(tmp_path / "control.sock"),
                           check=False)
                doc = json.loads(r.stdout)
                (pull,) = doc["pulls"]
                if (pull["error"] and "reserved" in pull["error"]) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(3)                             # a few more polls
            r = wagent("status", "--json", "--socket", str(tmp_path / "control.sock"),
                       check=False)
            doc = json.loads(r.stdout)
            (pull,) = doc["pulls"]
        finally:
            stop_daemon(proc)
        fetched = ng.bytes_sent("/m/current/")
    assert "'current' is reserved" in (pull["error"] or ""), doc
    assert fetched == 0
    assert not os.path.lexists(tmp_path / "store" / "models" / "m" / "current")
    assert doc["health"] == "degraded" and r.returncode == 1   # three failed polls in a row
    assert any("'current' is reserved" in p for p in doc["problems"]), doc


@pytest.mark.parametrize("cmd", [["store", "ls"], ["store", "verify"], ["store", "gc"],
                                 ["store", "pin", "m", "v1"], ["store", "unpin", "m", "v1"]])
def test_a_store_that_is_not_there_is_an_error_naming_it(tmp_path, cmd):
    """A mistyped --store read as an empty store ("0 B used", exit 0) before."""
    missing = tmp_path / "no" / "such"
    r = wagent(*cmd, "--store", str(missing), check=False)
    assert r.returncode == 1 and f"no store at {missing}: it does not exist" in r.stderr, r
    assert not missing.exists()
    (tmp_path / "file").write_text("")
    r = wagent(*cmd, "--store", str(tmp_path / "file"), check=False)
    assert r.returncode == 1 and "is not a directory" in r.stderr, r


def test_wait_waits_for_a_store_not_made_yet_and_names_it_when_it_gives_up(tmp_path):
    r = wagent("wait", "m", "--timeout", "1s", "--store", str(tmp_path / "later"), check=False)
    assert r.returncode == 1 and "no store there" in r.stderr, r
