"""What the daemon's pull worker does on a node (agent.pull.node_pulls), against real loopback
servers (nginx, the faulty server) and a real store; and the wiring agent.application gives the
worker, driven by the real worker with its own schedule (not a formula of the test's)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from agent import schedule
from agent.application import worker_deps
from agent.identity import Identity
from agent.manifest import published_ts
from agent.peers.catalog import Catalog
from agent.peers.server import PeerServer
from agent.policy.model import Model, Policy, Pulls, Source, StoreSettings
from agent.pull import engine
from agent.pull.connections import Connections
from agent.pull.demand import Demand
from agent.pull.engine import PullOptions, StoreFull, pull_version
from agent.pull.node_pulls import NodePulls
from agent.pull.tell import tell
from agent.pull.worker import Worker
from agent.store import Store, pointers, space
from agent.yielding.ratelimit import TokenBucket
from tests.pull_helpers import FaultyServer, LoopbackNginx, publish, publish_dir
from tests.waiting import wait_for

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

MODEL = Model("m")


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    # 1 MiB pieces and about 8 MiB of weights: enough requests to keep 8 streams busy
    publish(root, "m", "v1", piece_size=2**20, layers=4, hidden=512, shards=2)
    return root


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def node(tmp_path, url: str, *, role: str = "gpu", streams: int = 8,
         pulling=lambda: 1, clock=None, models=(MODEL,)) -> NodePulls:
    policy = Policy(sources=(Source(url),), models=tuple(models), cache_role="cache",
                    store=StoreSettings(path=str(tmp_path / "store")),
                    pulls=Pulls(streams=streams, adaptive_streams=False, piece_size=2**20,
                                retries=1),
                    state_dir=str(tmp_path / "state"))
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    store = Store(policy.store.path)
    store.ensure()
    return NodePulls(policy, Identity("node-a", "host-a", role, "test"), store,
                     TokenBucket(None), clock=clock or Clock(), pulling=pulling,
                     connections=Connections())


def pull(pulls: NodePulls, version: str = "v1") -> list[int]:
    """Pull as the worker does; the streams each progress report saw busy."""
    seen: list[int] = []
    pulls.pull(MODEL, version, lambda p: seen.append(p.streams), threading.Event())
    return seen


def manifest_requests(srv: FaultyServer) -> int:
    return sum(path.endswith("/manifest.json") for path, _, _ in srv.requests)


# -- after a pull -------------------------------------------------------------------------------
@pytest.mark.parametrize("role, announced", [("cache", True), ("gpu", False)])
def test_a_cache_node_announces_the_version_it_pulled(origin, tmp_path, role, announced):
    with LoopbackNginx(origin) as ng:
        pulls = node(tmp_path, ng.url, role=role)
        pull(pulls)
    latest = pulls.store.models / "m" / "latest"
    assert pulls.have(MODEL, "v1") and pulls.local_version(MODEL) == "v1"
    if announced:
        assert latest.read_text().splitlines() == ["v1", "wagent-announced-by node-a"]
    else:
        assert not latest.exists()


def test_announce_held_names_the_newest_version_the_store_holds(origin, tmp_path):
    with LoopbackNginx(origin) as ng:
        pulls = node(tmp_path, ng.url, role="cache")
        pull(pulls)
    latest = pulls.store.models / "m" / "latest"
    latest.unlink()                       # lost with the store's files
    pulls.announce_held()
    assert latest.read_text().splitlines()[0] == "v1"


def test_models_pulling_at_once_share_the_streams(origin, tmp_path):
    """Two models pull now: each gets half of the node's 8 streams (one connection each)."""
    with LoopbackNginx(origin) as ng:
        alone = node(tmp_path / "a", ng.url, pulling=lambda: 1)
        busy_alone = max(pull(alone))
        used_alone = ng.connections()
        shared = node(tmp_path / "b", ng.url, pulling=lambda: 2)
        busy_shared = max(pull(shared))
        used_shared = ng.connections() - used_alone
    assert busy_shared <= 4 < busy_alone <= 8
    # the manifest's connection and the streams'
    assert used_shared <= 1 + 4 < used_alone


