"""`wagent run`: the daemon, in the foreground (systemd ``Type=notify``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent.application import Application
from agent.commands import DEFAULT_POLICY
from agent.control import ControlError
from agent.daemon import Daemon
from agent.metrics import MetricsError
from agent.notify import Notifier, watchdog_interval
from agent.policy import PolicyError
from agent.store import StoreError
from shaping.errors import ShapingError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run the agent in the foreground (the systemd service)",
        description="Load the policy, apply shaping, then pull on this node's schedule, backing "
        "off when training traffic appears. SIGHUP reloads the policy, SIGTERM stops (caps stay "
        "in place). Exits 1 when the policy is invalid or shaping can't be applied.")
    p.add_argument("--policy", default=DEFAULT_POLICY, metavar="PATH",
                   help=f"policy file (default {DEFAULT_POLICY})")
    p.add_argument("--state-dir", metavar="DIR", help="override the policy's state_dir")
    p.add_argument("--socket", metavar="PATH", help="override the policy's control.socket")
    p.add_argument("--hostname", metavar="NAME",
                   help="the name matched against roles' host patterns (default: this host's)")
    p.add_argument("--node-id", metavar="ID",
                   help="the identity the schedule hashes (default: /etc/machine-id)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.verbose == 0:
        logging.getLogger().setLevel(logging.INFO)   # a daemon's journal wants its story
    app = Application(os.path.abspath(args.policy), state_dir=args.state_dir,
                      socket=args.socket, hostname=args.hostname, node_id=args.node_id)
    try:
        policy = app.load()
    except PolicyError as e:
        print(f"wagent run: refusing to start, the policy has errors:\n{e}", file=sys.stderr)
        return 1
    daemon = Daemon(app, Notifier(),
                    watchdog_interval=watchdog_interval(os.environ, os.getpid()))
    try:
        return daemon.run(policy)
    except ShapingError as e:
        print(f"wagent run: can't apply shaping, not starting unshaped: {e}", file=sys.stderr)
        return 1
    except ControlError as e:
        # "unsafe": a control socket others could replace; the message names the directory
        what = "refusing to start" if e.kind == "unsafe" else "can't start"
        print(f"wagent run: {what}: {e}", file=sys.stderr)
        return 1
    except (MetricsError, StoreError, OSError) as e:
        print(f"wagent run: can't start: {e}", file=sys.stderr)
        return 1
