"""`wagent manifest build DIR`: the publisher's side, writes ``DIR/manifest.json``.

Model and version default to the names of DIR's parent and of DIR (the origin layout is
``{model}/{version}/``). Publish a version by copying DIR to the origin, then writing the
one-line ``{model}/latest`` file last, so that nodes following "latest" never see half of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agent.manifest import DEFAULT_PIECE_SIZE, ManifestError, build, parse_published, write
from agent.safetensors_layout import LayoutError
from agent.units import UnitError, format_rate, format_size, parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("manifest", help="build a version's manifest.json (publisher side)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="manifest_action", metavar="ACTION")
    actions.required = True
    b = actions.add_parser("build", help="hash DIR's files and write DIR/manifest.json")
    b.add_argument("dir", metavar="DIR")
    b.add_argument("--model", help="model name (default: DIR's parent's name)")
    b.add_argument("--version", dest="model_version",
                   help="version name (default: DIR's name)")
    b.add_argument("--piece-size", default="64MiB", metavar="SIZE",
                   help="fixed pieces of other files and split of big tensors (default 64MiB)")
    b.add_argument("--jobs", type=int, metavar="N", help="hashing threads (default: CPUs)")
    b.add_argument("--published", metavar="TIME",
                   help="the version's publication time, which starts every node's stagger "
                   "clock (RFC 3339 UTC, e.g. 2026-12-02T11:00:00Z; default: now). Give the "
                   "time the upload will finish when the build runs long before it")
    b.add_argument("-q", "--quiet", action="store_true")
    b.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    try:
        piece_size = parse_size(args.piece_size) if args.piece_size else DEFAULT_PIECE_SIZE
    except UnitError as e:
        print(f"wagent manifest build: --piece-size: {e}", file=sys.stderr)
        return 2
    clock = None
    if args.published is not None:
        try:
            published = parse_published(args.published)
        except ManifestError as e:
            print(f"wagent manifest build: --published: {e}", file=sys.stderr)
            return 2
        clock = lambda: published  # noqa: E731
    if not directory.is_dir():
        print(f"wagent manifest build: {directory} is not a directory", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        m = build(directory, args.model, args.model_version, piece_size=piece_size,
                  jobs=args.jobs, clock=clock)
        if not m.files:
            print(f"wagent manifest build: {directory} holds no file to publish",
                  file=sys.stderr)
            return 1
        path = write(directory, m)
    except (ManifestError, LayoutError) as e:
        print(f"wagent manifest build: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"wagent manifest build: {e.filename or directory}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    took = time.monotonic() - started
    if not args.quiet:
        pieces = sum(len(f.pieces) for f in m.files)
        print(f"{path}: {m.model}/{m.version}, {len(m.files)} files, {pieces} pieces, "
              f"{format_size(m.size)} hashed in {took:.2f}s "
              f"({format_rate(m.size * 8 / took) if took > 0 else '-'})")
    return 0
