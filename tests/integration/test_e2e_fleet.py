"""End to end on the testbed: `wagent run` on three node hosts (inference, evaluation, training)
and an nginx origin, waves shrunk to seconds.

One version is published while the daemons run. Checked: the wave order; a training flow on the
training node backs its pull off to the floor (kernel ceil and status); SIGHUP with a broken
policy keeps the old one and status shows the error with file:line; kill -9 mid-pull and a
restart adopt the caps (no second tree) and resume without re-fetching finished pieces; SIGTERM
mid-pull exits within 5 s keeping partials and caps;
`wagent status --json` field by field. A second test puts a cache node in front of the three
and checks that the origin serves each byte of the version once for the whole testbed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.daemon_helpers import Node, node_policy, pull_state, start, status, wait_until
from tests.testbed import REPO, WAGENT
from tests.testbed.hosts import wait_listening

pytestmark = pytest.mark.netns

MODEL = "llama"
VERSION = "v1"
STREAMS = 4


def publish(origin_root: Path) -> dict:
    """Publish llama/v1 on the origin (files, manifest, then `latest` last)."""
    from tests.modelgen import generate

    vdir = origin_root / MODEL / VERSION
    generate(vdir, layers=4, hidden=512, shards=4, seed=1)
    subprocess.run([WAGENT, "manifest", "build", "-q", "--piece-size", "1MiB", str(vdir)],
                   check=True, timeout=60)
    (origin_root / MODEL / "latest").write_text(VERSION + "\n")
    return json.loads((vdir / "manifest.json").read_text())


def version_bytes(srv, remote: str | None = None) -> int:
    """Bytes of the version's files (not its manifest) the server sent, to one address or all."""
    prefix = f"/{MODEL}/{VERSION}/"
    return sum(r["bytes"] for r in srv.requests()
               if r["uri"].startswith(prefix) and not r["uri"].endswith("/manifest.json")
               and (remote is None or r["remote"] == remote))


def distinct_size(manifest: dict) -> int:
    return sum({f["sha256"]: f["size"] for f in manifest["files"]}.values())


def wagent_qdiscs(node: Node) -> str:
    return node.host.run(["tc", "qdisc", "show"]).stdout


