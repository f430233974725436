"""A FleetPlan for people (a table) and for scripts (JSON, ``plan_version`` 1). Pure."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from agent import units
from agent.fleet.simulate import FleetPlan

MAX_CLUSTER_ROWS = 20          # beyond this, the clusters are summed up in one line


def fleet_document(plan: FleetPlan, per_node: bool = False) -> dict[str, Any]:
    """Times in POSIX seconds, rates in bits/s, sizes in bytes; ``nodes`` only if asked."""
    doc: dict[str, Any] = {
        "plan_version": 1, "kind": "fleet", "published": plan.published, "size": plan.size,
        "fetch": plan.fetch, "cold": plan.cold,
        "origin": {"bytes": plan.origin_bytes, "copies": plan.copies,
                   "peak_bps": plan.origin_peak_bps, "peak_at": plan.origin_peak_at},
        "last_done": plan.last_done,
        "waves": [asdict(w) for w in plan.waves],
        "clusters": [{**asdict(c), "copies": c.origin_bytes / plan.fetch if plan.fetch else 0.0,
                      "cache_copies": c.cache_bytes / plan.fetch if plan.fetch else 0.0}
                     for c in plan.clusters],
    }
    if per_node:
        doc["nodes"] = [asdict(n) for n in plan.nodes]
    return doc


def format_fleet(plan: FleetPlan, per_node: bool = False) -> str:
    def rel(t: float | None) -> str:
        return "-" if t is None else "+" + units.format_duration(t - plan.published)

    published = datetime.fromtimestamp(plan.published, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    what = ("the whole version" if plan.fetch == plan.size
            else f"of a {units.format_size(plan.size)} version")
    cold = "; caches cold (their first version of this model)" if plan.cold else ""
    lines = [f"published {published}; {units.format_size(plan.fetch)} per node ({what}), "
             f"{len(plan.nodes)} nodes in {len(plan.clusters)} "
             f"cluster{'' if len(plan.clusters) == 1 else 's'}{cold}; "
             f"times after publication",
             f"{'wave':>5}  {'role':<12} {'nodes':>7} {'start':>8} {'p50 done':>9} "
             f"{'p99 done':>9} {'last done':>9} {'from cache':>10} {'origin sent':>11} "
             f"{'origin peak':>12}"]
    for w in plan.waves:
        wave = "cache" if w.wave is None else str(w.wave)
        never = f"  ({w.never} never: windows never open)" if w.never else ""
        lines.append(f"{wave:>5}  {w.role:<12} {w.nodes:>7} {rel(w.first_start):>8} "
                     f"{rel(w.p50_done):>9} {rel(w.p99_done):>9} {rel(w.last_done):>9} "
                     f"{w.from_cache:>10} {units.format_size(w.origin_bytes):>11} "
                     f"{units.format_rate(w.origin_peak_bps):>12}{never}")
    copy = "the version" if plan.fetch == plan.size else "what each node fetches"
    lines.append(f"origin: sent {units.format_size(plan.origin_bytes)} = {plan.copies:.2f} "
                 f"copies of {copy}; peak {units.format_rate(plan.origin_peak_bps)} at "
                 f"{rel(plan.origin_peak_at)}; every node done at {rel(plan.last_done)}")
    size = plan.fetch or 1
    if len(plan.clusters) <= MAX_CLUSTER_ROWS:
        lines.append(f"{'cluster':<16} {'nodes':>7} {'origin copies':>13} {'cache copies':>12} "
                     f"{'last done':>9}")
        for c in plan.clusters:
            peers = "  (nodes serve each other)" if c.peers else ""
            lines.append(f"{c.name:<16} {c.nodes:>7} {c.origin_bytes / size:>13.2f} "
                         f"{c.cache_bytes / size:>12.2f} {rel(c.last_done):>9}{peers}")
    else:
        copies = sorted(c.origin_bytes / size for c in plan.clusters)
        lines.append(f"{len(plan.clusters)} clusters: origin copies per cluster "
                     f"{copies[0]:.2f} to {copies[-1]:.2f}")
    if per_node:
        lines.append(f"{'node':<28} {'role':<12} {'slot':>8} {'learned':>8} {'start':>8} "
                     f"{'done':>8}  source")
        for n in plan.nodes:
            lines.append(f"{n.node:<28} {n.role:<12} {rel(n.slot):>8} {rel(n.learned):>8} "
                         f"{rel(n.start):>8} {rel(n.done):>8}  {n.source or '-'}")
    return "\n".join(lines)
