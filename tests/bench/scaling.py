"""Benchmark 1: does a pull scale with streams when the origin caps each connection?

The seed experiment scaled down, on the testbed: an origin that gives one connection R over a link
of 10 R (HTB), a model of 16 or more shards, and a node pulling it with
wagent at 1, 2, 4 and 8 streams, and with ``aria2c -j8 -x1`` (one connection per file, 8 files at
once) on the same files, every client writing to tmpfs so this machine's disk isn't measured; one
more wagent row writes to disk. Throughput is bytes over the time the transfer took (wagent: from
the first request to the published version, as the engine reports it; aria2c: its process).

    python tests/bench/scaling.py [--rate 5MB/s] [--size 64MiB] [--shards 16] [--quick]
    python tests/bench/scaling.py --link-x 24 --counts 8,24,32 --aria2 24:1,8:4,4:16  # 24 R

Fixed counts run with ``adaptive_streams`` off; one more row chooses the count by measuring
(``pulls.adaptive_streams``, at most ``--adaptive``); aria2c runs once per ``--aria2`` spec,
whole files per connection (``-x1``) or split into ranges (``-x16 -s16``), and the best of its
rows is the peer.

The per-connection cap R: ``--cap flow`` (default) gives every TCP connection its own HTB class at
R under the link's class on the origin: the node's ephemeral ports are narrowed to 256 and a u32
hash on the low byte of the destination port picks the class, so no two connections ever share
one (this kernel has no fq for ``maxrate``). ``--cap nginx`` uses nginx's
``limit_rate R`` instead; nginx grants each *request* one second of credit (its limit is
``R x (elapsed + 1 s)``), so a client making many range requests smaller than R x 1 s is hardly
capped by it at all, which flatters any client that splits files into requests.

Target: 8 streams >= 7.2x one stream, and >= 0.95x aria2c -j8; the adaptive row within 5% of
the best fixed count and >= 1.05x the best aria2c row.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def per_flow_classes(ifname: str, rate: int, link: int) -> str:
    """tc batch: under HTB class 1:1 (the link, ``link`` bits/s), one class capped at ``rate``
    per low byte of the TCP destination port (the node's port), chosen by a 256-bucket u32
    hash table.

    Each class is assured only ``link / 256`` and borrows the rest up to its ceil, ``rate``,
    from the link's class: HTB gives a class its assured rate whatever its parent has left, so
    classes assured ``rate`` each would carry N x ``rate`` past the link (12 streams behind a
    40 MB/s link carried 55 MB/s) and no stream count would ever fill it."""
    lines = [f"qdisc del dev {ifname} parent 1:1 handle 10:",
             f"filter add dev {ifname} parent 1: prio 1 handle 2: protocol ip u32 divisor 256",
             f"filter add dev {ifname} parent 1: prio 1 protocol ip u32 ht 800:: match ip "
             "protocol 6 0xff hashkey mask 0x000000ff at 20 link 2:"]
    for i in range(256):
        cls = f"1:{0x100 + i:x}"
        lines.append(f"class add dev {ifname} parent 1:1 classid {cls} htb "
                     f"rate {max(8, link // 256)}bit ceil {rate}bit quantum 60000")
        lines.append(f"filter add dev {ifname} parent 1: prio 1 protocol ip u32 ht 2:{i:x}: "
                     f"match ip protocol 6 0xff flowid {cls}")
    return "\n".join(lines) + "\n"


def medians(rows: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """One row per label, in first-seen order: its median seconds and rate.

    >>> medians([("a", 1.0, 3.0), ("b", 2.0, 1.0), ("a", 3.0, 1.0), ("a", 2.0, 2.0)])
    [('a', 2.0, 2.0), ('b', 2.0, 1.0)]
    """
    by: dict[str, list[tuple[float, float]]] = {}
    for label, secs, bps in rows:
        by.setdefault(label, []).append((secs, bps))
    return [(label, statistics.median(s for s, _ in v), statistics.median(b for _, b in v))
            for label, v in by.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", default="5MB/s", help="per-connection limit R (nginx limit_rate)")
    ap.add_argument("--size", default="64MiB", help="model size")
    ap.add_argument("--piece-size", default="1MiB", help="publisher's piece size")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--cap", choices=("flow", "nginx", "none"), default="flow")
    ap.add_argument("--server", choices=("nginx", "python"), default="nginx",
                    help="python: a threaded http.server sending with small sendall chunks "
                    "(tests/testbed/threaded_origin.py), the team's origin; use with --cap none")
    ap.add_argument("--sendall", type=int, default=8192, help="--server python's chunk")
    ap.add_argument("--quick", action="store_true", help="32MiB, for a smoke run")
    ap.add_argument("--counts", default="1,2,4,8", help="fixed stream counts, comma-separated")
    ap.add_argument("--adaptive", type=int, default=32, metavar="MOST",
                    help="one more row: wagent choosing its count (pulls.adaptive_streams), "
                    "at most MOST (default 32; 0: no such row)")
    ap.add_argument("--link-x", type=float, default=10.0,
                    help="the link as a multiple of R: the best fixed count is about this")
    ap.add_argument("--aria2", default="8:1", metavar="J:X,...",
                    help="aria2c rows: -jJ (files at once) -xX -sX (connections per file; "
                    "X > 1 splits each file into ranges), comma-separated; the adaptive row "
                    "is compared with the best")
    ap.add_argument("--no-aria2", action="store_true", help="skip aria2c and the disk row")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the wagent rows this many times, interleaved; each row's median "
                    "(a noisy origin, such as --server python, needs a few)")
    args = ap.parse_args(argv)

    from agent.units import format_size, parse_rate, parse_size
    from tests import modelgen
    from tests.pull_helpers import publish_dir, pull_in
    from tests.testbed import Testbed

    per_conn = parse_rate(args.rate)                 # bits/s
    size = parse_size("32MiB" if args.quick else args.size)
    rows: list[tuple[str, float, float]] = []
    chosen: list[str] = []                           # the adaptive rows' counts, run by run
    shm = Path(tempfile.mkdtemp(prefix="wagent-bench-scaling-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="wagent-bench-scaling-", dir="/var/tmp"))
    try:
        version = shm / "origin" / "m" / "v1"
        modelgen.generate_sized(version, size, shards=args.shards)
        # Pieces scaled down with the model: 1 MiB pieces of 64 MiB are 64 MiB pieces of 4 GiB.
        publish_dir(version, piece_size=parse_size(args.piece_size))
        files = sorted(p.name for p in version.iterdir() if p.name != "manifest.json")
        total = sum((version / f).stat().st_size for f in files)
        with Testbed() as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=int(per_conn * args.link_x))
            if args.cap == "flow":
                node.sysctl(**{"net.ipv4.ip_local_port_range": "40000 40255"})
                origin.run(["tc", "-batch", "-"], input=per_flow_classes(link.a.ifname, per_conn,
                                                                  link.rate))
            if args.server == "python":
                from tests.testbed.hosts import wait_listening
                py = origin.popen([sys.executable, "-m", "tests.testbed.threaded_origin",
                                   str(shm / "origin"), "8080", str(args.sendall)],
                                  cwd=str(ROOT), log="threaded-origin")
                wait_listening(py, origin.ns, 8080, "the threaded origin")
                url = f"http://{link.a.ip4}:8080/m/v1"
            else:
                srv = tb.nginx(origin, root=shm / "origin", port=8080,
                               limit_rate=per_conn // 8 if args.cap == "nginx" else None)
                url = f"{srv.url_for(link.a)}/m/v1"

            def wagent(streams: int, where: Path, label: str, adaptive: bool = False) -> None:
                store = where / f"store-{streams}-{time.monotonic_ns()}"
                r = pull_in(node, url, store, streams, adaptive=adaptive)
                assert r["fetched"] == r["total"] == total, r
                if adaptive:
                    chosen.append(">".join(map(str, r["streams"])))
                rows.append((label, r["seconds"], total / r["seconds"]))
                shutil.rmtree(store)

            for _ in range(args.rounds):
                for n in (int(x) for x in args.counts.split(",")):
                    wagent(n, shm, f"wagent --streams {n} (tmpfs)")
                if args.adaptive:
                    wagent(args.adaptive, shm, f"wagent adaptive, most {args.adaptive} (tmpfs)",
                           adaptive=True)
            if args.no_aria2:
                rows.append(("aria2c (not run)", 1.0, float("nan")))
            else:
                (shm / "urls.txt").write_text("".join(f"{url}/{f}\n  out={f}\n"
                                                      for f in files))
                for spec in args.aria2.split(","):
                    j, x = (int(v) for v in spec.split(":"))
                    out = shm / "aria2"
                    out.mkdir()
                    t = time.monotonic()
                    # -k1M: aria2c splits a file no finer than this (its default, 20M, would
                    # leave a small model's files in one range whatever -s says)
                    node.run(["aria2c", "-q", f"-j{j}", f"-x{x}", f"-s{x}", "-k1M", "-d",
                              str(out), "-i", str(shm / "urls.txt"), "--allow-overwrite=true",
                              "--auto-file-renaming=false", "--file-allocation=falloc"],
                             timeout=900)
                    took = time.monotonic() - t
                    rows.append((f"aria2c -j{j} -x{x} -s{x} (tmpfs)", took, total / took))
                    shutil.rmtree(out)
                wagent(8, disk, "wagent --streams 8 (disk)")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    runs = len(rows)
    rows = medians(rows)
    one = rows[0][2]
    aria = max(r[2] for r in rows if r[0].startswith("aria2c"))     # the best aria2c row
    server = f"threaded Python, {args.sendall}-byte sendall" if args.server == "python" \
        else "nginx"
    print(f"Scaling: {format_size(total)} in {len(files)} files, {per_conn / 8e6:.1f} MB/s per "
          f"connection ({args.cap}), link {per_conn * args.link_x / 1e6:.0f} Mbit/s, origin "
          f"{server}")
    print(f"{'client':34} {'seconds':>8} {'MB/s':>8} {'x row 1':>10} {'x best aria2c':>14}")
    for label, secs, bps in rows:
        print(f"{label:34} {secs:8.2f} {bps / 1e6:8.2f} {bps / one:10.2f} {bps / aria:14.2f}")
    if chosen:
        print(f"adaptive counts, run by run: {', '.join(chosen)}")
    if args.rounds > 1:
        print(f"(medians of {args.rounds} rounds, {runs} pulls)")
    by = {label: bps for label, _, bps in rows}
    if "wagent --streams 1 (tmpfs)" in by and "wagent --streams 8 (tmpfs)" in by:
        eight = by["wagent --streams 8 (tmpfs)"]
        ok = eight / one >= 7.2 and eight / aria >= 0.95
        print(f"result: 8 streams = {eight / one:.2f}x one stream (target >= 7.2), "
              f"{eight / aria:.2f}x the best aria2c (target >= 0.95): "
              f"{'PASS' if ok else 'MISS'}")
    fixed = [bps for label, _, bps in rows if label.startswith("wagent --streams")
             and label.endswith("(tmpfs)")]
    adaptive = [bps for label, _, bps in rows if label.startswith("wagent adaptive")]
    if adaptive and fixed:
        print(f"adaptive: {adaptive[0] / max(fixed):.2f}x the best fixed count's goodput "
              f"(target >= 0.95), {adaptive[0] / aria:.2f}x the best aria2c (target >= 1.05)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