def test_fleet_waves_backoff_reload_restart(testbed):
    tb = testbed
    origin = tb.host("origin")
    sw = tb.switch("sw")
    o_ep = tb.attach(origin, sw)
    origin_root = tb.tmpdir("origin")
    srv = tb.nginx(origin, root=origin_root, port=8080)
    tb.iperf3_server(origin, port=29500)
    roles = {"inference": "inf-*", "evaluation": "eval-*", "training": "trn-*"}
    nodes = []
    for name, hostname in (("inf", "inf-1"), ("eval", "eval-1"), ("trn", "trn-1")):
        h = tb.host(name)
        ep = tb.attach(h, sw)
        d = tb.tmpdir(f"node-{name}")
        n = Node(name, hostname, h, ep.ifname, d, d / "policy.yaml")
        n.policy.write_text(yaml.safe_dump(node_policy(n, [srv.url_for(o_ep)],
                                                       role_hosts=roles)))
        nodes.append(n)
    inf, ev, trn = nodes
    ip = {n.name: n.host.ip4 for n in nodes}
    try:
        for n in nodes:
            start(n)
        for n in nodes:
            wait_until(f"{n.name} answers status", lambda n=n: status(n)[0] in (0, 1), 30,
                       nodes)
        # READY came after shaping: the IFB tree is there before any pull
        for n in nodes:
            assert "wg-" in wagent_qdiscs(n) or "ifb" in n.host.run(
                ["ip", "link"]).stdout, wagent_qdiscs(n)

        manifest = publish(origin_root)
        size = distinct_size(manifest)
        t_pub = time.time()

        # Training traffic on the training node before its wave comes: it must back off.
        flow = tb.iperf3_start(trn.host, server=o_ep.ip4, port=29500, seconds=20, reverse=True)

        def backed_off():
            code, doc = status(trn)
            b = doc.get("backoff", {})
            return doc if b.get("state") == "backed_off" else None

        try:
            doc = wait_until("trn backed off", backed_off, 15, nodes)
        except AssertionError:
            print("flow running:", flow.running, trn.host.run(["ss", "-tn"]).stdout,
                  json.dumps(status(trn)[1].get("backoff"), indent=1))
            raise
        # Whichever signal saw it first: the connection on the training port (an early hint,
        # scanned every few seconds) or its traffic on the link (any port, within a tick).
        assert "29500" in doc["backoff"]["reason"] or "other traffic" in doc["backoff"]["reason"]
        assert doc["backoff"]["rate_bps"] == 4_000_000
        assert doc["shaping"]["current_ceil_bps"] == 4_000_000
        dist = [c for i in doc["shaping"]["interfaces"] for c in i["classes"]
                if c["name"] == "distribution"]
        assert dist and dist[0]["ceil_bps"] == 4_000_000
        assert doc["backoff"]["events_total"] >= 1
        # the kernel agrees: the distribution class's ceil on the IFB is the floor
        tc = trn.host.run(["tc", "class", "show", "dev", dist and doc["shaping"]["interfaces"][0]
                           ["device"]]).stdout
        assert "ceil 4Mbit" in tc, tc
        wait_until("inf pulling or done", lambda: (pull_state(inf) or {}).get("state")
                   in ("pulling", "done"), 15, nodes)

        # kill -9 the evaluation node mid-pull, then restart it
        wait_until("eval pulling with progress",
                   lambda: (p := pull_state(ev)) and p["state"] == "pulling"
                   and p["bytes_done"] > size // 5, 30, nodes)
        qdiscs_before = wagent_qdiscs(ev)
        ev.proc.send_signal(signal.SIGKILL)
        ev.proc.wait(10)
        assert wagent_qdiscs(ev) == qdiscs_before          # caps stay in the kernel
        start(ev)
        wait_until("eval done", lambda: (pull_state(ev) or {}).get("state") == "done", 60,
                   nodes)
        assert wagent_qdiscs(ev).count("htb") == qdiscs_before.count("htb")   # adopted
        assert "Traceback" not in Path(ev.proc.log_path).read_text()


        # SIGHUP with a broken policy on the inference node: the old one stays
        good = inf.policy.read_text()
        good_sha = hashlib.sha256(good.encode()).hexdigest()
        inf.policy.write_text(good + "pulls:\n  streams: lots\n")
        inf.proc.send_signal(signal.SIGHUP)

        def refused():
            code, doc = status(inf)
            return (code, doc) if doc.get("policy", {}).get("last_error") else None

        code, doc = wait_until("inf shows the refused reload", refused, 15, nodes)
        assert code == 1 and doc["health"] == "degraded"
        assert doc["policy"]["sha256"] == good_sha
        assert f"{inf.policy}:" in doc["policy"]["last_error"]
        assert any("refused" in p for p in doc["problems"])
        assert inf.proc.poll() is None
        inf.policy.write_text(good)
        r = subprocess.run([WAGENT, "reload", "--socket", str(inf.socket)], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert status(inf)[0] == 0

        # SIGTERM mid-pull (the training node, held at the floor): out within 5 s, partials and
        # caps kept; the restarted daemon adopts the tree and finishes the version.
        wait_until("trn pulling", lambda: (p := pull_state(trn)) and p["state"] == "pulling"
                   and p["bytes_done"] > 0, 30, nodes)
        before = wagent_qdiscs(trn)
        t0 = time.monotonic()
        trn.proc.send_signal(signal.SIGTERM)
        assert trn.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5.0
        assert wagent_qdiscs(trn) == before
        assert any((trn.store / "partial").iterdir())
        start(trn)
        assert flow.result().bps > 0
        wait_until("trn done", lambda: (pull_state(trn) or {}).get("state") == "done", 90,
                   nodes)

        # the wave order held
        pulls = {n.name: pull_state(n) for n in nodes}
        slots = [pulls[n]["slot_at"] for n in ("inf", "eval", "trn")]
        assert slots == sorted(slots)
        assert slots[1] - slots[0] > 2 and slots[2] - slots[1] > 2
        assert all(s >= t_pub - 5 for s in slots)
        assert pulls["inf"]["started_at"] < pulls["trn"]["started_at"]
        assert pulls["trn"]["started_at"] >= slots[2] - 0.5

        # bytes from the origin: once per node, the killed one re-fetching at most in-flight
        assert version_bytes(srv, ip["inf"]) == size
        biggest = max(p["size"] for f in manifest["files"] for p in f["pieces"])
        assert size <= version_bytes(srv, ip["eval"]) <= size + STREAMS * biggest
        assert size <= version_bytes(srv, ip["trn"]) <= size + STREAMS * biggest

        # the status document, field by field, on the inference node
        code, doc = status(inf)
        assert code == 0
        assert doc["schema"] == 1 and doc["health"] == "healthy" and doc["problems"] == []
        assert doc["daemon"]["pid"] == inf.proc.pid
        assert doc["daemon"]["workers"] == {"backoff": True, "control": True, "scheduler": True}
        assert doc["daemon"]["paused"] is False and doc["daemon"]["uptime_s"] > 0
        # every timed job is on APScheduler, listed with its next run
        jobs = {j["id"]: j["next_run_at"] for j in doc["daemon"]["jobs"]}
        assert {"shaping-verify", "store-evict", "metrics"} <= set(jobs)
        assert any(j.startswith("model:") for j in jobs)
        assert jobs["store-evict"] > doc["generated_at"]
        assert doc["node"] == {"id": "inf-1", "hostname": "inf-1", "role": "inference",
                               "wave": 0, "wave_delay_s": 0.0}
        assert doc["policy"]["path"] == str(inf.policy)
        assert doc["policy"]["sha256"] == good_sha and doc["policy"]["reloads"] == 1
        assert doc["policy"]["last_error"] is None
        sh = doc["shaping"]
        assert sh["enabled"] and sh["cap_bps"] == 40_000_000 and sh["error"] is None
        (iface,) = sh["interfaces"]
        assert iface["name"] == inf.ifname and iface["direction"] == "ingress"
        assert iface["device"].startswith("wg-")
        classes = {c["name"]: c for c in iface["classes"]}
        assert classes["distribution"]["bytes"] >= size
        assert classes["distribution"]["rate_bps"] == 1_000_000
        assert {"bytes", "packets", "drops", "overlimits"} <= set(classes["default"])
        b = doc["backoff"]
        assert b["enabled"] and b["state"] in ("full", "ramping") and b["floor_bps"] == 4_000_000
        assert b["cap_bps"] == 40_000_000 and "training_connections" in b["readings"]
        (p,) = doc["pulls"]
        assert p["model"] == MODEL and p["version"] == VERSION and p["state"] == "done"
        assert p["bytes_done"] == p["bytes_total"] == size and p["percent"] == 100.0
        assert p["local_version"] == VERSION and p["error"] is None and p["eta_s"] is None
        assert p["finished_at"] > p["started_at"] >= p["slot_at"] - 0.5
        assert doc["window"] == {"open": True, "next_open": None, "closes_at": None}
        st = doc["store"]
        assert st["path"] == str(inf.store) and st["versions"] == 1
        assert st["used_bytes"] >= size and st["free_bytes"] > 0

        # SIGTERM: exits promptly, caps left in place
        before = wagent_qdiscs(inf)
        t0 = time.monotonic()
        inf.proc.send_signal(signal.SIGTERM)
        assert inf.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5.0
        assert wagent_qdiscs(inf) == before
        assert subprocess.run([WAGENT, "status", "--socket", str(inf.socket)],
                              capture_output=True, timeout=20).returncode == 3
    finally:
        stop_all(nodes)



def stop_all(nodes: list) -> None:
    """SIGTERM every daemon still running (kill after 10 s) and print each one's log tail."""
    for n in nodes:
        if n.proc is not None and n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
            try:
                n.proc.wait(10)
            except subprocess.TimeoutExpired:
                n.proc.kill()
        if n.proc is not None:
            print(f"--- {n.name}\n" + Path(n.proc.log_path).read_text()[-4000:])

def cache_nginx(tb, host, models: Path) -> None:
    """nginx on the cache host with the site snippet we ship, pointed at its store."""
    site = (REPO / "packaging/nginx/wagent-cache.conf").read_text()
    d = tb.tmpdir("nginx-cache")
    site = site.replace("/var/cache/wagent/models", str(models))
    site = site.replace("/var/log/nginx/", f"{d}/")
    (d / "site.conf").write_text(site)
    (d / "nginx.conf").write_text(
        f"daemon off;\nuser root;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n"
        f"events {{}}\nhttp {{\n  client_body_temp_path {d}/body;\n"
        f"  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fcgi;\n"
        f"  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n"
        f"  include {d}/site.conf;\n}}\n")
    proc = host.popen(["nginx", "-p", str(d), "-e", f"{d}/error.log", "-c", f"{d}/nginx.conf"],
                      log="nginx-cache")
    wait_listening(proc, host.ns, 8080, "cache nginx", log=d / "error.log")


def test_cache_node_in_front_origin_serves_each_byte_once(testbed):
    tb = testbed
    origin = tb.host("origin")
    sw = tb.switch("sw")
    o_ep = tb.attach(origin, sw)
    origin_root = tb.tmpdir("origin")
    srv = tb.nginx(origin, root=origin_root, port=8080)
    roles = {"cache": "wcache-*", "inference": "inf-*", "evaluation": "eval-*",
             "training": "trn-*"}
    c_host = tb.host("cache")
    c_ep = tb.attach(c_host, sw)
    c_dir = tb.tmpdir("node-cache")
    cache = Node("cache", "wcache-1", c_host, c_ep.ifname, c_dir, c_dir / "policy.yaml")
    (cache.store / "models").mkdir(parents=True)
    cache_nginx(tb, c_host, cache.store / "models")
    sources = [f"http://{c_ep.ip4}:8080", srv.url_for(o_ep)]
    cache.policy.write_text(yaml.safe_dump(node_policy(
        cache, [srv.url_for(o_ep)], role_hosts=roles, cache_lead="6s", serve_ports=[8080],
        ceil="500mbit")))
    nodes = [cache]
    for name, hostname in (("inf", "inf-1"), ("eval", "eval-1"), ("trn", "trn-1")):
        h = tb.host(name)
        ep = tb.attach(h, sw)
        d = tb.tmpdir(f"node-{name}")
        n = Node(name, hostname, h, ep.ifname, d, d / "policy.yaml")
        pol = node_policy(n, sources, role_hosts=roles, cache_lead="6s")
        pol["waves"]["gap"] = "1s"
        if name == "inf":       # the inference server's reload, as an operator writes it
            pol["models"][0]["on_ready"] = (f"echo $WAGENT_MODEL $WAGENT_VERSION $WAGENT_PATH "
                                            f"> {d}/ready.txt")
        n.policy.write_text(yaml.safe_dump(pol))
        nodes.append(n)
    try:
        for n in nodes:
            start(n)
        for n in nodes:
            wait_until(f"{n.name} answers status", lambda n=n: status(n)[0] in (0, 1), 30,
                       nodes)
        manifest = publish(origin_root)
        size = distinct_size(manifest)
        for n in nodes:
            wait_until(f"{n.name} done", lambda n=n: (pull_state(n) or {}).get("state")
                       == "done", 90, nodes)
        code, doc = status(cache)
        assert doc["node"]["role"] == "cache" and doc["node"]["wave"] is None
        # each byte of the version left the origin once, for the whole testbed
        assert version_bytes(srv) == size, srv.requests()
        assert version_bytes(srv, c_host.ip4) == size
        for n in nodes[1:]:
            assert version_bytes(srv, n.host.ip4) == 0       # they all got it from the cache
        # Each node points `current` at the version; the inference node's hook ran once.
        model, version = manifest["model"], manifest["version"]
        for n in nodes:
            assert os.readlink(n.store / "models" / model / "current") == version
        inf = nodes[1]
        assert (inf.dir / "ready.txt").read_text().split() == [
            model, version, str(inf.store / "models" / model / version)]
        assert pull_state(inf)["on_ready"].startswith("exit 0 after")
    finally:
        stop_all(nodes)
