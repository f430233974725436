"""`wagent pull URL --store DIR`: one pull of ``{source}/{model}/{version}`` into a store.

The version may be ``latest`` (read from ``{source}/{model}/latest``). ``--mirror`` adds sources
tried per piece after the first (same model and version paths). Exit 0 when the version is in the
store, 1 with the reason when it is not (pieces already verified are kept: pull again to resume).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

from agent.commands import source_options
from agent.manifest import ManifestError, check_name
from agent.policy import PolicyError, load_policy
from agent.policy.model import Pulls, Source
from agent.pull.connections import Connections
from agent.pull.engine import (
    PullError,
    PullOptions,
    fetch_manifest,
    pull_version,
    resolve_latest,
)
from agent.pull.progress import Reporter, summary
from agent.redact import redact
from agent.store import Store, StoreError, pointers
from agent.store.verify import drop_bad_blobs
from agent.units import UnitError, parse_rate, parse_size
from agent.yielding.ratelimit import TokenBucket
from agent.yielding.runtime import around_pull
from shaping.errors import ShapingError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="pull one model version into a store",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", metavar="URL", help="{source}/{model}/{version}; version may be "
                   "'latest'; a source is http(s):// or s3://BUCKET/PREFIX")
    p.add_argument("--store", required=True, metavar="DIR", help="the store directory")
    p.add_argument("--streams", type=int, metavar="N", help="parallel streams at most "
                   "(default 32); with --no-adaptive, exactly")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose how many streams by measuring what each adds, up to --streams; "
                   "--no-adaptive: always --streams (default: the policy's "
                   "pulls.adaptive_streams, on)")
    p.add_argument("--rate", metavar="RATE", help="cap, e.g. 300mbit or 50MB/s (default: none)")
    p.add_argument("--mirror", action="append", default=[], metavar="URL",
                   help="another source base URL, tried per piece after the first (repeatable)")
    p.add_argument("--piece-size", metavar="SIZE", help="largest request (default 64MiB)")
    source_options.add(p)
    p.add_argument("--verify-files", action="store_true",
                   help="also re-read and hash each whole file (pieces are always verified)")
    p.add_argument("--policy", metavar="FILE",
                   help="take pull settings (streams, timeouts, retries, rate) from a policy, "
                        "and run its shaping and backoff beside the pull")
    p.add_argument("--current", action="store_true",
                   help="then point {store}/models/{model}/current at the version (the path an "
                   "inference server loads)")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout (no progress output)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def split_url(url: str) -> tuple[str, str, str]:
    """(source, model, version) from ``{source}/{model}/{version}``."""
    parts = url.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or "://" not in parts[0] or not parts[1] or not parts[2]:
        raise ValueError(f"URL {redact(url)!r} must be {{source}}/{{model}}/{{version}}, e.g. "
                         "http://origin:8080/llama/v7 (version may be 'latest')")
    scheme = parts[0].split("://", 1)[0].lower()
    if scheme not in ("http", "https", "s3"):
        raise ValueError(f"URL {redact(url)!r}: {scheme}:// is not supported; sources are "
                         "http://, https:// or s3://BUCKET/PREFIX")
    try:
        check_name("model", parts[1])
        if parts[2] != "latest":            # 'latest' is resolved; any other must be a version
            check_name("version", parts[2])
    except ManifestError as e:
        raise ValueError(f"URL {redact(url)!r}: {e}") from None
    return parts[0], parts[1], parts[2]


def run(args: argparse.Namespace) -> int:
    # This pull's HTTP deadline watchdog and pull sockets' registry (the backoff loop's too).
    connections = Connections()
    if args.policy:
        return run_with_policy(args, connections)
    return run_pull(args, bucket=None, connections=connections)


def run_with_policy(args: argparse.Namespace, connections: Connections) -> int:
    """``--policy``: the policy's shaping (the ingress cap) and backoff run beside the pull."""

    try:
        policy = load_policy(args.policy)
    except PolicyError as e:
        print(f"wagent pull: the policy is refused:\n{e}", file=sys.stderr)
        return 1
    try:
        rate = parse_rate(args.rate) if args.rate else None
        source = source_options.source_of(split_url(args.url)[0], args)
    except (UnitError, ValueError) as e:
        print(f"wagent pull: {e}", file=sys.stderr)
        return 2
    bucket = TokenBucket(None)
    try:
        with around_pull(policy, bucket, sockets=connections.sockets, rate=rate,
                         sources=[source]):
            return run_pull(args, bucket, connections=connections)
    except ShapingError as e:
        print(f"wagent pull: shaping: {e}", file=sys.stderr)
        return 1


