"""Benchmark 5: ``wagent manifest build`` hashing speed beside ``openssl sha256``, same files.

The manifest holds a sha256 per piece and per file, so wagent hashes every byte twice (pieces
and whole files, on parallel threads); openssl hashes each file once, on one core. Files on
tmpfs, so the disk isn't measured; the page cache is warm for both.

    python tests/bench/hashing.py [--size 1GiB] [--jobs N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--runs", type=int, default=2, help="best of N")
    ap.add_argument("--quick", action="store_true", help="256MiB")
    args = ap.parse_args(argv)

    from agent.units import format_size, parse_size
    from tests import modelgen

    size = parse_size("256MiB" if args.quick else args.size)
    work = Path(tempfile.mkdtemp(prefix="wagent-bench-hash-", dir="/dev/shm"))
    try:
        d = work / "m" / "v1"
        modelgen.generate_sized(d, size, shards=args.shards)
        files = sorted(str(p) for p in d.iterdir())
        total = sum(os.path.getsize(f) for f in files)
        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.runs):
            rows.setdefault(f"wagent manifest build --jobs {args.jobs}", []).append(timed(
                [sys.executable, "-m", "agent", "manifest", "build", str(d), "--jobs",
                 str(args.jobs), "-q"]))
            rows.setdefault("wagent manifest build --jobs 1", []).append(timed(
                [sys.executable, "-m", "agent", "manifest", "build", str(d), "--jobs", "1",
                 "-q"]))
            (d / "manifest.json").unlink()
            rows.setdefault("openssl sha256 (one pass, 1 core)", []).append(
                timed(["openssl", "sha256", *files]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Hashing: {format_size(total)} in {len(files)} files on tmpfs, best of {args.runs}")
    print(f"{'tool':36} {'MB/s':>8} {'CPU s':>7} {'x openssl':>10}")
    ref = total / min(w for w, _ in rows["openssl sha256 (one pass, 1 core)"])
    for label, runs in rows.items():
        wall, cpu = min(runs)
        print(f"{label:36} {total / wall / 1e6:8.0f} {cpu:7.2f} {total / wall / ref:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
