"""An emulated fleet on the testbed, every host a real `wagent run`; and the same fleet described
for `wagent plan`, so that the plan's predictions can be held against what happened.

```
  origin (nginx) ──[origin egress]── core ──[cluster link]── switch a ── a-cache (nginx + wagent)
                                       │                        ├─[node link]── a-inference-1
                                       │                        ├─[node link]── a-evaluation-1
                                       │                        └─[node link]── a-training-1
                                       └──[cluster link]── switch b ── b-cache, b-inference-1, ...
```
Every host runs `wagent run` with the fleet's one policy (only ``store.path`` differs: each host
keeps its own store). Its sources are the cluster's cache, then the origin: the cache is reached
at one address in every cluster (10.99.0.1 on the cache node's loopback, each cluster's nodes
routing it to their own cache, as an anycast service address would), so the policy needs no
per-cluster entry. Hosts are named for the plan's node ids (``a-inference-1``); the daemons
hash those ids, so the plan's slots are theirs. Every interface that wagent shapes is ``eth0``.

The bottlenecks are the testbed's HTB classes: the origin's egress on its link to the core, each
cluster's downlink on the core's switch port, each node's download on its switch port. A cache
node's serving rate is capped by wagent's own egress shaping (``shaping.ceil`` on the serve
port), as the cache's nginx site says to do.

Everything is made inside a Testbed, which removes it all (namespaces, links, processes, files)
when it closes, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from agent.control import ControlError, call
from agent.fleet.simulate import FleetPlan, Rollout, simulate_fleet
from agent.fleet.topology import parse_topology
from agent.manifest import published_ts
from agent.policy import load_policy
from tests.testbed import REPO, WAGENT, Host, Testbed
from tests.testbed.hosts import wait_listening
from tests.testbed.nginx import LOG_FORMAT

MODEL = "llama"
SERVICE_IP = "10.99.0.1"          # every cluster's cache, as its nodes see it
ROLES = ("inference", "evaluation", "training")


@dataclass(frozen=True)
class FleetSpec:
    clusters: tuple[str, ...] = ("a", "b")
    origin_egress: str = "160mbit"
    cluster_link: str = "1gbit"
    node_link: str = "80mbit"
    cache_link: str = "200mbit"
    cache_egress: str = "400mbit"     # shaping.ceil: caps the cache's serving (and every pull)
    gap: str = "4s"
    spread: str = "1s"
    cache_lead: str = "6s"
    poll: str = "1s"
    streams: int = 4


@dataclass
class FleetHost:
    id: str                      # the plan's node id, also hostname and node id of the daemon
    cluster: str
    role: str
    host: Host
    ip: str
    dir: Path
    proc: subprocess.Popen | None = None
    nginx: subprocess.Popen | None = None      # cache nodes: nginx over the store
    nginx_dir: Path | None = None

    @property
    def store(self) -> Path:
        return self.dir / "store"

    @property
    def socket(self) -> Path:
        return self.dir / "control.sock"

    @property
    def policy(self) -> Path:
        return self.dir / "policy.yaml"


@dataclass
class Published:
    version: str
    published: float             # POSIX seconds, as in the manifest (the daemons' slots)
    size: int                    # distinct bytes of the version
    fetch: int                   # what a node holding the previous version fetches
    manifest: dict[str, Any] = field(repr=False, default_factory=dict)


class DaemonHosts:
    """Hosts that each run a real `wagent run` (and cache nodes nginx over their store), with
    an nginx origin: what every emulated fleet shares. A subclass builds ``hosts`` and
    ``origin_root``; ``daemon_args`` go before `run` (verbosity)."""

    tb: Testbed
    hosts: list[FleetHost]
    origin_root: Path
    origin: Any                      # its nginx (tests.testbed.nginx)
    daemon_args: tuple[str, ...] = ("-v",)
    piece_size = "1MiB"

    def start(self) -> None:
        """Cache nodes' nginx, then every daemon; returns once each answers status."""
        for h in self.hosts:
            if h.role == "cache":
                (h.store / "models").mkdir(parents=True, exist_ok=True)
                self.start_nginx(h)
        for h in self.hosts:
            self.start_daemon(h)
        deadline = time.monotonic() + 90
        for h in self.hosts:
            while self.status(h) is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{h.id} never answered status\n{self.logs()}")
                if h.proc is not None and h.proc.poll() is not None:
                    raise AssertionError(f"{h.id} exited {h.proc.returncode}\n{self.logs()}")
                time.sleep(0.2)

    def start_daemon(self, h: FleetHost) -> None:
        h.proc = h.host.popen([WAGENT, *self.daemon_args, "run", "--policy", str(h.policy),
                               "--hostname", h.id, "--node-id", h.id, "--state-dir",
                               str(h.dir / "state"), "--socket", str(h.socket)],
                              log=f"wagent-{h.id}")

    def start_nginx(self, h: FleetHost) -> None:
        """nginx on a cache node with the site we ship, over its store, logging as JSON."""
        if h.nginx_dir is None:
            d = h.nginx_dir = self.tb.tmpdir(f"nginx-{h.id}")
            site = (REPO / "packaging/nginx/wagent-cache.conf").read_text()
            site = site.replace("/var/cache/wagent/models", str(h.store / "models"))
            lines = [f"    access_log {d}/access.log wagent;" if "access_log" in line
                     else line.replace("/var/log/nginx/", f"{d}/") for line in site.splitlines()]
            (d / "site.conf").write_text("\n".join(lines) + "\n")
            (d / "nginx.conf").write_text(
                f"daemon off;\nuser root;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n"
                f"events {{}}\nhttp {{\n  log_format wagent escape=json '{LOG_FORMAT}';\n"
                f"  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n"
                f"  fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n"
                f"  scgi_temp_path {d}/scgi;\n  include {d}/site.conf;\n}}\n")
        d = h.nginx_dir
        h.nginx = h.host.popen(["nginx", "-p", str(d), "-e", f"{d}/error.log", "-c",
                                f"{d}/nginx.conf"], log=f"nginx-{h.id}")
        wait_listening(h.nginx, h.host.ns, 8080, f"nginx on {h.id}", log=d / "error.log")

    def stop(self) -> None:
        """SIGTERM every daemon (the testbed kills whatever is left when it closes)."""
        procs = [h.proc for h in self.hosts if h.proc is not None and h.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, version: str, build: Any, fetch: int | None = None) -> Published:
        """Write a version on the origin (``build(dir)`` makes its files and returns its
        modelgen spec), its manifest, then `latest` last, as a publisher does. The manifest's
        publication time is set to the moment `latest` appears: the daemons' slots count from
        it, and so does the plan."""
        vdir = self.origin_root / MODEL / version
        build(vdir)
        subprocess.run([WAGENT, "manifest", "build", "-q", "--piece-size", self.piece_size,
                        str(vdir)], check=True, timeout=120)
        mpath = vdir / "manifest.json"
        manifest = json.loads(mpath.read_text())
        now = time.time()
        manifest["published"] = datetime.fromtimestamp(now, UTC).strftime(
            "%Y-%m-%dT%H:%M:%S.%fZ")
        mpath.write_text(json.dumps(manifest))
        (self.origin_root / MODEL / "latest").write_text(version + "\n")
        size = sum({f["sha256"]: f["size"] for f in manifest["files"]}.values())
        return Published(version, published_ts(manifest["published"]), size,
                         size if fetch is None else fetch, manifest)

    # -- watching -----------------------------------------------------------------------------
    def status(self, h: FleetHost) -> dict[str, Any] | None:
        try:
            return call(str(h.socket), "status", timeout=5.0)
        except (ControlError, OSError):
            return None

    def pull(self, h: FleetHost) -> dict[str, Any]:
        doc = self.status(h) or {}
        return (doc.get("pulls") or [{}])[0]

    def wait_done(self, version: str, timeout: float,
                  hosts: list[FleetHost] | None = None, every: float = 0.3
                  ) -> dict[str, dict[str, Any]]:
        """Every host's pull status once it reports ``version`` done (each host asked
        ``every`` seconds: a status costs the daemon its shaping's netlink dumps, which two
        dozen daemons asked thrice a second feel on two cores)."""
        hosts = hosts or self.hosts
        done: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < len(hosts):
            for h in hosts:
                if h.id not in done:
                    p = self.pull(h)
                    if p.get("version") == version and p.get("state") == "done" \
                            and p.get("finished_at"):
                        done[h.id] = p
            if len(done) == len(hosts):
                break
            if time.monotonic() > deadline:
                missing = {h.id: self.pull(h) for h in hosts if h.id not in done}
                raise AssertionError(f"not done with {version} after {timeout:.0f} s: "
                                     f"{missing}\n{self.logs()}")
            time.sleep(every)
        return done

    def origin_bytes(self, version: str, ips: set[str] | None = None) -> int:
        """Bytes of the version's files (not its manifest) the origin sent, per nginx's log."""
        return version_bytes(self.origin.requests(), version, ips)

    def nginx_log(self, h: FleetHost) -> list[dict[str, Any]]:
        """What a cache node's nginx served, per its access log."""
        path = h.nginx_dir / "access.log" if h.nginx_dir is not None else None
        if path is None or not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each daemon used so far."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for h in self.hosts:
            if h.proc is not None and h.proc.poll() is None:
                fields = Path(f"/proc/{h.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[h.id] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def logs(self) -> str:
        return self.tb.logs(3000)


class EmulatedFleet(DaemonHosts):
    def __init__(self, tb: Testbed, spec: FleetSpec = FleetSpec()) -> None:
        self.tb, self.spec = tb, spec
        self.hosts: list[FleetHost] = []
        origin = tb.host("origin")
        core = tb.host("core")
        link = tb.connect(origin, core, rate=spec.origin_egress)
        self.origin_ip = link.a.ip4
        self.origin_root = tb.tmpdir("origin")
        (self.origin_root / MODEL).mkdir()
        self.origin = tb.nginx(origin, root=self.origin_root, port=8080)
        for c in spec.clusters:
            sw = tb.switch(f"sw-{c}")
            core_ep = tb.attach(core, sw, rate=spec.cluster_link)
            subnet = core_ep.ip4.rsplit(".", 1)[0]
            origin.add_route(f"{subnet}.0/24", link.b.ip4)
            cache = self._add(sw, core_ep.ip4, f"{c}-cache", c, "cache", spec.cache_link)
            cache.host.run(["ip", "addr", "add", f"{SERVICE_IP}/32", "dev", "lo"])
            for role in ROLES:
                h = self._add(sw, core_ep.ip4, f"{c}-{role[:3]}", c, role, spec.node_link)
                h.host.add_route(f"{SERVICE_IP}/32", cache.ip)
        self.policy_doc = self._policy()
        for h in self.hosts:
            doc = dict(self.policy_doc, store={"path": str(h.store), "keep_versions": 2})
            h.policy.write_text(yaml.safe_dump(doc, sort_keys=False))

    # -- building ---------------------------------------------------------------------------
    def _add(self, sw: Any, core_ip: str, name: str, cluster: str, role: str,
             download: str) -> FleetHost:
        host = self.tb.host(name)
        ep = self.tb.attach(host, sw, rate_back=download)
        # One policy names one interface: every host's is eth0.
        for args in (["down"], ["name", "eth0"], ["up"]):
            host.run(["ip", "link", "set", "dev", ep.ifname if args != ["up"] else "eth0",
                      *args])
        host.add_route("10.200.0.0/16", core_ip)
        node_id = f"{cluster}-{role}-1"
        h = FleetHost(node_id, cluster, role, host, ep.ip4, self.tb.tmpdir(f"node-{name}"))
        self.hosts.append(h)
        return h

    def _policy(self) -> dict[str, Any]:
        s = self.spec
        return {
            "version": 1,
            "roles": {r: {"hosts": [f"*-{r}-*"]} for r in ("cache", *ROLES)},
            "default_role": "training",
            "cache_role": "cache",
            "waves": {"order": list(ROLES), "gap": s.gap, "spread": s.spread,
                      "cache_lead": s.cache_lead},
            "sources": [{"url": f"http://{SERVICE_IP}:8080", "cache": True},
                        {"url": f"http://{self.origin_ip}:8080"}],
            "models": [{"name": MODEL, "version": "latest"}],
            "poll_interval": s.poll,
            "pulls": {"streams": s.streams, "piece_size": "1MiB", "retries": 2,
                      "connect_timeout": "2s", "read_timeout": "5s"},
            "shaping": {"enabled": True, "interfaces": ["eth0"], "link_rate": "1gbit",
                        "pull_ports": [8080], "serve_ports": [8080], "rate": "1mbit",
                        "ceil": s.cache_egress},
            # Backoff stays out of the way: no training traffic here, and the link detector
            # would count a cache's serving as "other traffic" at these small rates.
            "backoff": {"tick": "200ms", "floor": "4mbit", "link_threshold": "10gbit",
                        "training_ports": [29500], "nccl_processes": False},
            "metrics": {"listen": None},
            "control": {"socket": "/run/wagent/unused.sock"},    # --socket per host
            "state_dir": "/var/lib/wagent/unused",                # --state-dir per host
        }

    def topology_text(self) -> str:
        """The same fleet, as `wagent plan --fleet` reads it."""
        s = self.spec
        clusters = "\n".join(
            f"  {c}: {{link: {s.cluster_link}, node_link: {s.node_link}, nodes: "
            f"{{{', '.join(f'{r}: 1' for r in ROLES)}}}, cache: {{nodes: 1, egress: "
            f"{s.cache_egress}, link: {s.cache_link}}}}}" for c in s.clusters)
        return (f"version: 1\norigin: {{egress: {s.origin_egress}}}\nefficiency: 0.95\n"
                f"clusters:\n{clusters}\n")

    # -- running ----------------------------------------------------------------------------
    def kill_cache(self, cluster: str) -> FleetHost:
        """The cache node dies: its daemon and its nginx, at once (SIGKILL)."""
        h = self.cache(cluster)
        for p in (h.proc, h.nginx):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        return h

    def restart_cache(self, cluster: str) -> None:
        h = self.cache(cluster)
        self.start_nginx(h)
        self.start_daemon(h)

    def cache(self, cluster: str) -> FleetHost:
        return next(h for h in self.hosts if h.cluster == cluster and h.role == "cache")

    def in_cluster(self, cluster: str) -> list[FleetHost]:
        return [h for h in self.hosts if h.cluster == cluster]

    # -- what the servers saw -----------------------------------------------------------------
    def cache_log(self, cluster: str) -> list[dict[str, Any]]:
        return self.nginx_log(self.cache(cluster))

    def latest_pollers(self, since: float, until: float) -> set[str]:
        """The addresses that asked the origin for `latest` in a time span."""
        return {r["remote"] for r in self.origin.requests()
                if r["uri"] == f"/{MODEL}/latest" and since <= float(r["msec"]) <= until}

    # -- the plan -------------------------------------------------------------------------------
    def plan(self, p: Published, cold: bool = False) -> FleetPlan:
        """What `wagent plan --fleet` says of this rollout (``cold``: the model's first)."""
        policy = load_policy(self.hosts[0].policy)
        topo = parse_topology(self.topology_text(), "emulated fleet")
        return simulate_fleet(topo, policy, Rollout(p.size, p.fetch, p.published, MODEL,
                                                    p.version, cold))


def version_bytes(requests: list[dict[str, Any]], version: str,
                  ips: set[str] | None = None) -> int:
    prefix = f"/{MODEL}/{version}/"
    return sum(r["bytes"] for r in requests
               if r["uri"].startswith(prefix) and not r["uri"].endswith("/manifest.json")
               and (ips is None or r["remote"] in ips))


@dataclass(frozen=True)
class Timing:
    """One node's start and finish after publication, as planned and as its daemon reported."""

    node: str
    planned_start: float
    start: float
    planned: float
    measured: float

    @property
    def error(self) -> float:
        """Of the finish, relative to the measured one."""
        return abs(self.planned - self.measured) / self.measured


def timings(fleet: EmulatedFleet, p: Published, done: dict[str, dict[str, Any]],
            cold: bool = False) -> list[Timing]:
    plan = fleet.plan(p, cold)
    inf = float("inf")
    return [Timing(n.node, (n.start or inf) - p.published,
                   done[n.node]["started_at"] - p.published, (n.done or inf) - p.published,
                   done[n.node]["finished_at"] - p.published) for n in plan.nodes]


def accuracy(fleet: EmulatedFleet, p: Published, done: dict[str, dict[str, Any]],
             cold: bool = False) -> list[tuple[str, float, float, float]]:
    """(node, predicted, measured, error) per node: finish times after publication, the
    error relative to the measured one."""
    return [(t.node, t.planned, t.measured, t.error) for t in timings(fleet, p, done, cold)]


def link_bound(fleet: EmulatedFleet, p: Published, done: dict[str, dict[str, Any]]
               ) -> list[tuple[str, float, float]]:
    """(node, seconds from its start to its finish, that over its link-bound time): the bytes
    it fetched over its share of the bottleneck it sits behind. Its start is its slot, or when
    it learned of the version if that came later (a cache node's slot is within a second of the
    publication, before its next poll of `latest`). A cache node shares the origin's egress with
    the other cluster's cache; a node behind its cache has its own link to itself (one node per
    wave per cluster), at the headers' efficiency (0.95)."""
    from agent.units import parse_rate

    s = fleet.spec
    caches = len(s.clusters)
    out = []
    for h in fleet.hosts:
        if h.role == "cache":
            rate = min(parse_rate(s.origin_egress) / caches, parse_rate(s.cache_link))
        else:
            rate = min(parse_rate(s.node_link), parse_rate(s.cache_egress))
        bound = p.fetch / (rate * 0.95 / 8)
        took = done[h.id]["finished_at"] - max(done[h.id]["slot_at"], done[h.id]["started_at"])
        out.append((h.id, took, took / bound))
    return out
