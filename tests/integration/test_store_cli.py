"""`wagent store ls|verify|gc|pin|unpin` and `wagent wait`, through the real CLI against a store
filled by a real pull from nginx on loopback."""

import json
import os
import subprocess
import sys
import time

import pytest

from agent.store import Store, pointers, space
from tests import modelgen
from tests.pull_helpers import LoopbackNginx, publish, publish_dir

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