def test_ready_makes_the_version_current_and_runs_on_ready_once(origin, tmp_path):
    out = tmp_path / "hook.out"
    model = Model("m", on_ready=f'echo "$WAGENT_MODEL $WAGENT_VERSION $WAGENT_PATH" >> {out}')
    with LoopbackNginx(origin) as ng:
        pulls = node(tmp_path, ng.url, models=(model,))
        pull(pulls)
    assert pointers.current(pulls.store, "m") is None
    what = pulls.ready(model, "v1")
    assert what is not None
    assert pointers.current(pulls.store, "m") == "v1"
    assert out.read_text().split() == ["m", "v1", str(pulls.store.version_dir("m", "v1"))]
    assert pulls.ready(model, "v1") is None          # current already (a restart): no hook
    assert len(out.read_text().splitlines()) == 1


# -- the publication time and the manifest --------------------------------------------------------
def test_published_is_the_manifests_time(origin, tmp_path):
    with LoopbackNginx(origin) as ng:
        pulls = node(tmp_path, ng.url)
        got = pulls.published(MODEL, "v1")
    doc = json.loads((origin / "m" / "v1" / "manifest.json").read_bytes())
    assert got == published_ts(doc["published"])
    assert not (tmp_path / "state" / "seen.json").exists()


def test_published_falls_back_to_first_seen_kept_across_a_restart(origin, tmp_path):
    """A manifest whose time can't be read: the time this node first learned of the version,
    the same after a restart (a new NodePulls, later), so its slot doesn't move."""
    root = tmp_path / "o"
    shutil.copytree(origin / "m" / "v1", root / "m" / "v2")
    publish_dir(root / "m" / "v2", piece_size=2**20)
    path = root / "m" / "v2" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["published"] = "2026-02-30T00:00:00Z"       # well formed, no such day
    path.write_text(json.dumps(doc))
    with LoopbackNginx(root) as ng:
        first = node(tmp_path, ng.url, clock=Clock(5000.0))
        assert first.published(MODEL, "v2") == 5000.0
        again = node(tmp_path, ng.url, clock=Clock(9000.0))
        assert again.published(MODEL, "v2") == 5000.0
        assert again.first_seen("m", "v3") == 9000.0
    assert json.loads((tmp_path / "state" / "seen.json").read_text()) == {
        "m/v2": 5000.0, "m/v3": 9000.0}


def test_the_manifest_read_for_the_publication_time_is_the_one_pulled(origin, tmp_path):
    """One fetch of the manifest per pull: the one ``published`` read serves the pull; a retry
    (a new pull) reads it afresh, and one read for another version is not used."""
    with FaultyServer(origin) as srv:
        pulls = node(tmp_path, srv.url)
        pulls.published(MODEL, "v1")
        assert manifest_requests(srv) == 1
        pull(pulls)
        assert manifest_requests(srv) == 1
        assert pulls.have(MODEL, "v1")

        other = node(tmp_path / "other", srv.url)
        other.published(MODEL, "v1")
        with pytest.raises(engine.PullError):
            pull(other, "v9")                        # not the version read: fetched (404)
        assert manifest_requests(srv) == 3


def test_a_manifest_given_for_another_version_is_refused(origin, tmp_path):
    raw = (origin / "m" / "v1" / "manifest.json").read_bytes()
    with FaultyServer(origin) as srv:
        fetched = engine.fetch_manifest([Source(srv.url)], "m", "v1", PullOptions(),
                                        connections=CONNECTIONS)
        assert fetched[0] == raw
        with pytest.raises(engine.PullError, match="names m/v1, not m/v2"):
            pull_version([Source(srv.url)], "m", "v2", Store(tmp_path / "store"),
                         manifest=fetched, connections=CONNECTIONS)


