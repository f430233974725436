"""Benchmark 3: a new version that changes 2 of 16 layers, one tensor resized.

On the testbed (an origin, a node, a 1 Gbit/s link), the node holds v1 and moves to v2 three ways:

* ``wagent pull`` into the store holding v1: tensor pieces it has are copied locally, the rest
  fetched with HTTP ranges;
* ``rsync`` from an rsync daemon on the origin into a copy of v1 (its delta algorithm: it reads
  every byte on both sides, and needs an rsync server);
* a full ``wagent pull`` of v2 into an empty store.

Target: wagent's bytes fetched <= 1.02 x (bytes of the changed tensors + headers of the rewritten
shards + rewritten small files).

    python tests/bench/delta.py [--hidden 512] [--quick]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--quick", action="store_true", help="hidden 256")
    args = ap.parse_args(argv)

    from agent.units import format_size
    from tests import modelgen
    from tests.pull_helpers import publish_dir, pull_in
    from tests.testbed import Testbed

    hidden = 256 if args.quick else args.hidden
    work = Path(tempfile.mkdtemp(prefix="wagent-bench-delta-", dir="/dev/shm"))
    rows = []
    try:
        origin_root = work / "origin"
        v1, v2 = origin_root / "m" / "v1", origin_root / "m" / "v2"
        modelgen.generate(v1, layers=args.layers, hidden=hidden, shards=args.shards)
        publish_dir(v1)
        spec = modelgen.next_version(
            v1, v2, change_layers=[3, 11],
            resize={"model.layers.3.mlp.up_proj.weight": [4 * hidden + 64, hidden]})
        publish_dir(v2)
        target = spec.delta_bytes
        total = spec.total_bytes
        with Testbed() as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=args.rate)
            srv = tb.nginx(origin, root=origin_root, port=8080)
            rsyncd = tb.rsyncd(origin, root=origin_root, port=873)
            base = srv.url_for(link.a)

            store = work / "store"
            pull_in(node, f"{base}/m/v1", store)
            r = pull_in(node, f"{base}/m/v2", store)
            rows.append(("wagent pull v1 -> v2", r["fetched"], r["seconds"],
                         f"{format_size(r['reused'])} copied locally"))

            dst = work / "rsync-dst"
            shutil.copytree(v1, dst)
            (dst / "manifest.json").unlink()
            t = time.monotonic()
            # -I: never skip a file for matching size and mtime (v1 and v2 may be written in the
            # same second): every file goes through rsync's delta algorithm.
            out = node.run(["rsync", "-a", "-I", "--stats", "--exclude", "manifest.json",
                            f"{rsyncd.url_for(link.a)}/m/v2/", f"{dst}/"], timeout=900)
            took = time.monotonic() - t
            received = int(re.search(r"Total bytes received: ([\d,]+)", out.stdout)
                           .group(1).replace(",", ""))
            for f in v2.iterdir():
                if f.name != "manifest.json":
                    assert (dst / f.name).read_bytes() == f.read_bytes(), f
            rows.append(("rsync v1 -> v2", received, took, "reads all bytes on both sides"))

            full = pull_in(node, f"{base}/m/v2", work / "store-empty")
            rows.append(("wagent pull v2 (empty store)", full["fetched"], full["seconds"], ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Delta: {args.layers} layers, hidden {hidden}, {args.shards} shards, "
          f"{format_size(total)}; changed tensors + headers = {format_size(target)} "
          f"({target} B); link {args.rate}")
    print(f"{'how':30} {'bytes received':>15} {'x changed':>10} {'seconds':>8}  note")
    for label, n, secs, note in rows:
        print(f"{label:30} {n:15,d} {n / target:10.4f} {secs:8.2f}  {note}")
    ratio = rows[0][1] / target
    print(f"result: wagent fetched {ratio:.4f}x the changed bytes (target <= 1.02): "
          f"{'PASS' if ratio <= 1.02 else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
