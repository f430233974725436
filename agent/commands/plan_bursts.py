"""`wagent plan --bursts SIZE@EVERY`: what the pull does to training bursts at link rates this
node may not have, from the model of one bottleneck (``agent.yielding.burst_model``).

For each link rate: the bursts' slowdown beside the pull (the first, and the p50 and p99 of the
rest, each over the burst alone) and the share of the idle capacity between bursts the pull
used. The controller is wagent's own, with the policy's timing and windows (``backoff.tick``,
``quiet``, ``decrease``, ``queue_budget``, ``smallest_burst``, ``burst_hold``: the fast path as
shipped, or the ticks alone when it is null) and the shipped shares of each link (floor,
threshold, increase); a row says whether the guarantee holds there (first <= 1.5x,
p99 <= 1.05x) and whether the pull uses the gaps (at least half the idle capacity).

    wagent plan --policy policy.yaml --bursts 24MB@500ms
    wagent plan --bursts 6MB@120ms --rates 1gbit,100gbit --rtt 0.02ms --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from agent import units
from agent.policy.model import Backoff, Policy
from agent.yielding.burst_model import Bursts, Link, Outcome, simulate

DEFAULT_RATES = "1gbit,10gbit,100gbit,400gbit"
FIRST_MOST, P99_MOST = 1.5, 1.05           # the guarantee (issue 23's targets)
GAPS_LEAST = 0.5                           # the idle capacity the pull should use


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default=DEFAULT_RATES,
                   help=f"with --bursts: link rates to model (default {DEFAULT_RATES})")
    p.add_argument("--rtt", default="0.05ms",
                   help="with --bursts: the base round trip of the pull's path (default 0.05ms)")
    p.add_argument("--count", type=int, default=20,
                   help="with --bursts: bursts per run (default 20)")


def parse_bursts(text: str, count: int) -> Bursts:
    size, at, every = text.partition("@")
    if not at:
        raise ValueError(f"--bursts {text!r}: expected SIZE@EVERY, e.g. 24MB@500ms")
    b = Bursts(units.parse_size(size), units.parse_duration(every), count)
    if b.size <= 0 or b.every <= 0 or b.count < 2:
        raise ValueError(f"--bursts {text!r}: size and period must be positive (and --count "
                         "at least 2)")
    return b


def backoff_for(policy: Policy) -> Backoff:
    """The policy's timing with the shipped shares of the link (a policy's rates are resolved
    for its own link only)."""
    b = policy.backoff
    return replace(Backoff(), enabled=b.enabled, tick=b.tick, quiet=b.quiet,
                   decrease=b.decrease, queue_budget=b.queue_budget,
                   smallest_burst=b.smallest_burst, burst_hold=b.burst_hold)


def model(policy: Policy, bursts: Bursts, rates: list[int], rtt: float
          ) -> list[tuple[int, Outcome]]:
    backoff = backoff_for(policy)
    return [(r, simulate(Link(r, rtt), bursts, backoff)) for r in rates]


def guarantee(o: Outcome) -> str:
    """Whether bursts are safe beside the pull there (the first <= 1.5x, p99 <= 1.05x)."""
    if o.first <= FIRST_MOST and o.p99 <= P99_MOST:
        return "holds"
    return "slowed: needs a faster yield or switch QoS (DSCP LE)"


def gaps(o: Outcome) -> str:
    return "used" if o.idle_used >= GAPS_LEAST else "unused"


def document(bursts: Bursts, rtt: float, rows: list[tuple[int, Outcome]]) -> dict[str, Any]:
    return {"bursts": {"size": bursts.size, "every_s": bursts.every, "count": bursts.count},
            "rtt_s": rtt,
            "rates": [{"rate_bps": r, "first": o.first, "p50": o.p50, "p99": o.p99,
                       "idle_used": o.idle_used, "pull_bps": o.pull_bps, "guarantee": guarantee(o),
                       "gaps": gaps(o)}
                      for r, o in rows]}


def format_rows(bursts: Bursts, rtt: float, rows: list[tuple[int, Outcome]]) -> str:
    lines = [f"bursts of {units.format_size(bursts.size)} every {bursts.every * 1e3:g} ms, "
             f"base RTT {rtt * 1e6:g} us; slowdown vs the burst alone (model: "
             f"agent/yielding/burst_model.py)",
             f"{'link':>10} {'first':>7} {'p50':>7} {'p99':>7} {'idle used':>10} {'gaps':>7}"
             f"  guarantee"]
    for r, o in rows:
        lines.append(f"{units.format_rate(r):>10} {o.first:>6.3f}x {o.p50:>6.3f}x "
                     f"{o.p99:>6.3f}x {100 * o.idle_used:>9.1f}% {gaps(o):>7}  {guarantee(o)}")
    return "\n".join(lines)


def run(args: argparse.Namespace, policy: Policy) -> int:
    try:
        bursts = parse_bursts(args.bursts, args.count)
        rates = [units.parse_rate(r) for r in args.rates.split(",") if r.strip()]
        rtt = units.parse_duration(args.rtt)
        if not rates or min(rates) <= 0 or rtt < 0:
            raise ValueError("--rates must name positive rates and --rtt be at least 0")
    except ValueError as e:                       # UnitError is a ValueError
        print(f"wagent plan: {e}", file=sys.stderr)
        return 2
    rows = model(policy, bursts, rates, rtt)
    if args.json:
        json.dump(document(bursts, rtt, rows), sys.stdout, indent=2)
        print()
    else:
        print(format_rows(bursts, rtt, rows))
    return 0
