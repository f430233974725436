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
to its finish over its link-bound time (target <= 1.3), and every node's finish after
publication, predicted by `wagent plan` (the same fleet described in YAML, the same policy, the
same node ids) against measured (target: within 20%; a finish further off fails the bench), with
the start each side saw. A daemon polls `latest` at a phase of its poll interval hashed from its
node id (agent.schedule.next_poll), so the plan knows when each node learns of a version; that
matters where a finish is short next to the poll interval: the caches' on the small update,
about a second against an interval of 1 s. Then the CPU each idle daemon uses. With
``--runs N`` the whole thing runs N times, each on a fresh fleet, and ends with every node's
predicted and measured finishes side by side.

    python tests/bench/fleet.py [--runs 3] [--size 64MiB] [--gap 8s] [--cache-lead 10s]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.fleet_bed import FleetSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COPIES = 1.02
LINK_BOUND = 1.3
ACCURACY = 0.20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="fresh fleets, one after the other")
    ap.add_argument("--size", default="64MiB", help="size of v0 and v1")
    ap.add_argument("--gap", default="8s")
    ap.add_argument("--spread", default="2s")
    ap.add_argument("--cache-lead", default="10s")
    args = ap.parse_args(argv)

    from agent.units import parse_duration
    from tests.fleet_bed import FleetSpec

    spec = FleetSpec(gap=args.gap, spread=args.spread, cache_lead=args.cache_lead)
    poll = parse_duration(spec.poll)
    failures: list[str] = []
    # (run, version) -> node -> (planned finish, measured finish)
    results: dict[tuple[int, str], dict[str, tuple[float, float]]] = {}
    for run in range(1, args.runs + 1):
        if args.runs > 1:
            print(f"\n######## run {run} of {args.runs}")
        one_run(run, spec, args.size, failures, results)
    if args.runs > 1:
        summary(args.runs, results)
    rows = [(n, pm) for per in results.values() for n, pm in per.items()]
    worst_nodes = max(abs(p - m) / m for n, (p, m) in rows if "-cache-" not in n)
    worst_caches = max(abs(p - m) / m for n, (p, m) in rows if "-cache-" in n)
    worst_off = max(abs(p - m) for n, (p, m) in rows if "-cache-" in n)
    print(f"\nplan accuracy over {args.runs} run{'s' if args.runs > 1 else ''}: nodes within "
          f"{worst_nodes:.1%} of the measured finish (target {ACCURACY:.0%}); cache nodes "
          f"within {worst_caches:.1%}, at most {worst_off:.2f} s off (they poll every "
          f"{poll:g} s, at a phase the plan knows)")
    if failures:
        print("FAILED:", "; ".join(failures))
        return 1
    print("ok")
    return 0


def one_run(run: int, spec: FleetSpec, size_text: str, failures: list[str],
            results: dict[tuple[int, str], dict[str, tuple[float, float]]]) -> None:
    from agent.units import parse_size
    from tests import modelgen
    from tests.fleet_bed import MODEL, EmulatedFleet, link_bound, timings
    from tests.testbed import Testbed

    size = parse_size(size_text)
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
                        failures.append(f"run {run} {version} cluster {c}: {copies:.3f} copies")
                    print(f"cluster {c}: origin sent {copies:.3f} copies (plan "
                          f"{predicted / p.fetch:.3f})  {verdict}")
                print(f"{'node':<16} {'start->done':>11} {'link-bound':>10} {'x bound':>8}  "
                      f"{'start plan':>10} {'measured':>8}  {'done plan':>9} {'measured':>9} "
                      f"{'error':>7}")
                bound = {n: (took, ratio) for n, took, ratio in link_bound(fleet, p, done)}
                per = results.setdefault((run, version), {})
                for t in timings(fleet, p, done, cold):
                    took, ratio = bound[t.node]
                    per[t.node] = (t.planned, t.measured)
                    flags = []
                    if ratio > LINK_BOUND:
                        flags.append(f"> {LINK_BOUND}x bound")
                        failures.append(f"run {run} {version} {t.node}: {ratio:.2f}x its "
                                        "link-bound time")
                    if t.error > ACCURACY:
                        flags.append(f"plan off by {abs(t.planned - t.measured):.2f} s, "
                                     f"started {t.start - t.planned_start:+.2f} s from the "
                                     "plan's start")
                        failures.append(f"run {run} {version} {t.node}: plan off by "
                                        f"{t.error:.0%}")
                    print(f"{t.node:<16} {took:>10.2f}s {took / ratio:>9.2f}s {ratio:>8.2f}  "
                          f"{t.planned_start:>9.2f}s {t.start:>7.2f}s  {t.planned:>8.2f}s "
                          f"{t.measured:>8.2f}s {t.error:>6.1%}  {'; '.join(flags) or 'ok'}")
            time.sleep(2)
            before, t0 = fleet.cpu_seconds(), time.monotonic()
            time.sleep(10)
            after, span = fleet.cpu_seconds(), time.monotonic() - t0
            idle = sorted((after[k] - before[k]) / span for k in before)
            print(f"\nCPU per idle daemon over {span:.0f} s: median {idle[len(idle) // 2]:.1%} "
                  f"of a core, max {idle[-1]:.1%}")
        finally:
            fleet.stop()


def summary(runs: int, results: dict[tuple[int, str], dict[str, tuple[float, float]]]) -> None:
    """Every node's finish after publication: planned (the same in every run: the plan depends
    on the node ids, the version and the policy) and measured, run by run."""
    print(f"\n######## finish after publication, seconds: plan, then measured (error) in each "
          f"of {runs} runs")
    versions = sorted({v for _, v in results})
    for v in versions:
        print(f"\n== {v}")
        nodes = list(results[(1, v)])
        print(f"{'node':<16} {'plan':>7}  " + "  ".join(f"{'run ' + str(r):>16}"
                                                       for r in range(1, runs + 1)))
        for n in nodes:
            planned = results[(1, v)][n][0]
            cells = []
            for r in range(1, runs + 1):
                p, m = results[(r, v)][n]
                cells.append(f"{m:>7.2f} ({abs(p - m) / m:>5.1%})")
            print(f"{n:<16} {planned:>7.2f}  " + "  ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
