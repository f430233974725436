"""The ``wagent`` command line: parses arguments and hands off to one module per subcommand.

Exit codes (stable, documented in wagent(8)): 0 success, 1 a failure the command reports,
2 a usage error or a command that is not implemented yet, 3 ``status`` with no daemon running;
141 when the reader of its output went away (``wagent status | head -1``), as for SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from agent import __version__, logs

EXIT_BROKEN_PIPE = 141              # 128 + SIGPIPE, as the shell reports a command killed by it

# Order is the order of `wagent --help`.
SUBCOMMANDS = ("run", "status", "reload", "pause", "resume", "policy", "manifest", "publish",
               "pull", "wait", "mount", "store", "shaping", "plan")
REGISTERED_BY = {"umount": "mount"}     # subcommands a module above registers beside its own


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command`` alone when given (a subcommand's modules import what it runs:
    the daemon's whole stack for ``run``; ``wagent mount`` in an engine's ExecStartPre
    shouldn't pay for it), of every subcommand otherwise (``wagent --help``, a typo)."""
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
    command = REGISTERED_BY.get(command or "", command)
    for name in SUBCOMMANDS if command not in SUBCOMMANDS else (command,):
        module = importlib.import_module(f"agent.commands.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()      # a reader gone shows here, not as a warning at exit
    except BrokenPipeError:
        return _reader_gone()


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # -v anywhere on the line (``wagent pull URL -v``): argparse only knows it before COMMAND.
    verbose = sum(_verbosity(a) for a in argv if a != "--")
    argv = [a for a in argv if not _verbosity(a)]
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    args.verbose = verbose
    logs.setup(verbose)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("wagent: interrupted", file=sys.stderr)
        return 130


def _verbosity(arg: str) -> int:
    """How many -v a word holds: ``-v``, ``-vv``, ``--verbose``; 0 for anything else."""
    if arg == "--verbose":
        return 1
    if len(arg) > 1 and arg[0] == "-" and arg[1:] == "v" * (len(arg) - 1):
        return len(arg) - 1
    return 0


def _reader_gone() -> int:
    """stdout's reader left (``wagent status | head -1``): end quietly, as a command killed by
    SIGPIPE would, with its exit code. Python's recipe: devnull on stdout, so that the flush at
    exit doesn't fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
