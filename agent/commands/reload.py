"""`wagent reload`: ask the daemon to reload its policy and wait for the answer (systemd's
ExecReload). Exit 0 reloaded, 1 refused (the old policy stays in force) or no daemon."""

from __future__ import annotations

import argparse

from agent.commands import add_duration_option, ask_daemon
from agent.control import DEFAULT_SOCKET


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reload", help="reload the daemon's policy and wait for its answer",
        description="The daemon validates the policy file again; an invalid policy is refused "
        "(exit 1, errors as file:line: message) and the old one keeps running.")
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")
    add_duration_option(p, "--timeout", default="130s",
                        help="how long to wait for the daemon's answer, e.g. 60s, 2m or 60 "
                             "(seconds) (default 130s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = ask_daemon("reload", args.socket, timeout=args.timeout)
    if result is None:
        return 1
    print(f"reloaded {result.get('path', '')} (sha256 {result.get('sha256', '')[:12]})")
    return 0
