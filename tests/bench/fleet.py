"""Benchmark: an emulated fleet (tests/fleet_bed.py) against what `wagent plan` predicts for it.

An origin whose egress (160 Mbit/s) is the bottleneck, two clusters of a cache node and three
nodes (inference, evaluation, training) behind the cluster's link, 80 Mbit/s per node, every host
a real `wagent run` with one policy. Three rollouts:

* v0, the model's first version (64 MiB): the caches have announced nothing yet, so the nodes
  learn of it from the origin (`wagent plan --cold`);
* v1, a new version (64 MiB): the nodes learn of it from their cache's `latest`;
* v2, two of eight layers changed: every node fetches only those.

For each: the origin's bytes per cluster from nginx's log (target <= 1.02 copies of what a node
fetches), each node's time from its start (its slot, or when it learned of the version if later)
to its finish over its link-bound time (target <= 1.3),
and every node's finish after publication, predicted by `wagent plan` (the same fleet described
in YAML, the same policy, the same node ids) against measured (target: the nodes within 20%).
The cache nodes' errors are printed, not held to the target: when in its poll interval a cache
asks the origin for `latest` is the one thing the plan can't know, and two caches sharing the
origin split it as their TCP flows happen to over a few seconds, not max-min fairly as the plan
does (the pair's last finish is right, the split between them is not). Then the CPU each idle
daemon uses.

    python tests/bench/fleet.py [--size 64MiB] [--gap 8s] [--cache-lead 10s]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COPIES = 1.02
LINK_BOUND = 1.3
ACCURACY = 0.20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64MiB", help="size of v0 and v1")
    ap.add_argument("--gap", default="8s")
    ap.add_argument("--spread", default="2s")
    ap.add_argument("--cache-lead", default="10s")
    args = ap.parse_args(argv)

    from agent.units import parse_duration, parse_size
    from tests import modelgen
    from tests.fleet_bed import MODEL, EmulatedFleet, FleetSpec, accuracy, link_bound
    from tests.testbed import Testbed

    size = parse_size(args.size)
    poll = parse_duration(FleetSpec().poll)
    spec = FleetSpec(gap=args.gap, spread=args.spread, cache_lead=args.cache_lead)
    failures: list[str] = []
    rows: list[tuple[str, str, float, float, float]] = []
    with Testbed() as tb:
        fleet = EmulatedFleet(tb, spec)
        try:
            fleet.start()
            print(f"fleet: origin {spec.origin_egress}, cluster links {spec.cluster_link}, "
                  f"node links {spec.node_link}, caches serve {spec.cache_egress}; waves "
                  f"{spec.gap} apart, spread {spec.spread}, cache lead {spec.cache_lead}, "
                  f"polls every {spec.poll}")
            v_dir = fleet.origin_root / MODEL / "v1"
            staging = tb.tmpdir("staging") / "v2"
            rollouts = [
                ("v0", "first version, caches cold", lambda d: modelgen.generate_sized(
                    d, size, shards=4, seed=10, layers=8), None, True),
                ("v1", "new version", lambda d: modelgen.generate_sized(
                    d, size, shards=4, seed=11, layers=8), None, False),
                ("v2", "two layers changed", staging.rename, "delta", False),
            ]
            for version, what, build, fetch, cold in rollouts:
                if fetch == "delta":
                    fetch = modelgen.next_version(v_dir, staging, change_layers=[2, 5]
                                                  ).delta_bytes
                p = fleet.publish(version, build, fetch=fetch)
                done = fleet.wait_done(version, 300)
                plan = fleet.plan(p, cold)
                print(f"\n== {version}: {what}; {p.fetch / 2**20:.1f} MiB per node")
                for c in spec.clusters:
                    sent = fleet.origin_bytes(version, {h.ip for h in fleet.in_cluster(c)})
                    predicted = next(x for x in plan.clusters if x.name == c).origin_bytes
                    copies = sent / p.fetch
                    verdict = "ok" if copies <= COPIES else f"FAILED (> {COPIES})"
                    if copies > COPIES:
                        failures.append(f"{version} cluster {c}: {copies:.3f} copies")
                    print(f"cluster {c}: origin sent {copies:.3f} copies (plan "
                          f"{predicted / p.fetch:.3f})  {verdict}")
                print(f"{'node':<16} {'start->done':>11} {'link-bound':>10} {'x bound':>8}  "
                      f"{'predicted':>9} {'measured':>9} {'error':>7}")
                bound = {n: (took, ratio) for n, took, ratio in link_bound(fleet, p, done)}
                for node, predicted, measured, err in accuracy(fleet, p, done, cold):
                    took, ratio = bound[node]
                    rows.append((version, node, predicted, measured, err))
                    flags = []
                    if ratio > LINK_BOUND:
                        flags.append(f"> {LINK_BOUND}x bound")
                        failures.append(f"{version} {node}: {ratio:.2f}x its link-bound time")
                    off = abs(predicted - measured)
                    if err > ACCURACY and "-cache-" in node:
                        flags.append(f"off by {off:.2f} s (a cache: not held to the target)")
                    elif err > ACCURACY:
                        flags.append(f"plan off by {off:.2f} s")
                        failures.append(f"{version} {node}: plan off by {err:.0%}")
                    print(f"{node:<16} {took:>10.2f}s {took / ratio:>9.2f}s {ratio:>8.2f}  "
                          f"{predicted:>8.2f}s {measured:>8.2f}s {err:>6.1%}  "
                          f"{'; '.join(flags) or 'ok'}")
            time.sleep(2)
            before, t = fleet.cpu_seconds(), time.monotonic()
            time.sleep(10)
            after, span = fleet.cpu_seconds(), time.monotonic() - t
            idle = sorted((after[k] - before[k]) / span for k in before)
            print(f"\nCPU per idle daemon over {span:.0f} s: median {idle[len(idle) // 2]:.1%} "
                  f"of a core, max {idle[-1]:.1%}")
        finally:
            fleet.stop()
    worst_nodes = max(e for _, n, *_, e in rows if "-cache-" not in n)
    worst_caches = max(e for _, n, *_, e in rows if "-cache-" in n)
    worst_off = max(abs(pr - me) for _, n, pr, me, _ in rows if "-cache-" in n)
    print(f"\nplan accuracy: nodes within {worst_nodes:.1%} of the measured finish (target "
          f"{ACCURACY:.0%}); cache nodes within {worst_caches:.1%}, at most {worst_off:.2f} s "
          f"off (polls every {poll:g} s)")
    if failures:
        print("FAILED:", "; ".join(failures))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
