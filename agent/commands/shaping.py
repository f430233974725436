"""`wagent shaping apply|show|clear`: the kernel side of shaping, by hand.

Exit codes: 0 done, 1 a failure reported on stderr (policy, permissions, kernel), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from agent.commands import DEFAULT_POLICY
from agent.policy import PolicyError, load_policy
from agent.policy.model import Shaping
from agent.units import format_rate, format_size
from shaping.errors import ShapingError
from shaping.shaper import Shaper

DEFAULT_STATE_DIR = "/var/lib/wagent"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shaping", help="apply, show or clear wagent's tc trees by hand",
                       description="The HTB trees that cap distribution traffic (egress on serving "
                       "nodes, ingress through an IFB on pulling nodes).")
    verbs = p.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    a = verbs.add_parser("apply", help="make the kernel match the policy's shaping section")
    a.add_argument("--policy", default=DEFAULT_POLICY, help=f"default {DEFAULT_POLICY}")
    a.add_argument("--dry-run", action="store_true",
                   help="print the equivalent tc commands instead of changing anything")
    a.add_argument("--state-dir", help="where the original qdiscs are recorded "
                   "(default: the policy's state_dir)")
    a.set_defaults(func=_apply)
    s = verbs.add_parser("show", help="wagent's trees as the kernel has them, with counters")
    s.add_argument("--policy", help="also show the interfaces this policy names")
    s.add_argument("--json", action="store_true", help="versioned JSON instead of text")
    s.add_argument("--state-dir", help=f"default: the policy's state_dir or {DEFAULT_STATE_DIR}")
    s.set_defaults(func=_show)
    c = verbs.add_parser("clear", help="remove wagent's trees and IFBs; restore the original "
                         "root qdiscs")
    c.add_argument("--policy", help="also clear the interfaces this policy names")
    c.add_argument("--state-dir", help=f"default: the policy's state_dir or {DEFAULT_STATE_DIR}")
    c.set_defaults(func=_clear)


def _shaper(args: argparse.Namespace, need_policy: bool) -> Shaper:
    shaping, sources, state_dir = Shaping(), (), DEFAULT_STATE_DIR
    if args.policy or need_policy:

        policy = load_policy(args.policy)
        shaping, sources, state_dir = policy.shaping, policy.shaped_sources, policy.state_dir
        if not need_policy:
            # show/clear look at what wagent made, even where shaping is now disabled.
            shaping = Shaping(**{**shaping.__dict__, "enabled": True})
    return Shaper(shaping, sources, args.state_dir or state_dir)


def _run(args: argparse.Namespace, body: Callable[[], int]) -> int:
    if not args.verbose:
        # The notes are printed below as "note: ..."; the daemon is who needs them as log lines.
        logging.getLogger("shaping.shaper").setLevel(logging.ERROR)
    try:
        return body()
    except (ShapingError, PolicyError) as e:
        print(f"wagent shaping {args.verb}: {e}", file=sys.stderr)
        return 1


def _apply(args: argparse.Namespace) -> int:
    def body() -> int:
        shaper = _shaper(args, need_policy=True)
        report = shaper.apply(dry_run=args.dry_run)
        for note in report.notes:
            print(f"note: {note}", file=sys.stderr)
        if args.dry_run:
            for line in report.commands:
                print(line)
            if not report.actions:
                print("# nothing to change", file=sys.stderr)
        else:
            n = len(report.actions)
            print(f"applied: {n} change{'s' * (n != 1)}" if n else "applied: nothing to change")
        return 0
    return _run(args, body)


def _show(args: argparse.Namespace) -> int:
    def body() -> int:
        data = _shaper(args, need_policy=False).show()
        if args.json:
            json.dump(data, sys.stdout, indent=2)
            print()
            return 0
        if not data["interfaces"]:
            print("no interface shaped by wagent")
        for entry in data["interfaces"]:
            _print_interface(entry)
        return 0
    return _run(args, body)


def _clear(args: argparse.Namespace) -> int:
    def body() -> int:
        for note in _shaper(args, need_policy=False).clear():
            print(f"note: {note}", file=sys.stderr)
        print("cleared")
        return 0
    return _run(args, body)


def _print_interface(e: dict) -> None:
    if not e["exists"]:
        print(f"{e['interface']}: no such interface")
        return
    root = e["root"]
    was = e["original"]
    before = f"; before wagent: {was['kind']} {was['handle']}" if was else ""
    owner = "wagent's" if e["wagent"] else "not wagent's"
    print(f"{e['interface']}: root {root['kind'] if root else 'none'} "
          f"{root['handle'] if root else ''} ({owner}{before})")
    for direction, tree in (("egress", e["egress"]), ("ingress", e["ingress"])):
        if tree is None:
            continue
        via = f" via {e['ifb']}" + ("" if e["redirect"] else " (redirect missing)") \
            if direction == "ingress" else ""
        ports = ", ".join(str(p) for p in sorted(set(tree["ports"]["ip"] + tree["ports"]["ipv6"])))
        print(f"  {direction}{via}: distribution source ports {ports or '-'}")
        for c in tree["classes"]:
            st = c["stats"]
            print(f"    {c['classid']:<8} {c['name']:<13} prio {c['prio']} rate "
                  f"{format_rate(c['rate']):>12} ceil {format_rate(c['ceil']):>12}  sent "
                  f"{format_size(st.get('bytes', 0)):>9}  drops {st.get('drops', 0)}  now "
                  f"{format_rate(st.get('rate', 0))}")
