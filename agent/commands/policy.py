"""`wagent policy check FILE...` and `wagent policy show`: validate a policy, show its effect.

``check`` is meant for a policy repository's CI and pre-commit hook: one ``file:line: message``
line per problem on stdout, exit 1 if any file has one, 0 (and ``FILE: ok``) when all are clean.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from agent.commands import DEFAULT_POLICY
from agent.policy import PolicyError, check_policy, load_policy
from agent.policy.document import policy_document


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="check a policy file, or show the effective policy",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="policy_action", metavar="ACTION")
    actions.required = True
    check = actions.add_parser("check", help="validate policy files: file:line: message per "
                                             "problem; exit 1 on any")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("-q", "--quiet", action="store_true", help="don't print 'FILE: ok'")
    check.add_argument("--json", action="store_true",
                       help="one JSON document: every file with its problems (file, line, "
                       "message)")
    check.set_defaults(func=run_check)
    show = actions.add_parser("show", help="print the effective policy, defaults filled in "
                                           "(rates in bits/s, sizes in bytes, durations in s)")
    show.add_argument("--policy", default=DEFAULT_POLICY, help=f"default: {DEFAULT_POLICY}")
    show.add_argument("--json", action="store_true", help="JSON instead of YAML")
    show.set_defaults(func=run_show)


def run_check(args: argparse.Namespace) -> int:
    if args.json:
        files = [{"file": path, "problems": [i._asdict() for i in check_policy(path)]}
                 for path in args.files]
        print(json.dumps({"ok": not any(f["problems"] for f in files), "files": files},
                         indent=2))
        return 0 if all(not f["problems"] for f in files) else 1
    failed = False
    for path in args.files:
        issues = check_policy(path)
        for issue in issues:
            print(issue)
        if issues:
            failed = True
        elif not args.quiet:
            print(f"{path}: ok")
    return 1 if failed else 0


def run_show(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as e:
        print(e, file=sys.stderr)
        return 1
    if args.json:
        json.dump(policy_document(policy, with_units=False), sys.stdout, indent=2)
        print()
    else:
        print(f"# effective policy from {policy.path} (sha256 {policy.sha256[:12]}); "
              f"loads as a policy itself")
        sys.stdout.write(yaml.safe_dump(policy_document(policy), sort_keys=False,
                                        default_flow_style=None))
    return 0
