"""The ``wagent`` command line: parses arguments and hands off to one module per subcommand.

Exit codes (stable, documented in wagent(8)): 0 success, 1 a failure the command reports,
2 a usage error or a command that is not implemented yet, 3 ``status`` with no daemon running.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from agent import __version__

# Order is the order of `wagent --help`.
SUBCOMMANDS = ("run", "status", "reload", "pause", "resume", "policy", "manifest", "pull",
               "shaping", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wagent",
        description="Pull model weights onto this node in the background, shaped so that "
        "training and inference traffic come first.",
    )
    parser.add_argument("--version", action="version", version=f"wagent {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (repeat for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"agent.commands.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("wagent: interrupted", file=sys.stderr)
        return 130
