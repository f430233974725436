"""One cluster on the testbed whose nodes serve each other (issue 27), every host a real
`wagent run`:

```
  origin (nginx) ──[origin egress]──┐
  cache (wagent; nginx in "tree")  ─┤ switch   every node's download capped at ``link`` at its
  n01 .. nNN (wagent)              ─┘          switch port, its upload by wagent's egress tree
```

``design``:

* ``"peers"``: peers on; the nodes' cache source is the cache's piece server (port 8090), which
  announces a version as soon as it starts pulling it and streams verified pieces; each node
  fetches the pieces it roots from the cache (then the origin), the rest from its neighbours.
* ``"tree"``: today's design before peers: nginx over the cache's store (port 8080), which
  announces a version only once it holds all of it; every node fetches from the cache.

Everything is made inside a Testbed, which removes it all when it closes, whatever happened.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import yaml

from agent.fleet.simulate import FleetPlan, Rollout, simulate_fleet
from agent.fleet.topology import parse_topology
from agent.policy import load_policy
from tests.fleet_bed import MODEL, DaemonHosts, FleetHost, Published, version_bytes
from tests.testbed import Testbed

PEER_PORT = 8090


@dataclass(frozen=True)
class PeerSpec:
    nodes: int = 8
    link: str = "40mbit"             # every node's and the cache's, both ways
    origin_egress: str = "400mbit"
    design: str = "peers"            # or "tree"
    neighbors: int = 6
    poll: str = "1s"
    node_poll: str | None = None     # the nodes' poll_interval, if not ``poll`` (the cache's)
    cache_lead: str = "0s"
    backoff: bool = False            # the backoff's link detector on (the training-flow test)
    streams: int | None = None       # None: the shipped default (adaptive); else fixed
    debug: bool = False              # the daemons log at debug level


class PeerCluster(DaemonHosts):
    def __init__(self, tb: Testbed, spec: PeerSpec = PeerSpec()) -> None:
        self.tb, self.spec = tb, spec
        sw = tb.switch("sw")
        origin = self.origin_host = tb.host("origin")
        self.origin_ip = tb.attach(origin, sw, rate=spec.origin_egress).ip4
        self.origin_root = tb.tmpdir("origin")
        (self.origin_root / MODEL).mkdir()
        self.origin = tb.nginx(origin, root=self.origin_root, port=8080)
        # Named as `wagent plan --fleet` names the nodes of cluster "a" (``topology_text``):
        # the daemons hash their ids into poll phases, and so does the plan.
        self.cache = self._add(sw, "cache", "a-cache-1", "cache")
        self.nodes = [self._add(sw, f"n{i:02d}", f"a-inference-{i}", "inference")
                      for i in range(1, spec.nodes + 1)]
        self.hosts = [self.cache, *self.nodes]
        self.daemon_args = ("-vv",) if spec.debug else ()
        for h in self.hosts:
            doc = dict(self._policy(), store={"path": str(h.store), "keep_versions": 2})
            if spec.node_poll is not None and h is not self.cache:
                doc["poll_interval"] = spec.node_poll
            h.policy.write_text(yaml.safe_dump(doc, sort_keys=False))


    def _add(self, sw: Any, name: str, node_id: str, role: str) -> FleetHost:
        host = self.tb.host(name)
        # The download is capped at the switch port; the upload at the host's own egress, by
        # wagent's HTB tree (shaping.link_rate), as on a real node: its default class (ACKs
        # of the node's own pulls, training traffic) goes before the distribution class (what
        # it serves). A testbed cap there instead would queue those ACKs behind the uploads.
        ep = self.tb.attach(host, sw, rate_back=self.spec.link)
        for args in (["down"], ["name", "eth0"], ["up"]):
            host.run(["ip", "link", "set", "dev", ep.ifname if args != ["up"] else "eth0",
                      *args])
        return FleetHost(node_id, "a", role, host, ep.ip4, self.tb.tmpdir(f"node-{name}"))

    def _policy(self) -> dict[str, Any]:
        s = self.spec
        peers = s.design == "peers"
        cache_url = f"http://{self.cache.ip}:{PEER_PORT if peers else 8080}"
        doc: dict[str, Any] = {
            "version": 1,
            "roles": {"cache": {"hosts": ["*-cache-*"]}, "inference": {"hosts": ["*-inference-*"]}},
            "default_role": "inference",
            "cache_role": "cache",
            "waves": {"order": ["inference"], "gap": "1s", "spread": "0s",
                      "cache_lead": s.cache_lead},
            "sources": [{"url": cache_url, "cache": True},
                        {"url": f"http://{self.origin_ip}:8080"}],
            "models": [{"name": MODEL, "version": "latest"}],
            "poll_interval": s.poll,
            "pulls": {"piece_size": "1MiB"},
            "shaping": {"enabled": True, "interfaces": ["eth0"], "link_rate": s.link,
                        "serve_ports": [8080]},
            # The backoff runs (it sizes the pulls' receive windows); without a training flow
            # its link detector stays out of the way (the training-flow test turns it on).
            # A tick of 200 ms, as the emulated fleet's: 25 daemons share this machine's two
            # cores (the detectors' ticks cost CPU, not what is measured here).
            "backoff": {"tick": "200ms", "training_ports": [29500], "nccl_processes": False,
                        **({} if s.backoff else {"link_threshold": "10gbit"}),
                        **({"enabled": False} if os.environ.get("PEERS_NO_BACKOFF") else {})},
            "metrics": {"listen": None},
            "control": {"socket": "/run/wagent/unused.sock"},
            "state_dir": "/var/lib/wagent/unused",
        }
        if s.streams is not None:
            doc["pulls"].update(streams=s.streams, adaptive_streams=False)
        if peers:
            doc["peers"] = {"enabled": True, "port": PEER_PORT, "neighbors": s.neighbors,
                            "hosts": [h.ip for h in self.nodes]}
        return doc

    def topology_text(self) -> str:
        """The same cluster, as `wagent plan --fleet` reads it."""
        s = self.spec
        return (f"version: 1\norigin: {{egress: {s.origin_egress}}}\nefficiency: 0.95\n"
                f"clusters:\n  a: {{node_link: {s.link}, nodes: {{inference: {s.nodes}}}, "
                f"cache: {{nodes: 1}}}}\n")

    def plan(self, p: Published, cold: bool = False) -> FleetPlan:
        """What `wagent plan --fleet` says of this rollout (``cold``: the model's first)."""
        policy = load_policy(self.cache.policy)
        topo = parse_topology(self.topology_text(), "peer cluster")
        return simulate_fleet(topo, policy, Rollout(p.size, p.fetch, p.published, MODEL,
                                                    p.version, cold))

    def kill(self, h: FleetHost) -> None:
        for p in (h.proc, h.nginx):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    # -- what the servers saw -----------------------------------------------------------------
    def cache_sent(self, version: str, before: int = 0) -> int:
        """Bytes of the version's files the cache sent: its piece server's (less ``before``,
        what it had sent until the version was published), or its nginx's."""
        if self.spec.design == "peers":
            doc = self.status(self.cache) or {}
            return int((doc.get("peers") or {}).get("served_bytes", 0)) - before
        return version_bytes(self.nginx_log(self.cache), version)
