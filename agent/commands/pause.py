"""`wagent pause` / `wagent resume`: stop starting pulls (running ones stop, partials kept), and
start again. Root or the service's user only (the daemon checks SO_PEERCRED)."""

from __future__ import annotations

import argparse

from agent.commands import ask_daemon
from agent.control import DEFAULT_SOCKET


def register(sub: argparse._SubParsersAction) -> None:
    _add(sub, "pause", "stop pulling until `wagent resume` (running pulls keep their pieces)")


def _add(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")
    p.set_defaults(func=lambda args: run(name, args))


def run(cmd: str, args: argparse.Namespace) -> int:
    result = ask_daemon(cmd, args.socket)
    if result is None:
        return 1
    print("pulls paused" if result.get("paused") else "pulls resumed")
    return 0
