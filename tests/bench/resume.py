"""Benchmark 4: kill -9 a pull at about 50%, pull again; how much is fetched twice?

On the testbed (a link capped at --rate), ``wagent pull`` runs in the node's namespace; at about
half the bytes (counted from the piece journals and landed blobs) it gets SIGKILL, then the same
command runs again to completion. Re-fetched bytes are counted on the origin's side (nginx's
``$body_bytes_sent`` over both runs, minus the version's size): an upper bound, since bytes still
in socket buffers at the kill were sent but never received.

Target: re-fetched <= streams x piece size.

    python tests/bench/resume.py [--size 32MiB] [--streams 8] [--piece-size 1MiB] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def landed(store: Path) -> int:
    """Bytes verified so far: journaled pieces of partial files plus whole blobs."""
    n = 0
    for j in (store / "partial").glob("*.journal"):
        try:
            text = j.read_text()
        except FileNotFoundError:
            continue
        n += sum(int(line.split()[2]) for line in text.splitlines()
                 if line.startswith("piece ") and len(line.split()) == 4)
    for b in (store / "blobs").glob("*"):
        try:
            n += b.stat().st_size
        except FileNotFoundError:
            pass
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="32MiB")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--piece-size", default="1MiB")
    ap.add_argument("--rate", default="80mbit")
    ap.add_argument("--at", type=float, default=0.5, help="fraction at which to kill")
    ap.add_argument("--quick", action="store_true", help="16MiB")
    args = ap.parse_args(argv)

    from agent.units import format_size, parse_size
    from tests import modelgen
    from tests.pull_helpers import publish_dir
    from tests.testbed import Testbed

    size = parse_size("16MiB" if args.quick else args.size)
    piece = parse_size(args.piece_size)
    work = Path(tempfile.mkdtemp(prefix="wagent-bench-resume-", dir="/dev/shm"))
    try:
        version = work / "origin" / "m" / "v1"
        modelgen.generate_sized(version, size, shards=args.shards)
        publish_dir(version, piece_size=piece)
        total = sum(p.stat().st_size for p in version.iterdir() if p.name != "manifest.json")
        with Testbed() as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=args.rate)
            srv = tb.nginx(origin, root=work / "origin", port=8080)
            store = work / "store"
            cmd = [sys.executable, "-m", "agent", "pull", f"{srv.url_for(link.a)}/m/v1",
                   "--store", str(store), "--streams", str(args.streams), "--quiet"]
            p = node.popen(cmd, cwd=str(ROOT))
            deadline = time.monotonic() + 600
            while landed(store) < args.at * total and time.monotonic() < deadline:
                if p.poll() is not None:
                    raise SystemExit("the pull ended before it could be killed: use a lower "
                                     "--rate or a larger --size")
                time.sleep(0.01)
            p.send_signal(signal.SIGKILL)
            p.wait()
            at_kill = landed(store)
            time.sleep(0.5)                 # nginx logs a request when it ends
            first = srv.bytes_sent("/m/v1/") - srv.bytes_sent("/m/v1/manifest.json")
            t = time.monotonic()
            node.run(cmd, timeout=600, cwd=str(ROOT))
            second_took = time.monotonic() - t
            both = srv.bytes_sent("/m/v1/") - srv.bytes_sent("/m/v1/manifest.json")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    refetched = both - total
    bound = args.streams * piece
    print(f"Resume: {format_size(total)}, {args.streams} streams, {format_size(piece)} pieces, "
          f"link {args.rate}; killed at {at_kill / total:.0%} verified")
    print(f"{'run':34} {'bytes sent by origin':>20}")
    print(f"{'first (killed -9)':34} {first:20,d}")
    print(f"{'second (resumed, ' + f'{second_took:.1f}s)':34} {both - first:20,d}")
    print(f"{'re-fetched (both - size)':34} {refetched:20,d}")
    print(f"{'bound: streams x piece size':34} {bound:20,d}")
    print(f"result: re-fetched {refetched / piece:.2f} pieces' worth ({refetched / bound:.2f} of "
          f"the bound): {'PASS' if refetched <= bound else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