def run_pull(args: argparse.Namespace, bucket: TokenBucket | None,
             stop: threading.Event | None = None, *, connections: Connections) -> int:
    """The pull itself; ``bucket`` lets a caller (the backoff loop) move the rate while it runs;
    ``connections``: the caller's, whose sockets that loop clamps."""

    try:
        source, model, version = split_url(args.url)
        pulls = _policy_pulls(args.policy) if args.policy else Pulls()
        options = PullOptions.from_policy(pulls)
        if args.streams is not None:
            if args.streams < 1:
                raise ValueError("--streams must be at least 1")
            options = replace(options, streams=args.streams)
        if args.piece_size:
            size = parse_size(args.piece_size)
            options = replace(options, piece_size=size, request_size=min(size,
                                                                         options.request_size))
        options = replace(options, verify_files=args.verify_files)
        if args.adaptive is not None:
            options = replace(options, adaptive=args.adaptive)
        rate = parse_rate(args.rate) if args.rate else pulls.rate
    except (ValueError, UnitError) as e:
        print(f"wagent pull: {e}", file=sys.stderr)
        return 2
    if bucket is None:
        bucket = TokenBucket(rate)
    elif rate is not None:
        bucket.set_rate(rate)
    try:
        sources = [source_options.source_of(u, args) for u in [source, *args.mirror]]
    except ValueError as e:
        print(f"wagent pull: {e}", file=sys.stderr)
        return 2
    stop = stop or threading.Event()
    reporter = Reporter(quiet=args.quiet or args.json)
    restore = _stop_on_term(stop)
    store = Store(args.store)
    try:
        if args.verify_files:
            version = _drop_bad_blobs(sources, model, version, store, options, connections)
        result = pull_version(sources, model, version, store, options=options,
                              bucket=bucket, progress=reporter, stop=stop,
                              connections=connections)
        if args.current:
            pointers.set_current(store, result.model, result.version)
    except (PullError, StoreError, OSError) as e:
        reporter.end()
        print(f"wagent pull: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        reporter.end()
        name = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C (SIGINT)"
        print(f"wagent pull: stopped by {name}; the pieces already verified are kept: pull "
              "again to resume", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    finally:
        restore()
    if args.json:
        print(json.dumps({"ok": True, "model": result.model, "version": result.version,
                          "path": str(result.path), "bytes_total": result.bytes_total,
                          "bytes_fetched": result.bytes_fetched,
                          "bytes_reused": result.bytes_reused, "files": result.files,
                          "seconds": round(result.seconds, 3), "current": args.current}))
    elif not args.quiet:
        print(summary(result), file=sys.stderr)
    return 0


def _drop_bad_blobs(sources: list[Source], model: str, version: str, store: Store,
                    options: PullOptions, connections: Connections) -> str:
    """``--verify-files`` distrusts what the store holds too: every blob the version would use
    that is there already is re-hashed first, and one that fails is removed, so that the pull
    fetches it again rather than report a damaged version installed. Returns the version
    (``latest`` resolved once, here, so the check and the pull see the same one)."""
    if version == "latest":
        version = resolve_latest(sources, model, options, connections=connections)
    m = store.version_manifest(model, version)
    if m is None:                         # a new version may still share blobs with others
        _, m = fetch_manifest(sources, model, version, options, connections=connections)
    for p in drop_bad_blobs(store, m):
        print(f"wagent pull: {p.model}/{p.version}/{p.path}: {p.why}", file=sys.stderr)
    return version


def _policy_pulls(path: str) -> Pulls:
    return load_policy(path).pulls


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt for Ctrl-C (a BaseException, so
    that no ``except Exception`` on the way swallows it)."""


def _stop_on_term(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM and Ctrl-C end the pull within a fraction of a second; partials are kept.

    ``stop`` cuts the streams' requests in flight (the HTTP watchdog shuts their sockets down)
    and their token-bucket waits. The main thread may be blocked too (a manifest or ``latest``
    trickling in): the exception raised here interrupts its read at once, and on the way out the
    transfer, if running, waits for its streams, which ``stop`` has ended. A second signal only
    sets ``stop`` again: the first one's cleanup must run to its end."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            return
        stop.set()
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)
    return restore
