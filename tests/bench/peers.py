"""Benchmark: a cluster whose nodes serve each other (tests/peer_bed.py), against the cache tree.

One cluster of a cache node and N nodes on one switch, every host a real `wagent run`, every
link shaped both ways (40 Mbit/s by default, the cache's too), the origin behind a faster link.
A model's first version (a few tens of MiB) is published with `cache_lead: 0`: neither design
gets time for the cache to fill first. For each N and design, the table gives:

* last node done over S / B: the last node's finish after publication, over the version's size
  over one link's rate (the tree: about N; target with peers <= 1.5 at every N);
* copies sent by the cache (the tree: N; target <= 1.5);
* copies sent by the origin (target 1.000);
* bytes each node got from peers, the cache and the origin (status ``bytes_by_source``);
* what `wagent plan --fleet` says of the same cluster (``PeerCluster.topology_text``, the same
  policy and node ids): its last node done on the same footing, how far that is from the
  measured one, the worst node's error (its finish after publication), and the cache's copies
  (not with a node killed or a training flow: the plan models neither).

Rows: ``tree`` (nginx over the cache's store, as before peers) and ``peers`` (the shipped
defaults with peers on). Every daemon polls ``latest`` each second unless ``--node-poll`` gives
the nodes of the peers rows another interval (the shipped one is 5m): the cache tells them of a
version as it starts it, so they need not poll to start with it. ``--kill`` also kills one
node mid-pull in the peers and torrent rows and checks that the others finish with every
file's sha256 right.

``torrent`` (issue 27: an existing engine on the same cluster, tests/torrent_bed.py): the same
switch, cache and N nodes, no wagent anywhere, every host capped at the link both ways by the
testbed (no daemon shapes the uploads). The cache is pre-seeded with the version (the same
generator and seed) and is a libtorrent seed; every node a libtorrent client (TCP only, no
DHT/LSD/UPnP/NAT-PMP, no rate limits, libtorrent's default choking: fixed_slots_choker, 8
slots, seed round_robin) of one hybrid v1+v2 torrent with 1 MiB pieces, meshed with the cache
and each other. Timing starts once every client has the torrent and is listening (a ``go``
file releases them all): no version to discover, no poll. Cache copies: the seed's payload
uploaded over S; origin copies 1.000 by construction (the cache's one fetch, not timed; no
first version: "-"); from peers: what the nodes uploaded over what they downloaded; daemons'
CPU: the clients' (seed's too). ``torrent-tuned``: every interested peer unchoked
(``unchoke_slots_limit: -1``); ``torrent-auto``: the piece size libtorrent picks itself (64 KiB
at 24-32 MiB). ``--training`` is not run in the torrent rows ("-"). Without python3-libtorrent
the torrent rows are skipped with a message; the others still run.

    python tests/bench/peers.py [--nodes 8,16,24] [--size 32MiB] [--designs tree,peers,torrent]
        (designs: tree, peers, torrent, torrent-tuned, torrent-auto)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINING_PORT = 29500
TORRENT_DESIGNS = ("torrent", "torrent-tuned", "torrent-auto")
sys.path.insert(0, str(ROOT))


def run(
    n: int,
    design: str,
    size: int,
    link: str,
    kill: bool,
    verbose: bool = False,
    streams: int | None = None,
    cache_lead: str = "0s",
    neighbors: int = 6,
    training: bool = False,
    node_poll: str | None = None,
) -> dict[str, float | str]:
    from agent.units import parse_duration, parse_rate
    from tests import modelgen
    from tests.peer_bed import MODEL, PeerCluster, PeerSpec
    from tests.testbed import Testbed

    with Testbed() as tb:
        c = PeerCluster(
            tb,
            PeerSpec(
                nodes=n,
                link=link,
                design=design,
                streams=streams,
                cache_lead=cache_lead,
                neighbors=neighbors,
                debug=verbose,
                node_poll=node_poll if design == "peers" else None,
            ),
        )
        try:
            c.start()
            # The model's first version, small: its origin copies are a row of their own;
            # after it every daemon polls in its rhythm (a poll that found no version at all
            # retries later, which would skew the start of the one timed).
            p0 = c.publish(
                "v0", lambda d: modelgen.generate_sized(d, 2 << 20, shards=1, seed=n + 1000)
            )
            c.wait_done("v0", 120)
            first_copies = c.origin_bytes("v0") / p0.size
            idle0 = c.cpu_seconds()
            time.sleep(5)
            idle1 = c.cpu_seconds()
            idle = (sum(idle1.values()) - sum(idle0.values())) / 5
            alone = None
            if training:
                tb.iperf3_server(c.origin_host, TRAINING_PORT)
                alone = tb.iperf3(c.nodes[0].host, c.origin_ip, TRAINING_PORT, seconds=5).bps
            cpu0 = c.cpu_seconds()
            served0 = int(((c.status(c.cache) or {}).get("peers") or {}).get("served_bytes", 0))
            p = c.publish("v1", lambda d: modelgen.generate_sized(d, size, shards=4, seed=n))
            flow = None
            if training:
                deadline = time.monotonic() + 30
                while not c.pull(c.nodes[0]).get("bytes_done") \
                        or c.pull(c.nodes[0]).get("version") != "v1":
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                flow = tb.iperf3_start(c.nodes[0].host, c.origin_ip, TRAINING_PORT, seconds=5)
            killed = None
            if kill and design == "peers":
                time.sleep(0.5 * size * 8 / parse_rate(link))
                killed = c.nodes[len(c.nodes) // 2]
                c.kill(killed)
            alive = [h for h in c.nodes if h is not killed]
            kept = flow.result().bps / alone if flow is not None and alone else None
            if verbose:
                trace: dict[str, list[str]] = {h.id: [] for h in [c.cache, *alive]}
                t_end = time.time() + 40
                while time.time() < t_end:
                    busy = False
                    for h in [c.cache, *alive]:
                        q = c.pull(h)
                        v1 = q.get("version") == "v1"
                        mb = int(q.get("bytes_done") or 0) >> 20 if v1 else 0
                        trace[h.id].append(f"{mb:3d}")
                        busy |= not v1 or q.get("state") != "done"
                    if not busy:
                        break
                    time.sleep(0.5)
                for k, v in trace.items():
                    print(f"    {k:6s}", " ".join(v))
                for h in [c.cache, *alive]:
                    print(f"    {h.id} peers:", (c.status(h) or {}).get("peers"))
            done = c.wait_done(
                "v1", 60 + 3 * n * size * 8 / parse_rate(link), hosts=[c.cache, *alive],
                every=1.0,
            )
            cpu1 = c.cpu_seconds()

            def span(start: Callable[[str], float], end: Callable[[str], float]
                     ) -> tuple[float, float]:
                """(first start, last finish) of the rollout, by host id: from the first
                start in the cluster (the nodes' with a cache lead), as a node that polled
                before the version existed retries its poll later (the worker's backoff),
                which is no part of this."""
                starters = alive if cache_lead != "0s" else [c.cache, *alive]
                first = min(min(start(h.id) for h in starters),
                            p.published + parse_duration(cache_lead))
                return first, max(end(h.id) for h in alive)

            first, last = span(lambda i: float(done[i]["started_at"]),
                               lambda i: float(done[i]["finished_at"]))
            if verbose:
                for h in [c.cache, *alive]:
                    d = done[h.id]
                    print(
                        f"    {h.id}: start {float(d['started_at']) - p.published:6.2f} "
                        f"done {float(d['finished_at']) - p.published:6.2f} "
                        f"slot {float(d['slot_at'] or 0) - p.published:6.2f} "
                        f"{d.get('bytes_by_source')} {d.get('streams_why')}"
                    )
            bound = p.size * 8 / parse_rate(link)
            # What `wagent plan --fleet` says of the same cluster and rollout: each node's
            # finish after publication, against the measured (not with a node killed).
            plan_over = plan_err = plan_last = plan_cache = None
            if killed is None and not training:
                plan = c.plan(p)
                at = {r.node: r for r in plan.nodes}
                errs = [abs((at[h.id].done or float("inf")) - float(done[h.id]["finished_at"]))
                        / (float(done[h.id]["finished_at"]) - p.published) for h in alive]
                plan_err = max(errs)
                plan_first, plan_end = span(lambda i: at[i].start or float("inf"),
                                            lambda i: at[i].done or float("inf"))
                plan_last = abs(plan_end - last) / (last - p.published)
                plan_over = (plan_end - plan_first) / bound
                plan_cache = plan.clusters[0].cache_bytes / p.size
            by: dict[str, int] = {}
            for h in alive:
                for k, v in (c.pull(h).get("bytes_by_source") or {}).items():
                    by[k] = by.get(k, 0) + int(v)
            wrong = 0
            for f in p.manifest["files"]:
                for h in alive:
                    data = (h.store / "models" / MODEL / "v1" / f["path"]).read_bytes()
                    wrong += hashlib.sha256(data).hexdigest() != f["sha256"]
            return {
                "design": design if c.spec.node_poll is None
                else f"{design}, nodes poll {c.spec.node_poll}",
                "n": n,
                "over": (last - first) / bound,
                "cache": c.cache_sent("v1", served0) / p.size,
                "kept": kept,
                "origin": c.origin_bytes("v1") / p.size,
                "first": first_copies,
                "peer_share": by.get("peer", 0) / max(1, sum(by.values())),
                "wrong": wrong,
                "killed": killed.id if killed else "-",
                "bound": bound,
                "plan_over": plan_over,
                "plan_err": plan_err,
                "plan_last": plan_last,
                "plan_cache": plan_cache,
                "cpu_per_wall": (sum(cpu1.values()) - sum(cpu0.values())) / (last - p.published),
                "idle_cpu": idle,
                "cpu_s_per_node_gb": (sum(cpu1.values()) - sum(cpu0.values()))
                / (len(alive) + 1) / (p.size / 1e9),
            }
        finally:
            c.stop()


def run_torrent(
    n: int,
    design: str,
    size: int,
    link: str,
    kill: bool,
    python: str,
    verbose: bool = False,
) -> dict[str, float | str | None]:
    """The ``torrent`` rows: libtorrent on the same cluster (tests/torrent_bed.py), the cache
    pre-seeded; the same keys as run()'s."""
    from agent.units import parse_rate
    from tests import modelgen
    from tests.testbed import Testbed
    from tests.torrent_bed import TorrentCluster, TorrentSpec

    with Testbed() as tb:
        spec = TorrentSpec(nodes=n, link=link, tuned=design == "torrent-tuned",
                           piece_size=0 if design == "torrent-auto" else 1 << 20)
        c = TorrentCluster(tb, spec, python)
        s = c.seed("v1", lambda d: modelgen.generate_sized(d, size, shards=4, seed=n))
        c.start(s)
        t0 = c.go()
        cpu0 = c.cpu_seconds()
        killed = None
        if kill:
            time.sleep(0.5 * size * 8 / parse_rate(link))
            killed = c.nodes[len(c.nodes) // 2]
            last_seen = c.status(killed) or {}
            c.kill(killed)
        alive = [h for h in c.nodes if h is not killed]
        done = c.wait_done(60 + 3 * n * size * 8 / parse_rate(link), alive)
        cpu1 = c.cpu_seconds()
        last = max(float(done[h.id]["finished_at"]) for h in alive)
        wall = last - t0
        docs = {h.id: c.status(h) or {} for h in c.hosts}
        if killed is not None:
            docs[killed.id] = last_seen
        # The killed client's CPU up to its last status (it wrote one every 0.2 s).
        cpu = sum(cpu1[k] - cpu0.get(k, cpu1[k]) for k in cpu1)
        if killed is not None and last_seen.get("cpu_at_go") is not None:
            cpu += float(last_seen["cpu"]) - float(last_seen["cpu_at_go"])
        got = sum(int(docs[h.id].get("downloaded") or 0) for h in c.nodes)
        among = sum(int(docs[h.id].get("uploaded") or 0) for h in c.nodes)
        seeded = int(docs[c.cache.id].get("uploaded") or 0)
        if verbose:
            print(f"    torrent: {s.pieces} pieces of {s.piece_size} B, S {s.size} B")
            for h in c.hosts:
                d = docs[h.id]
                fin = d.get("finished_at")
                first = d.get("first_byte_at")
                print(f"    {h.id}: go {float(d.get('go_at') or t0) - t0:6.3f} first byte "
                      f"{float(first) - t0 if first else float('nan'):6.2f} done "
                      f"{float(fin) - t0 if fin else float('nan'):6.2f} down "
                      f"{d.get('downloaded')} up {d.get('uploaded')} failed "
                      f"{d.get('failed')} redundant {d.get('redundant')} peers {d.get('peers')}")
        bound = s.size * 8 / parse_rate(link)
        return {
            "design": design,
            "n": n,
            "over": wall / bound,
            "cache": seeded / s.size,
            "kept": None,
            "origin": 1.0,             # the cache's one fetch, by construction (pre-seeded)
            "first": None,
            "peer_share": among / max(1, got),
            "wrong": c.wrong_files(s, alive),
            "killed": killed.id if killed else "-",
            "bound": bound,
            "plan_over": None,
            "plan_err": None,
            "plan_last": None,
            "plan_cache": None,
            "cpu_per_wall": cpu / wall,
            "idle_cpu": None,
            "cpu_s_per_node_gb": cpu / (len(alive) + 1) / (s.size / 1e9),
        }


def main(argv: list[str] | None = None) -> int:
    from agent.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="8,16,24")
    ap.add_argument("--size", default="32MiB")
    ap.add_argument("--link", default="40mbit")
    ap.add_argument("--designs", default="tree,peers,torrent")
    ap.add_argument("--kill", action="store_true")
    ap.add_argument(
        "--cache-lead",
        default="0s",
        help="waves.cache_lead (timing then counts from the first node's start)",
    )
    ap.add_argument("--training", action="store_true", help="a training flow (iperf3 on port "
                    "29500) from a node while it uploads, against the same flow alone")
    ap.add_argument("--node-poll", help="the nodes' poll_interval in the peers rows (default: "
                    "the cache's, 1s; the shipped default is 5m: the cache tells its nodes)")
    ap.add_argument("--neighbors", type=int, default=6, help="peers.neighbors")
    ap.add_argument("--streams", type=int, help="fixed streams (default: the shipped, adaptive)")
    ap.add_argument("-v", "--verbose", action="store_true", help="each node's start and finish")
    a = ap.parse_args(argv)
    for design in a.designs.split(","):
        if design.startswith("torrent") and design not in TORRENT_DESIGNS:
            ap.error(f"--designs: {design!r}: the torrent rows are {', '.join(TORRENT_DESIGNS)}")
    rows = []
    torrent_python: str | None = None     # found at the first torrent row; "" if none
    for n in (int(x) for x in a.nodes.split(",")):
        for design in a.designs.split(","):
            if design.startswith("torrent"):
                if torrent_python is None:
                    from tests.torrent_bed import MISSING, client_python

                    torrent_python = client_python() or ""
                    if not torrent_python:
                        print(f"  {design}: skipped: {MISSING}", flush=True)
                if not torrent_python:
                    continue
                r = run_torrent(n, design, parse_size(a.size), a.link, a.kill, torrent_python,
                                a.verbose)
            else:
                r = run(
                    n, design, parse_size(a.size), a.link, a.kill, a.verbose, a.streams,
                    a.cache_lead, a.neighbors,
                    a.training, a.node_poll,
                )
            rows.append(r)
            print(f"  {r}", flush=True)
    print("\n| N | design | last done / (S/B) | plan: last done / off / worst node off | cache "
          "copies (plan) | origin copies | origin, first version | from peers | training kept "
          "| killed | wrong files | daemons' CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def opt(v: object, f: str) -> str:
        return "-" if v is None else format(v, f)

    for r in rows:
        plan = "-" if r["plan_over"] is None else \
            f"{r['plan_over']:.2f} / {r['plan_last']:.0%} / {r['plan_err']:.0%}"
        print(f"| {r['n']} | {r['design']} | {r['over']:.2f} | {plan} | {r['cache']:.2f} "
              f"({opt(r['plan_cache'], '.2f')}) | {r['origin']:.3f} | {opt(r['first'], '.3f')} | "
              f"{r['peer_share']:.0%} | {opt(r['kept'], '.1%')} | {r['killed']} | {r['wrong']} | "
              f"{r['cpu_per_wall']:.2f} cores |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
