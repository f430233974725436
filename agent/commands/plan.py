"""`wagent plan`: the fleet's schedule for one new version, simulated before it is published.

N synthetic nodes (``node-000000``...) are shared among the roles (``--roles``), each gets its slot
from ``agent.schedule`` exactly as the daemon would compute it, is moved into its role's windows,
and pulls for ``--pull-time`` (or ``--size`` at the policy's pull rate). A pull that reaches the
end of its window pauses and resumes at the next opening (plus its share of the spread, as the
daemon does). The table shows, for each wave, when its nodes start, when the last one finishes
and the most that pull at once, and then the origin's peak: the most pulls at once over the
whole fleet, as if every node pulled from the origin. Backoff is not simulated.

    wagent plan --policy policies/fleet.example.yaml --nodes 100000 \\
        --roles cache=0.001,inference=0.3,evaluation=0.1,training=0.6 --pull-time 10m
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from agent import units
from agent.policy import PolicyError, load_policy
from agent.policy_model import Policy
from agent.schedule import Spans, offset_fraction, slot_from_fraction, wave_index, windows_for

DEFAULT_POLICY = "/etc/wagent/policy.yaml"
CONVENTIONAL_SHARES = {"inference": 0.3, "evaluation": 0.1, "training": 0.6}


@dataclass(frozen=True)
class WaveStats:
    role: str
    wave: int | None              # None: the cache role
    nodes: int
    first_start: float | None     # POSIX seconds; None if the role's windows never open
    last_start: float | None
    last_end: float | None
    peak: int                     # most of this wave's nodes pulling at once
    never: int                    # nodes whose windows never open


@dataclass(frozen=True)
class Plan:
    published: float
    pull_time: float
    waves: tuple[WaveStats, ...]
    peak: int                     # the origin's most concurrent pulls, all waves together
    peak_at: float | None


def simulate(policy: Policy, counts: dict[str, int], published: float, pull_time: float,
             model: str, version: str) -> Plan:
    """Every node's pull intervals from the schedule, then a sweep line per wave and overall."""
    horizon = (published + policy.waves.cache_lead + policy.waves.spread
               + (len(policy.waves.order) + 1) * policy.waves.gap + 40 * 86400 + pull_time * 4)
    all_starts: list[float] = []
    all_ends: list[float] = []
    stats = []
    serial = 0
    roles = sorted(counts, key=lambda r: (-1 if wave_index(policy, r) is None
                                          else wave_index(policy, r), r))
    for role in roles:
        windows = windows_for(policy, role)
        spans = Spans.build(windows, published, horizon) if windows else None
        seg_starts: list[float] = []
        seg_ends: list[float] = []
        firsts: list[float] = []
        never = 0
        for _ in range(counts[role]):
            node = f"node-{serial:06d}"
            serial += 1
            frac = offset_fraction(node, role, model, version)
            due = slot_from_fraction(published, frac, role, policy)
            segments = _segments(spans, due, frac, policy.waves.spread, pull_time)
            if not segments:
                never += 1
                continue
            firsts.append(segments[0][0])
            for s, e in segments:
                seg_starts.append(s)
                seg_ends.append(e)
        seg_starts.sort()
        seg_ends.sort()
        peak, _ = _peak(seg_starts, seg_ends)
        stats.append(WaveStats(role, wave_index(policy, role), counts[role],
                               min(firsts, default=None), max(firsts, default=None),
                               max(seg_ends, default=None), peak, never))
        all_starts += seg_starts
        all_ends += seg_ends
    all_starts.sort()
    all_ends.sort()
    peak, at = _peak(all_starts, all_ends)
    return Plan(published, pull_time, tuple(stats), peak, at)


def _segments(spans: Spans | None, due: float, frac: float, spread: float,
              pull_time: float) -> list[tuple[float, float]]:
    if spans is None:
        return [(due, due + pull_time)]
    span = spans.next_open(due)
    if span is None:
        return []
    start = due if span[0] <= due else span[0] + frac * min(spread, span[1] - span[0])
    out, left = [], pull_time
    while span is not None:
        end = min(span[1], start + left)
        out.append((start, end))
        if end == start + left:
            break
        left -= end - start
        span = spans.next_open(span[1])
        if span is not None:              # a paused pull resumes as pull_allowed_at says
            start = span[0] + frac * min(spread, span[1] - span[0])
    return out


