"""`wagent plan`: a new version's rollout, simulated before it is published.

Two ways. With ``--fleet FILE`` (a fleet description: clusters, node counts per role, links,
cache nodes, the origin's egress; see policies/topology/fleet-topology.example.yaml) and
``--size``: every node's slot as the daemon computes it, when it learns of the version (its
first poll of ``latest`` after it appeared: a daemon polls at a phase of ``poll_interval``
hashed from its node id, so the plan knows the time exactly, given ``--published``), where it
fetches from (its cluster's cache once the cache holds the version, else the origin), and the
links shared fairly, event by event. Per wave: the first start, the p50/p99/last finish, what
the origin sent and its peak rate; per cluster, the copies its origin and its cache sent. With
the policy's ``peers`` on, a cluster with a cache serves itself (``agent/fleet/swarm.py``):
its nodes learn of the version when the cache starts it and pass the pieces among themselves.
Roles are the policy's: a role it doesn't know (in ``--roles`` or the fleet description) is
refused, not planned after the last wave.

    wagent plan --policy policy.yaml --fleet fleet.yaml --size 120GB
    wagent plan --policy policy.yaml --fleet fleet.yaml --size 120GB --fetch 3GB   # an update

With ``--nodes N`` (no links): N synthetic nodes shared among the roles (``--roles``), each
pulling for ``--pull-time`` (or ``--size`` at the policy's pull rate); per wave when its nodes
start, when the last one finishes and the most that pull at once, and the most pulls at once
over the whole fleet.

    wagent plan --policy policies/fleet.example.yaml --nodes 100000 \\
        --roles cache=0.001,inference=0.3,evaluation=0.1,training=0.6 --pull-time 10m

Backoff (training traffic) is simulated by neither. With ``--bursts SIZE@EVERY``
(``agent/commands/plan_bursts.py``): what the pull does to training bursts of that size and
period, and how much of the gaps between them it uses, at each of ``--rates``: a model of one
bottleneck running wagent's own controller with the policy's timing.

    wagent plan --policy policy.yaml --bursts 24MB@500ms --rates 1gbit,100gbit
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from agent import units
from agent.commands import DEFAULT_POLICY, add_duration_option, plan_bursts
from agent.fleet.report import fleet_document, format_fleet
from agent.fleet.simulate import Rollout, simulate_fleet
from agent.fleet.topology import TopologyError, load_topology
from agent.fleet.waves import (
    WavePlan,
    default_shares,
    parse_shares,
    share_nodes,
    simulate_waves,
    unknown_roles,
)
from agent.policy import PolicyError, load_policy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate a new version's rollout over the fleet",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"default: {DEFAULT_POLICY}")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--fleet", metavar="FILE",
                     help="a fleet description (clusters, links, caches, origin egress): "
                          "simulate the links too; needs --size")
    how.add_argument("--nodes", type=int, help="how many nodes to simulate (schedule only)")
    how.add_argument("--bursts", metavar="SIZE@EVERY",
                     help="training bursts (e.g. 24MB@500ms): what the pull does to them, and "
                          "to the gaps between them, at --rates (a model of one bottleneck)")
    p.add_argument("--roles", help="with --nodes: ROLE=SHARE,... (default: inference=0.3,"
                                   "evaluation=0.1,training=0.6 over the policy's waves; "
                                   "cache=... adds caches)")
    p.add_argument("--published", help="ISO time of publication, UTC unless it says (default: now)")
    add_duration_option(p, "--pull-time", default="10m",
                        help="with --nodes: how long one pull takes, e.g. 10m or 600 (seconds) "
                             "(default 10m)")
    p.add_argument("--size", help="the version's size, e.g. 120GB. With --fleet: what one copy "
                                  "is. With --nodes: pull time = size / the policy's pull rate "
                                  "(pulls.rate, else shaping.ceil if shaping is enabled, else "
                                  "shaping.link_rate); overrides --pull-time")
    p.add_argument("--fetch", help="with --fleet: what each node fetches, when the nodes hold "
                                   "the previous version (an update: its changed tensors); "
                                   "default: --size")
    p.add_argument("--cold", action="store_true",
                   help="with --fleet: the caches have announced no version of this model yet "
                        "(its first), so nodes learn of it from the origin")
    p.add_argument("--model", help="model name for the hash (default: the policy's first)")
    p.add_argument("--version", default="v1", help="version name for the hash (default v1)")
    p.add_argument("--per-node", action="store_true",
                   help="with --fleet: every node's slot, start, finish and source too")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    plan_bursts.add_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
        topology = load_topology(args.fleet) if args.fleet else None
    except (PolicyError, TopologyError) as e:
        print(e, file=sys.stderr)
        return 1
    if args.bursts:
        return plan_bursts.run(args, policy)
    model = args.model or (policy.models[0].name if policy.models else "model")
    try:
        published = _parse_time(args.published) if args.published else datetime.now(UTC)
        if topology is not None:
            if not args.size:
                raise ValueError("--fleet needs --size (the version's size, e.g. 120GB)")
            size = units.parse_size(args.size)
            fetch = units.parse_size(args.fetch) if args.fetch else None
            if fetch is not None and fetch > size:
                raise ValueError(f"--fetch {args.fetch} is more than --size {args.size}")
            if args.roles:
                raise ValueError("--roles goes with --nodes (with --fleet, the fleet "
                                 "description counts the nodes of each role)")
            wrong = unknown_roles(policy, sorted({g.role for c in topology.clusters
                                                  for g in c.nodes}))
            if wrong:
                print("\n".join(f"{topology.path}: nodes: {w} (policy {args.policy})"
                                for w in wrong), file=sys.stderr)
                return 1
            rollout = Rollout(size, fetch, published.timestamp(), model, args.version,
                              args.cold)
            fleet = simulate_fleet(topology, policy, rollout)
        else:
            if args.fetch or args.cold or args.per_node:
                raise ValueError("--fetch, --cold and --per-node go with --fleet")
            if args.nodes < 1:
                raise ValueError("--nodes must be at least 1")
            shares = parse_shares(args.roles) if args.roles else default_shares(policy)
            wrong = unknown_roles(policy, shares)
            if wrong:
                raise ValueError("--roles: " + "; ".join(wrong))
            if args.size:
                sh = policy.shaping
                rate = policy.pulls.rate or (sh.ceil if sh.enabled else sh.link_rate)
                pull_time = units.parse_size(args.size) * 8 / rate
            else:
                pull_time = args.pull_time
            plan = simulate_waves(policy, share_nodes(args.nodes, shares),
                                  published.timestamp(), pull_time, model, args.version)
    except ValueError as e:                       # UnitError is a ValueError
        print(f"wagent plan: {e}", file=sys.stderr)
        return 2
    if topology is not None:
        if args.json:
            json.dump(fleet_document(fleet, args.per_node), sys.stdout, indent=2)
            print()
        else:
            print(format_fleet(fleet, args.per_node))
        return 0
    if args.json:
        json.dump(plan_document(plan), sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan))
    return 0


def plan_document(plan: WavePlan) -> dict[str, Any]:
    """Stable JSON (``plan_version`` 1): times in POSIX seconds, ``waves`` in start order."""
    return {"plan_version": 1, **asdict(plan)}


def format_plan(plan: WavePlan) -> str:
    def rel(t: float | None) -> str:
        return "-" if t is None else "+" + units.format_duration(t - plan.published)

    published = datetime.fromtimestamp(plan.published, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"published {published}; each pull takes {units.format_duration(plan.pull_time)}; "
             f"times after publication",
             f"{'wave':>5}  {'role':<12} {'nodes':>8} {'first start':>12} {'last start':>12} "
             f"{'last done':>12} {'peak pulls':>10}"]
    for w in plan.waves:
        wave = "cache" if w.wave is None else str(w.wave)
        never = f"  ({w.never} never: windows never open)" if w.never else ""
        lines.append(f"{wave:>5}  {w.role:<12} {w.nodes:>8} {rel(w.first_start):>12} "
                     f"{rel(w.last_start):>12} {rel(w.last_end):>12} {w.peak:>10}{never}")
    lines.append(f"origin peak: {plan.peak} concurrent pulls at {rel(plan.peak_at)}")
    return "\n".join(lines)


def _parse_time(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--published {text!r} is not an ISO time, e.g. "
                         f"2026-12-02T14:00:00Z") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
