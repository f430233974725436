"""`wagent publish DIR DEST`: put a version where nodes pull it, in the order they need it.

DIR is a version directory ``.../{model}/{version}`` (as `wagent manifest build` takes it); DEST
a source base: ``s3://BUCKET/PREFIX`` (MinIO, Ceph RGW, SeaweedFS with ``--endpoint-url``;
credentials from the AWS chain or ``--credentials``), or a local directory that an nginx origin
serves. The manifest is built when DIR has none (``--published``, ``--piece-size`` as for
`manifest build`), else DIR's files are checked against it. Then the files go up in parallel
(multipart for large ones; a run again after an interruption sends only what is missing), then
``manifest.json``, then ``{model}/latest`` last (not with ``--no-latest``: a staged version),
each atomically. A version already published with other bytes is refused.

Exit 0 when published, 1 with the reason when not (nothing a node reads was changed), 2 for a
usage error, 130 when interrupted (run again to resume).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.commands import source_options
from agent.manifest import (
    DEFAULT_PIECE_SIZE,
    Manifest,
    ManifestError,
    build,
    parse_published,
    write,
)
from agent.publish.destination import Destination, PublishError
from agent.publish.local import LocalDestination
from agent.publish.publish import local_manifest, publish
from agent.pull.progress import Reporter
from agent.s3.address import S3AddressError, is_s3
from agent.s3.auth import S3AuthError
from agent.s3.upload import S3Destination
from agent.safetensors_layout import LayoutError
from agent.units import UnitError, format_duration, format_rate, format_size, parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish a version directory to an origin (s3:// or a "
                       "directory nginx serves)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="the version directory .../{model}/{version}")
    p.add_argument("dest", metavar="DEST", help="s3://BUCKET/PREFIX, or a local directory")
    p.add_argument("--no-latest", action="store_true",
                   help="leave {model}/latest as it is (stage the version)")
    p.add_argument("--published", metavar="TIME",
                   help="for a manifest built now: the publication time that starts every "
                   "node's stagger clock (RFC 3339 UTC; default: now)")
    p.add_argument("--piece-size", default="64MiB", metavar="SIZE",
                   help="for a manifest built now (default 64MiB)")
    p.add_argument("--streams", type=int, default=8, metavar="N",
                   help="parallel uploads (default 8)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    source_options.add(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    try:
        if args.streams < 1:
            raise ValueError("--streams must be at least 1")
        piece_size = parse_size(args.piece_size) if args.piece_size else DEFAULT_PIECE_SIZE
        published = parse_published(args.published) if args.published else None
        if "://" in args.dest and not is_s3(args.dest):
            raise ValueError(f"DEST {args.dest!r}: publish writes to s3://BUCKET/PREFIX or to a "
                             "local directory an origin serves")
        source = source_options.source_of(args.dest, args)     # s3-only options refused
        if not is_s3(args.dest):
            source = None
    except (ValueError, UnitError, ManifestError, S3AddressError) as e:
        print(f"wagent publish: {e}", file=sys.stderr)
        return 2
    if not directory.is_dir():
        print(f"wagent publish: {directory} is not a directory", file=sys.stderr)
        return 1
    reporter = Reporter(quiet=args.quiet, verb="uploaded")

    def built() -> Manifest:
        clock = (lambda: published) if published is not None else None
        m = build(directory, piece_size=piece_size, clock=clock)
        if not m.files:
            raise PublishError(f"{directory} holds no file to publish")
        write(directory, m)
        return m

    dest: Destination | None = None
    try:
        m, made = local_manifest(directory, built)
        if made and not args.quiet:
            print(f"{directory / 'manifest.json'}: built, {len(m.files)} files, "
                  f"{format_size(m.size)}", file=sys.stderr)
        if source is not None:
            dest = S3Destination(source, streams=args.streams)
        else:
            dest = LocalDestination(Path(args.dest))
        r = publish(directory, m, dest, latest=not args.no_latest, streams=args.streams,
                    progress=reporter)
    except (PublishError, ManifestError, LayoutError, S3AuthError) as e:
        reporter.end()
        print(f"wagent publish: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        reporter.end()
        print(f"wagent publish: {e.filename or directory}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        reporter.end()
        print("wagent publish: interrupted; what was sent is kept: run it again to resume",
              file=sys.stderr)
        return 130
    finally:
        if dest is not None:
            dest.close()
    if not args.quiet:
        rate = r.bytes_sent * 8 / r.seconds if r.seconds > 0 else 0.0
        state = "already published; " if r.already else ""
        latest = f"{r.model}/latest -> {r.version}" if r.latest else "latest left as it was"
        where = args.dest.rstrip("/")
        print(f"{where}/{r.model}/{r.version}: {state}{r.files} files, "
              f"{format_size(r.bytes_total)}; {format_size(r.bytes_sent)} sent in "
              f"{format_duration(r.seconds)} ({format_rate(rate)}); {latest}")
    return 0
