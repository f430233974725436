"""`wagent wait MODEL [--version V] [--timeout DURATION]`: block until a version is complete in the
store.

For deploy scripts and inference servers' start-up: exit 0 once the version (or, without
``--version``, the model's current version) is complete, 1 on timeout. It reads the store only
and needs no daemon: a version directory appears only once complete and durable, so seeing it is
the answer.
"""

from __future__ import annotations

import argparse
import sys
import time

from agent.commands import add_duration_option, add_store_arguments, store_root
from agent.manifest import ManifestError, check_name
from agent.store import Store, pointers
from agent.units import exact_duration

POLL = 0.5


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wait", help="wait until a version is complete in the store (exit 0), "
                                    "or the timeout (exit 1)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--version", help="the version (default: the model's current one)")
    add_duration_option(p, "--timeout", default=None,
                        help="give up after this long, e.g. 90s, 15m or 90 (seconds); "
                             "default: wait for ever")
    add_store_arguments(p)
    p.set_defaults(func=run)


def ready(store: Store, model: str, version: str | None) -> str | None:
    """The complete version that answers the wait, if there is one yet."""
    if version is None:
        return pointers.current(store, model)
    return version if store.installed(model, version) is not None else None


def run(args: argparse.Namespace) -> int:
    try:
        check_name("model", args.model)
        if args.version is not None:
            check_name("version", args.version)
    except ManifestError as e:
        print(f"wagent wait: {e}", file=sys.stderr)
        return 2
    store = Store(store_root(args))
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        got = ready(store, args.model, args.version)
        if got is not None:
            print(store.version_dir(args.model, got))
            return 0
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            what = args.version or "a current version"
            # A store not made yet is waited for (a fresh node's daemon makes it with its first
            # pull), but a mistyped --store must read as one when the wait ends.
            missing = "" if store.root.is_dir() else " (no store there: it does not exist)"
            print(f"wagent wait: {args.model}: {what} not complete in {store.root}{missing} "
                  f"after {exact_duration(args.timeout)}", file=sys.stderr)
            return 1
        time.sleep(POLL if left is None else min(POLL, left))
