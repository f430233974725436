"""One module per CLI subcommand; each exposes ``register(subparsers)`` and sets ``func``.

``func(args) -> int`` returns the exit code: 0 success, 1 a failure the command reports,
2 a usage error (argparse's own), 3 for ``status`` when the daemon is not running.

Every option taking a time is declared with :func:`add_duration_option`, so that each reads the
same syntax (``agent.units.parse_option_duration``: ``90s``, ``15m``, ``1h30m``, ``100ms``, or
a bare number of seconds) and refuses anything else as a usage error naming the forms.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from agent.control import ControlError, NotRunning, call
from agent.units import UnitError, parse_option_duration

if TYPE_CHECKING:
    from agent.store import Store

DEFAULT_POLICY = "/etc/wagent/policy.yaml"
DEFAULT_STORE = "/var/cache/wagent"


def duration(text: str) -> float:
    """argparse's ``type`` for a time: seconds, or a usage error (exit 2) naming the forms."""
    try:
        return parse_option_duration(text)
    except UnitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_duration_option(p: argparse.ArgumentParser, flag: str, *, default: str | None,
                        help: str) -> None:
    """An option taking a time (``default`` written as a user would, or None)."""
    p.add_argument(flag, type=duration, default=default, metavar="DURATION", help=help)


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="DIR",
                   help="the store (default: the policy's, else " + DEFAULT_STORE + ")")
    p.add_argument("--policy", default=DEFAULT_POLICY, metavar="PATH",
                   help=f"the policy whose store is meant (default {DEFAULT_POLICY})")


def ask_daemon(cmd: str, socket: str, **kwargs: Any) -> dict[str, Any] | None:
    """The daemon's answer to ``cmd``; None (the reason printed) when there is none."""
    try:
        return call(socket, cmd, **kwargs)
    except NotRunning as e:
        print(f"wagent {cmd}: the daemon is not running ({e})", file=sys.stderr)
    except ControlError as e:
        print(f"wagent {cmd}: {e}", file=sys.stderr)
    return None


def existing_store(args: argparse.Namespace, cmd: str) -> Store | None:
    """The store the command reads (``store_root``), or None, the reason printed, when there is
    no store there: a mistyped ``--store`` must not read as an empty store ("0 B used", "no
    complete version", exit 0)."""
    root = store_root(args)
    if not os.path.isdir(root):
        what = "is not a directory" if os.path.lexists(root) else "does not exist"
        print(f"wagent {cmd}: no store at {root}: it {what}; give the store's directory "
              f"with --store DIR, or the policy that names it with --policy PATH",
              file=sys.stderr)
        return None
    # imported here: the commands that read no store start faster without it
    from agent.store import Store
    return Store(root)


def store_root(args: argparse.Namespace) -> str:
    """``--store``, else the store of the policy (when it exists and loads), else the default:
    the commands that read a store need no daemon, nor a valid policy."""
    if args.store:
        return str(args.store)
    if os.path.exists(args.policy):
        from agent.policy import PolicyError, load_policy
        try:
            return load_policy(args.policy).store.path
        except PolicyError:
            pass
    return DEFAULT_STORE