# -- the store's cleaning at a pull start ---------------------------------------------------------
def test_a_pull_start_short_of_space_cleans_the_store_once(tmp_path, monkeypatch):
    """A manifest claiming more than the disk holds: the start tidies the store, then gives
    back the space of the partial files it doesn't want, once; it is not cleaned again on the
    way out. (The calls are watched, and made for real.)"""
    size = 2**43                                           # 8 TiB, a sparse claim
    if shutil.disk_usage(tmp_path).free >= size:
        pytest.skip("the disk holds the claim")
    d = tmp_path / "o" / "huge" / "v1"
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(b"w")
    publish_dir(d)
    doc = json.loads((d / "manifest.json").read_bytes())
    doc["files"][0].update(size=size, pieces=[{"offset": 0, "size": size, "sha256": "1" * 64}])
    (d / "manifest.json").write_text(json.dumps(doc))
    calls: list[bool] = []
    real = space.clean

    def clean(*args, **kwargs):
        calls.append(kwargs.get("wanted") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(space, "clean", clean)
    store = Store(tmp_path / "store")
    with LoopbackNginx(tmp_path / "o") as ng, \
            pytest.raises(StoreFull, match="no space left in the store"):
        pull_version([Source(ng.url)], "huge", "v1", store, options=PullOptions(retries=0),
                     connections=CONNECTIONS)
    assert calls == [False, True]        # the start's tidying, the space given back
    assert list(store.partial.glob("*.part")) == []


# -- the wiring the application gives the worker --------------------------------------------------
def test_the_worker_runs_on_node_pulls_with_the_real_schedule(origin, tmp_path):
    """agent.application's wiring: each of the worker's functions is the NodePulls method of
    its name; the worker waits for the slot agent.schedule gives this node, then pulls, and
    the version is made current."""
    doc = json.loads((origin / "m" / "v1" / "manifest.json").read_bytes())
    pub = published_ts(doc["published"])
    clock = Clock(pub)
    with FaultyServer(origin) as srv:
        pulls = node(tmp_path, srv.url, clock=clock)
        deps = worker_deps(pulls)
        for name in ("resolve", "published", "schedule", "window", "have", "local_version",
                     "pull", "evict", "poll_after", "ready", "stall_after"):
            assert getattr(deps, name) == getattr(pulls, name), name
        assert deps.clock is clock
        worker = Worker(pulls.policy, deps)
        wait = worker.step("m")
        (info,) = worker.snapshot()
        slot = schedule.slot(pub, "node-a", "gpu", "m", "v1", pulls.policy)
        assert (info.state, info.version, info.slot_at) == ("waiting_slot", "v1", slot)
        assert 0 < wait <= slot - pub       # the slot, or the next poll of `latest` first
        clock.now = slot
        worker.step("m")
        (info,) = worker.snapshot()
        assert (info.state, info.local_version) == ("done", "v1")
        assert pointers.current(pulls.store, "m") == "v1"
        assert manifest_requests(srv) == 1


# -- a cache tells its cluster ------------------------------------------------------------------
def test_a_cache_tells_its_cluster_of_a_version_it_starts_and_a_node_told_looks_now(
        origin, tmp_path):
    peer = node(tmp_path / "peer", "http://127.0.0.1:1/")
    cache_catalog = Catalog(lambda: cache.store)
    looked: list[tuple[str, str | None]] = []
    # what the cache names as latest when the peer looks: the version it pulls, already
    peer.poll_now = lambda model: looked.append((model, cache_catalog.latest(model)))
    # the peer's clock stands still: its once-a-second bound holds through the test
    peer_catalog = Catalog(lambda: peer.store, told=peer.told, clock=lambda: 100.0)
    server = PeerServer("127.0.0.1", 0, peer_catalog, Demand(), lambda: peer.store,
                        upload=TokenBucket(None), wait=lambda: 1.0, max_connections=4)
    server.start()
    try:
        here = f"http://127.0.0.1:{server.port}"
        down = "http://127.0.0.1:1"                 # a peer that is down: the others still hear
        with LoopbackNginx(origin) as ng:
            cache = node(tmp_path / "cache", ng.url, role="cache")
            cache.offer = cache_catalog.offering
            cache.cluster = lambda: (down, here)
            pull(cache)
        assert wait_for(lambda: looked == [("m", "v1")])
        # Only a model of the node's policy; at most once a second per model, whoever asks.
        assert tell([here], "other", CONNECTIONS) == 0
        assert tell([here, down], "m", CONNECTIONS) == 1 and looked == [("m", "v1")]
    finally:
        server.stop()
