"""`wagent status [--json]`: asks the running daemon. Exit 0 healthy, 1 degraded, 3 not running
(stable; the JSON is documented in docs/status.md)."""

from __future__ import annotations

import argparse
import json
import sys

from agent.control import DEFAULT_SOCKET, ControlError, NotRunning, call
from agent.status import EXIT_NOT_RUNNING, SCHEMA, exit_code, not_running_text, to_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="what the agent is doing (exit 0 healthy, 1 degraded, 3 not running)",
        description="Ask the running daemon for its state: node, role and wave; policy and last "
        "reload error; shaping counters; backoff; pulls; next window; store. Exit codes: "
        "0 running and healthy, 1 running but degraded, 3 not running.")
    p.add_argument("--json", action="store_true",
                   help="the versioned JSON document (schema in docs/status.md)")
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        doc = call(args.socket, "status", timeout=10.0)
    except NotRunning as e:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "running": False, "error": str(e)}))
        else:
            print(not_running_text(args.socket, str(e).split(": ", 1)[-1]))
        return EXIT_NOT_RUNNING
    except ControlError as e:
        print(f"wagent status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else to_text(doc))
    return exit_code(doc)
