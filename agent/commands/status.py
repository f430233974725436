"""`wagent status`: not implemented yet."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="(not implemented yet)")
    p.set_defaults(func=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    print("wagent status: not implemented yet", file=sys.stderr)
    return 2