def _peak(starts: list[float], ends: list[float]) -> tuple[int, float | None]:
    """Most intervals open at once; an interval ending at t doesn't overlap one starting at t."""
    best, at = 0, None
    for i, s in enumerate(starts):
        running = i + 1 - bisect.bisect_right(ends, s)
        if running > best:
            best, at = running, s
    return best, at


def share_nodes(total: int, shares: dict[str, float]) -> dict[str, int]:
    """Split ``total`` nodes by weight, largest remainder first, so the counts add up exactly."""
    weight = sum(shares.values())
    raw = {r: total * w / weight for r, w in shares.items()}
    counts = {r: int(v) for r, v in raw.items()}
    by_remainder = sorted(raw, key=lambda r: raw[r] - counts[r], reverse=True)
    for r in by_remainder[: total - sum(counts.values())]:
        counts[r] += 1
    return counts


def parse_shares(text: str) -> dict[str, float]:
    """``inference=0.3,training=0.6`` -> {"inference": 0.3, "training": 0.6}."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or not name.strip() or share < 0:
            raise ValueError(f"--roles item {item!r} should be ROLE=SHARE, e.g. inference=0.3")
        out[name.strip()] = share
    if sum(out.values()) <= 0:
        raise ValueError("--roles: the shares add up to zero")
    return out


def default_shares(policy: Policy) -> dict[str, float]:
    """The conventional 30/10/60 split over the waves the policy has; other roles an equal share."""
    return {r: CONVENTIONAL_SHARES.get(r, 0.1) for r in policy.waves.order}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate the fleet's schedule for a new version",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"default: {DEFAULT_POLICY}")
    p.add_argument("--nodes", type=int, required=True, help="how many nodes to simulate")
    p.add_argument("--roles", help="ROLE=SHARE,... (default: inference=0.3,evaluation=0.1,"
                                   "training=0.6 over the policy's waves; cache=... adds caches)")
    p.add_argument("--published", help="ISO time of publication, UTC unless it says (default: now)")
    p.add_argument("--pull-time", default="10m", help="how long one pull takes (default 10m)")
    p.add_argument("--size", help="model size, e.g. 16GB: pull time = size / the policy's pull "
                                  "rate (pulls.rate, else shaping.ceil if shaping is enabled, "
                                  "else shaping.link_rate); overrides --pull-time")
    p.add_argument("--model", help="model name for the hash (default: the policy's first)")
    p.add_argument("--version", default="v1", help="version name for the hash (default v1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as e:
        print(e, file=sys.stderr)
        return 1
    try:
        if args.nodes < 1:
            raise ValueError("--nodes must be at least 1")
        shares = parse_shares(args.roles) if args.roles else default_shares(policy)
        published = _parse_time(args.published) if args.published else datetime.now(UTC)
        if args.size:
            sh = policy.shaping
            rate = policy.pulls.rate or (sh.ceil if sh.enabled else sh.link_rate)
            pull_time = units.parse_size(args.size) * 8 / rate
        else:
            pull_time = units.parse_duration(args.pull_time)
    except ValueError as e:                       # UnitError is a ValueError
        print(f"wagent plan: {e}", file=sys.stderr)
        return 2
    model = args.model or (policy.models[0].name if policy.models else "model")
    plan = simulate(policy, share_nodes(args.nodes, shares), published.timestamp(), pull_time,
                    model, args.version)
    if args.json:
        json.dump(plan_document(plan), sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan))
    return 0


def plan_document(plan: Plan) -> dict[str, Any]:
    """Stable JSON (``plan_version`` 1): times in POSIX seconds, ``waves`` in start order."""
    return {"plan_version": 1, **asdict(plan)}


def format_plan(plan: Plan) -> str:
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
