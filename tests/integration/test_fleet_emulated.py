"""An emulated fleet (tests/fleet_bed.py): an origin whose egress is the bottleneck, two clusters
of a cache node and three nodes (inference, evaluation, training) behind the cluster's own link,
every host a real `wagent run` with one policy. Small versions (tens of MiB) and waves seconds
apart, so it fits CI; tests/bench/fleet.py runs the same fleet bigger and prints the numbers.

A small first version is rolled out to start from, so the caches announce a version (a cache's
`latest` names only what it holds completely). Then, checked from nginx's own logs and the
daemons' status:

* a new version: the origin sends about one copy per cluster (<= 1.02; files a node already
  holds, such as an unchanged index, are copied locally) and only the caches poll
  its `latest`; every node gets it from its cache, in wave order within its cluster, in a time
  near its link's bound after its start, and near what `wagent plan` predicted (timing is
  asserted loosely here; the bench holds the targets);
* a version changing two layers: the origin sends only those, once per cluster, and each node
  fetches only those from its cache;
* a cache killed mid-rollout: its cluster's nodes fall back to the origin and finish; the cache,
  restarted, resumes its pull (without fetching again what it had) and serves again.
"""

from __future__ import annotations

import time

import pytest

from tests import modelgen
from tests.fleet_bed import MODEL, EmulatedFleet, FleetSpec, accuracy, link_bound, version_bytes

pytestmark = pytest.mark.netns

MIB = 1 << 20


def table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}")
    for row in rows:
        print("  " + "  ".join(f"{v:8.2f}" if isinstance(v, float) else f"{v:<16}"
                               for v in row))


def test_emulated_fleet_with_caches(testbed):
    fleet = EmulatedFleet(testbed, FleetSpec())
    clusters = fleet.spec.clusters
    caches = {c: fleet.cache(c) for c in clusters}
    cache_ips = {h.ip for h in caches.values()}
    try:
        fleet.start()

        # -- a first version, so that the caches have one to announce ------------------------
        fleet.publish("v0", lambda d: modelgen.generate(d, layers=2, hidden=128, shards=1,
                                                        seed=7))
        fleet.wait_done("v0", 120)
        for c in clusters:
            assert (caches[c].store / "models" / MODEL / "latest").read_text() \
                == f"v0\nwagent-announced-by {caches[c].id}\n"

        # -- a new version ---------------------------------------------------------------------
        v1_dir = fleet.origin_root / MODEL / "v1"
        t0 = time.time()
        v1 = fleet.publish("v1", lambda d: modelgen.generate_sized(d, 24 * MIB, shards=4,
                                                                  seed=1, layers=8))
        done = fleet.wait_done("v1", 150)
        t1 = time.time()
        for c in clusters:
            hosts = fleet.in_cluster(c)
            sent = fleet.origin_bytes("v1", {h.ip for h in hosts})
            assert 0.99 * v1.size <= sent <= 1.02 * v1.size, (c, sent / v1.size)
            log = fleet.cache_log(c)
            for h in hosts:
                if h.role == "cache":
                    continue
                assert fleet.origin_bytes("v1", {h.ip}) == 0, h.id
                assert 0.99 * v1.size <= version_bytes(log, "v1", {h.ip}) <= v1.size, h.id
            started = [done[f"{c}-{r}-1"]["started_at"] for r in ("inference", "evaluation",
                                                                   "training")]
            finished = [done[f"{c}-{r}-1"]["finished_at"] for r in ("inference", "evaluation",
                                                                    "training")]
            assert started == sorted(started) and finished == sorted(finished), c
            assert (caches[c].store / "models" / MODEL / "latest").read_text() \
                == f"v1\nwagent-announced-by {caches[c].id}\n"
        # the origin's `latest` is polled by the caches only: the nodes ask theirs
        assert fleet.latest_pollers(t0, t1) <= cache_ips
        bound = link_bound(fleet, v1, done)
        table("v1: seconds from start to finish, and over the link-bound time", bound)
        assert all(ratio < 2.5 for _, _, ratio in bound), bound
        acc = accuracy(fleet, v1, done)
        table("v1: finish after publication, predicted / measured / error", acc)
        # loosely (the bench holds the 20%): the plan knows each node's poll times, but a
        # loaded CI machine moves a finish of a few seconds by more than that
        assert all(abs(pred - meas) < max(0.4 * meas, 2.0) for _, pred, meas, _ in acc), acc

        # -- CPU of idle daemons ---------------------------------------------------------------
        time.sleep(2)
        before, t = fleet.cpu_seconds(), time.monotonic()
        time.sleep(5)
        after, span = fleet.cpu_seconds(), time.monotonic() - t
        idle = {k: (after[k] - before[k]) / span for k in before}
        table("CPU per idle daemon (share of one core)", sorted(idle.items()))
        assert max(idle.values()) < 0.5, idle

        # -- two layers change -----------------------------------------------------------------
        staging = testbed.tmpdir("staging") / "v2"
        delta = modelgen.next_version(v1_dir, staging, change_layers=[2, 5]).delta_bytes
        v2 = fleet.publish("v2", staging.rename, fetch=delta)
        done = fleet.wait_done("v2", 120)
        for c in clusters:
            hosts = fleet.in_cluster(c)
            sent = fleet.origin_bytes("v2", {h.ip for h in hosts})
            assert 0 < sent <= 1.02 * delta, (c, sent, delta)
            log = fleet.cache_log(c)
            for h in hosts:
                if h.role != "cache":
                    assert 0 < version_bytes(log, "v2", {h.ip}) <= 1.02 * delta, h.id
                    assert fleet.origin_bytes("v2", {h.ip}) == 0, h.id
        table("v2: finish after publication, predicted / measured / error",
              accuracy(fleet, v2, done))

        # -- a cache dies mid-rollout ----------------------------------------------------------
        dead = caches["a"]
        v3 = fleet.publish("v3", lambda d: modelgen.generate_sized(d, 24 * MIB, shards=4,
                                                                  seed=3, layers=8))
        deadline = time.monotonic() + 60
        while not ((p := fleet.pull(dead)).get("version") == "v3"
                   and p.get("bytes_done", 0) > v3.size // 4):
            assert time.monotonic() < deadline, p
            time.sleep(0.1)
        fleet.kill_cache("a")
        inference = next(h for h in fleet.in_cluster("a") if h.role == "inference")
        while (p := fleet.pull(inference)).get("version") != "v3" or p.get("state") not in (
                "pulling", "done"):
            assert time.monotonic() < deadline, p
            time.sleep(0.1)
        restarted = time.time()
        fleet.restart_cache("a")
        done = fleet.wait_done("v3", 150)
        # the node whose turn came while its cache was down got it from the origin
        assert fleet.origin_bytes("v3", {inference.ip}) >= 0.9 * v3.size
        # the cache resumed: what it had stayed, what it lacked came once (give or take the
        # pieces in flight when it died)
        assert 0.99 * v3.size <= fleet.origin_bytes("v3", {dead.ip}) <= v3.size + 8 * MIB
        # and it serves again: nodes after the restart fetched from it
        served = [r for r in fleet.cache_log("a")
                  if r["uri"].startswith(f"/{MODEL}/v3/") and r["bytes"] > 0
                  and float(r["msec"]) >= restarted]
        assert served, "the restarted cache served nothing of v3"
        assert (dead.store / "models" / MODEL / "latest").read_text() \
            == f"v3\nwagent-announced-by {dead.id}\n"
        # the other cluster never noticed
        sent_b = fleet.origin_bytes("v3", {h.ip for h in fleet.in_cluster("b")})
        assert 0.99 * v3.size <= sent_b <= 1.02 * v3.size
        assert all(p["version"] == "v3" for p in done.values())
    finally:
        fleet.stop()
