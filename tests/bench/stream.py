"""Benchmark (issue 24): reading a model through `wagent mount` against pulling then loading it.

An origin (nginx) serves a generated model (tests.modelgen, 291 MiB in 8 shards, 4 MiB pieces
by default); a daemon (``wagent run``, its wave six hours away, so only a mount makes it pull) is
asked to show it by the root CLI, ``wagent mount``. Peers run in the same run, and the table gives
ratios: absolute times on a shared machine are noise.

1. first tensor through the mount, cold store, pull just started: from the start of
   ``wagent mount`` to ``safe_open(shard 1, framework="numpy").get_tensor(first key)``.
   Target: <= 1 s + (bytes of the pieces holding that tensor) / (the link's rate).
2. whole model through the mount (a fresh daemon and store: mount, then every tensor of every
   shard read with safe_open through it) vs ``wagent pull URL --store DIR`` into a fresh store
   then every tensor loaded from the store's version directory. Target: mount / pull <= 1.1.
3. the complete model (the run of row 1, once its pull ended, row 1's mount unmounted after
   3b's passes), mounted anew (``wagent mount``
   of a version complete in the store binds the store's view, hard links to its blobs), the
   page cache dropped before each pass (``echo 3 > /proc/sys/vm/drop_caches``): every file
   read sequentially with 1 MiB read() through that mount vs from the store's version
   directory. Target: mount / store throughput >= 0.9. 3b: the same through row 1's mount,
   made while the version was pulled (the FUSE server reads the blobs), for what a mount made
   early costs once complete. The median of ``--reps`` passes each; the stores are on
   ``--dir`` (/var/tmp: a disk, as a node's store is; on tmpfs dropping caches would change
   nothing).
4. GB/s of both mounts on local reads (as in 3) with 128 KiB and 1 MiB read(), the store's own
   figures beside them (the FUSE mount sets its bdi's read_ahead_kb to 1024; the table says
   what the bdi held).

The link (``--link``):

* ``htb`` (default): the testbed (tests/testbed). nginx runs in an ``origin`` namespace, joined
  to a ``node`` namespace by a veth pair with an HTB bottleneck of ``--rate`` (256mbit = 32 MB/s)
  on the origin's side. The daemon and ``wagent pull`` run in the node; ``wagent mount`` and the
  readers run on this host (the control socket is a path, the FUSE descriptor goes over it).
* ``nginx``: nginx on loopback with ``limit_rate`` ``--limit-rate`` per connection, "the link"
  being streams x that cap (8 x 4m = 32 MiB/s). A weaker stand-in: nginx grants each request one
  second of credit (it limits to R x (elapsed + 1 s)), so each request's first R bytes come at
  loopback speed and the rest waits. The pull's requests are about size / (8 x streams), 4.5 MiB
  here, just over R: the aggregate comes out near the nominal figure (a 305 MB pull took 9.4 s,
  CLI start included, against 9.1 s at 33.6 MB/s) but in bursts, nothing like a link's queue.

Everything is removed at the end, on failure too: binds and the daemon's root mount (lazily,
until none is left), daemons, nginx, the testbed's namespaces, the temporary directories.

    python tests/bench/stream.py [--link htb|nginx] [--rate 256mbit] [--limit-rate 4m]
        [--layers 16] [--hidden 768] [--shards 8] [--piece-size 4MiB] [--streams 8] [--reps 5]
        [--dir /var/tmp] [--quick]

Needs root, /dev/fuse, nginx, safetensors and numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL, VERSION = "m", "v1"
KiB, MiB = 2**10, 2**20


@dataclass
class Link:
    """Where the origin is and how the node side runs things."""

    url: str                          # the sources' base URL, as the node reaches it
    rate: float                       # "the link", bytes/s
    what: str
    spawn: Callable[[Path, Path], subprocess.Popen]     # (policy, log) -> the daemon
    run: Callable[[list[str], float], subprocess.CompletedProcess]   # wagent ARGS, node side


def htb_link(stack: contextlib.ExitStack, origin_root: Path, rate: str) -> Link:
    from agent.units import parse_rate
    from tests.testbed import WAGENT, Testbed

    tb = stack.enter_context(Testbed())
    origin, node = tb.host("origin"), tb.host("node")
    link = tb.connect(origin, node, rate=rate)
    srv = tb.nginx(origin, root=origin_root, port=8080)

    def spawn(policy: Path, log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            return node.popen([WAGENT, "run", "--policy", str(policy)], stdout=out,
                              stderr=subprocess.STDOUT, cwd=str(ROOT))

    def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
        return node.run([WAGENT, *args], timeout=timeout, cwd=str(ROOT), check=False)

    bps = parse_rate(rate) / 8
    return Link(srv.url_for(link.a), bps, f"testbed veth, HTB {rate} ({bps / 1e6:.1f} MB/s)",
                spawn, run)


def nginx_link(stack: contextlib.ExitStack, origin_root: Path, limit_rate: str,
               streams: int) -> Link:
    from tests.daemon_helpers import WAGENT, start_daemon
    from tests.pull_helpers import LoopbackNginx

    nginx = stack.enter_context(LoopbackNginx(origin_root, limit_rate=limit_rate))
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", limit_rate)
    if m is None:
        raise SystemExit(f"--limit-rate {limit_rate!r}: give nginx's form, e.g. 4m")
    cap = int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 2**30}[m.group(2).lower()]

    def spawn(policy: Path, log: Path) -> subprocess.Popen:
        return start_daemon(policy, log=log)

    def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([*WAGENT, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))

    return Link(nginx.url, streams * cap,
                f"loopback nginx, limit_rate {limit_rate} per request x {streams} streams "
                f"({streams * cap / 1e6:.1f} MB/s)", spawn, run)


def lazy_unmount_all(paths: list[str]) -> list[str]:
    """Unmount each path lazily until nothing is mounted there; the paths left mounted."""
    from agent.mount.kernel import MountError, mount_at, unmount
    left = []
    for p in paths:
        for _ in range(20):
            if mount_at(p) is None:
                break
            try:
                unmount(p, lazy=True)
            except MountError as e:
                print(f"cleanup: {e}", file=sys.stderr)
                time.sleep(0.1)
        if mount_at(p) is not None:
            left.append(p)
    return left


class Daemon:
    """A ``wagent run`` with its own store, state and control socket under ``work/name``."""

    def __init__(self, link: Link, work: Path, name: str, streams: int) -> None:
        from tests.daemon_helpers import wait_for_socket, write_policy
        self.dir = work / name
        self.dir.mkdir()
        self.dir.chmod(0o755)
        self.sock = self.dir / "control.sock"
        self.log = self.dir / "daemon.log"
        self.dirs: list[str] = []
        self.proc: subprocess.Popen | None = None
        policy = write_policy(self.dir / "policy.yaml", self.dir, sources=[{"url": link.url}],
                              models=[{"name": MODEL, "version": "latest"}],
                              # Only a mount pulls: with no roles defined, the default role
                              # (training) is wave 0 and ``gap`` moves nothing; cache_lead puts
                              # wave 0 six hours after publication.
                              waves={"gap": "6h", "cache_lead": "6h"},
                              pulls={"streams": streams})
        self.proc = link.spawn(policy, self.log)
        wait_for_socket(self.sock, self.proc, timeout=30)

    @property
    def store(self) -> Path:
        return self.dir / "store"

    def mount(self, name: str) -> str:
        from tests.daemon_helpers import wagent
        d = str(self.dir / name)
        os.mkdir(d)
        self.dirs.append(d)
        r = wagent("mount", MODEL, d, "--socket", str(self.sock), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"wagent mount failed ({r.returncode}): {r.stderr}")
        if r.stderr.strip():
            print(f"wagent mount said: {r.stderr.strip()}", file=sys.stderr)
        return d

    def umount(self, d: str) -> None:
        from tests.daemon_helpers import wagent
        r = wagent("umount", d, "--socket", str(self.sock), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"wagent umount failed ({r.returncode}): {r.stderr}")

    def status(self) -> dict:
        from tests.daemon_helpers import wagent
        return json.loads(wagent("status", "--json", "--socket", str(self.sock)).stdout)

    def wait_complete(self, timeout: float) -> float:
        """Seconds until the mounted version is complete in the store: polled in the store
        (what status's ``complete`` says, without a CLI's second of start-up per look), then
        confirmed by ``wagent status``."""
        from agent.store import Store
        store = Store(self.store)
        t = time.monotonic()
        while store.installed(MODEL, VERSION) is None:
            if time.monotonic() - t > timeout:
                raise RuntimeError(f"the mounted version not complete within {timeout:.0f} s")
            time.sleep(0.05)
        took = time.monotonic() - t
        rows = self.status()["mounts"]["mounts"]
        if not (rows and rows[0]["complete"]):
            raise RuntimeError(f"the store holds {MODEL} {VERSION} but status says {rows}")
        return took

    def read_ahead_kb(self) -> str:
        from agent.commands.mount import mount_root
        from agent.mount.kernel import mount_at
        info = mount_at(mount_root(str(self.sock)))
        if info is None:
            return "?"
        try:
            return Path(f"/sys/class/bdi/{info.major}:{info.minor}/read_ahead_kb").read_text(
                ).strip()
        except OSError:
            return "?"

    def close(self) -> None:
        from agent.commands.mount import mount_root
        from tests.daemon_helpers import stop_daemon, wagent
        root = mount_root(str(self.sock))
        for d in self.dirs:
            try:
                wagent("umount", "--lazy", d, "--socket", str(self.sock))
            except subprocess.TimeoutExpired:
                pass
        left = lazy_unmount_all([*self.dirs, root])
        if self.proc is not None:
            stop_daemon(self.proc)
        left = lazy_unmount_all(left)
        if left:
            print(f"cleanup: still mounted: {left}", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.rmdir(root)              # this daemon's (named after its socket): empty now

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


# -- reading ----------------------------------------------------------------------------------
def load_all(d: Path, shards: list[str]) -> tuple[int, int]:
    """Every tensor of every shard, with safe_open (numpy); (tensors, bytes)."""
    from safetensors import safe_open
    n = size = 0
    for s in shards:
        with safe_open(str(d / s), framework="numpy") as f:
            for key in f.keys():
                size += f.get_tensor(key).nbytes
                n += 1
    return n, size


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_files(d: Path, names: list[str], block: int) -> tuple[int, float]:
    """Every file in turn with read() of ``block`` bytes; (bytes, seconds)."""
    buf = bytearray(block)
    n = 0
    t = time.monotonic()
    for name in names:
        with open(d / name, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n, time.monotonic() - t


def same_bytes(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        with open(a / name, "rb") as fa, open(b / name, "rb") as fb:
            while True:
                x, y = fa.read(4 * MiB), fb.read(4 * MiB)
                if x != y:
                    raise AssertionError(f"{a / name} differs from {b / name}")
                if not x:
                    break


def first_tensor(version: Path, shard: str) -> tuple[str, int]:
    """The first key in ``shard``'s header, and the bytes of the manifest's pieces that hold
    its data."""
    from tests.modelgen import read_header
    header_size, header = read_header(version / shard)
    key = next(iter(header))
    begin, end = (header_size + o for o in header[key]["data_offsets"])
    doc = json.loads((version / "manifest.json").read_text())
    (entry,) = (f for f in doc["files"] if f["path"] == shard)
    held = sum(p["size"] for p in entry["pieces"]
               if p["offset"] < end and p["offset"] + p["size"] > begin)
    return key, held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", choices=("htb", "nginx"), default="htb")
    ap.add_argument("--rate", default="256mbit", help="the HTB link (--link htb)")
    ap.add_argument("--limit-rate", default="4m",
                    help="nginx's per-connection cap (--link nginx)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--piece-size", default="4MiB", help="the publisher's piece size")
    ap.add_argument("--streams", type=int, default=8, help="the daemon's and the pull's")
    ap.add_argument("--reps", type=int, default=5, help="passes per figure of rows 3 and 4")
    ap.add_argument("--dir", default="/var/tmp", help="where the stores go (the origin: /dev/shm)")
    ap.add_argument("--quick", action="store_true", help="4 layers of 512 in 4 shards (34 MiB)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.shards, args.reps = 4, 512, 4, 2

    if os.geteuid() != 0:
        raise SystemExit("stream.py needs root (mounts, namespaces, drop_caches)")
    if not os.path.exists("/dev/fuse"):
        raise SystemExit("stream.py needs /dev/fuse")
    import safetensors  # noqa: F401  (fail early: the readers need it)

    from agent.store import Store
    from agent.units import format_size, parse_size
    from tests.pull_helpers import publish

    piece_size = parse_size(args.piece_size)
    shm = Path(tempfile.mkdtemp(prefix="wagent-bench-stream-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="wagent-bench-stream-", dir=args.dir))
    work.chmod(0o755)
    daemons: list[Daemon] = []
    res: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            origin_root = shm / "origin"
            version = publish(origin_root, MODEL, VERSION, piece_size=piece_size,
                              layers=args.layers, hidden=args.hidden, shards=args.shards)
            names = sorted(p.name for p in version.iterdir() if p.name != "manifest.json")
            shards = [n for n in names if n.endswith(".safetensors")]
            total = sum((version / n).stat().st_size for n in names)
            key, held = first_tensor(version, shards[0])
            if args.link == "htb":
                link = htb_link(stack, origin_root, args.rate)
            else:
                link = nginx_link(stack, origin_root, args.limit_rate, args.streams)

            def daemon(name: str) -> Daemon:
                d = Daemon(link, work, name, args.streams)
                daemons.append(d)
                stack.callback(d.close)      # before the link goes (LIFO)
                return d

            # Row 1, then (once its pull ends) rows 3 and 4 on the same mount.
            a = daemon("a")
            if any(a.store.glob("blobs/*")) or any(a.store.glob("partial/*")):
                raise RuntimeError(f"{a.store} is not cold")
            from safetensors import safe_open
            t0 = time.monotonic()
            mnt = Path(a.mount("mnt"))
            res["mount_cmd"] = time.monotonic() - t0
            with safe_open(str(mnt / shards[0]), framework="numpy") as f:
                res["header"] = time.monotonic() - t0
                f.get_tensor(key)
            res["first"] = time.monotonic() - t0
            t = time.monotonic()
            st = a.status()["mounts"]
            res["status_cmd"] = time.monotonic() - t       # a CLI round trip, for scale
            res["first_status"] = {k: st[k] for k in ("reads", "read_errors", "wanted")}
            res["a_complete"] = time.monotonic() - t0 + a.wait_complete(600)
            store_dir = Store(a.store).version_dir(MODEL, VERSION)
            same_bytes(mnt, version, names)               # the mount shows the origin's bytes
            res["read_ahead_kb"] = a.read_ahead_kb()
            passes: dict[tuple[str, int], list[float]] = {}

            def read_passes(mounted: str, d: Path) -> None:
                """``mounted`` and the store, each block size, interleaved (the disk drifts)."""
                peer = f"store/{mounted}"      # the store's own passes beside these
                order = [(w, b) for b in (MiB, 128 * KiB) for w in (mounted, peer)]
                for rep in range(args.reps):
                    k = rep % len(order)
                    for where, block in order[k:] + order[:k]:
                        drop_caches()
                        n, secs = read_files(d if where == mounted else store_dir, names,
                                             block)
                        assert n == total, (where, block, n, total)
                        passes.setdefault((where, block), []).append(n / secs)

            read_passes("mount", mnt)
            st = a.status()["mounts"]
            res["a_status"] = {k: st[k] for k in ("reads", "read_errors", "wanted", "waiting")}
            res["avg_read"] = st["bytes_read"] / max(1, st["reads"])
            # unmounted, then mounted anew now that it is complete: a bind of the store's view
            a.umount(str(mnt))
            whole = Path(a.mount("whole"))
            same_bytes(whole, version, names)
            res["whole_from"] = [r["from"] for r in a.status()["mounts"]["mounts"]]
            read_passes("whole", whole)
            res["gbps"] = {k: statistics.median(v) / 1e9 for k, v in passes.items()}
            res["gbps_all"] = {k: [round(x / 1e9, 2) for x in v] for k, v in passes.items()}

            # Row 2a: a fresh daemon and store, every tensor through the mount.
            b = daemon("b")
            t0 = time.monotonic()
            mnt_b = Path(b.mount("mnt"))
            tensors, tensor_bytes = load_all(mnt_b, shards)
            res["mount_all"] = time.monotonic() - t0
            st = b.status()["mounts"]
            res["b_status"] = {k: st[k] for k in ("reads", "read_errors", "wanted", "waiting")}
            res["b_complete"] = time.monotonic() - t0 + b.wait_complete(600)
            res["tensors"] = (tensors, tensor_bytes)

            # Row 2b: wagent pull into a fresh store, then every tensor from its version dir.
            store_c = work / "c-store"
            t0 = time.monotonic()
            r = link.run(["pull", f"{link.url}/{MODEL}/{VERSION}", "--store", str(store_c),
                          "--streams", str(args.streams), "--quiet"], 900)
            res["pull_only"] = time.monotonic() - t0
            if r.returncode != 0:
                raise RuntimeError(f"wagent pull failed ({r.returncode}): {r.stderr}")
            got = load_all(Store(store_c).version_dir(MODEL, VERSION), shards)
            res["pull_all"] = time.monotonic() - t0
            assert got == res["tensors"], (got, res["tensors"])
    except BaseException:
        for d in daemons:
            print(f"--- daemon {d.dir.name}'s log, the end:\n{d.log_tail()}", file=sys.stderr)
        raise
    finally:
        from agent.mount.kernel import mounts
        under = [m.mount_point for m in mounts() if m.mount_point.startswith(str(work))]
        if under:       # never rmtree across a mount
            print(f"cleanup: left {work} in place, still mounted: {under}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    g = res["gbps"]
    target1 = 1 + held / link.rate
    ratio2 = res["mount_all"] / res["pull_all"]
    ratio3 = g[("whole", MiB)] / g[("store/whole", MiB)]
    ratio3b = g[("mount", MiB)] / g[("store/mount", MiB)]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    print(f"Stream: {args.layers} layers of {args.hidden} in {len(shards)} shards, "
          f"{format_size(total)} ({res['tensors'][0]} tensors), {format_size(piece_size)} "
          f"pieces, {args.streams} streams; link: {link.what}; stores on {args.dir}")
    print(f"first tensor: {key} of {shards[0]}, held by {format_size(held)} of pieces; "
          f"`wagent mount` itself took {res['mount_cmd']:.2f} s (`wagent status`: "
          f"{res['status_cmd']:.2f} s); the mount's read_ahead_kb: "
          f"{res['read_ahead_kb']}, its FUSE reads: {format_size(int(res['avg_read']))} on average")
    print(f"row 1: mounted at {res['mount_cmd']:.2f} s, header read (safe_open) at "
          f"{res['header']:.2f} s, tensor at {res['first']:.2f} s")
    print()
    print("| # | measure | result | target | |")
    print("|---|---|---|---|---|")
    print(f"| 1 | first tensor through the mount, cold store, pull just started "
          f"| {res['first']:.2f} s | <= {target1:.2f} s (1 s + {format_size(held)} at "
          f"{link.rate / 1e6:.1f} MB/s) | {verdict(res['first'] <= target1)} |")
    engine = res["first"] - res["mount_cmd"]
    print(f"| 1b | the same from the end of `wagent mount` (when an engine's unit starts it, "
          f"after `ExecStartPre=+wagent mount`) | {engine:.2f} s | <= {target1:.2f} s "
          f"| {verdict(engine <= target1)} |")
    print(f"| 2 | whole model through the mount vs pull then load "
          f"| {res['mount_all']:.2f} s / {res['pull_all']:.2f} s = {ratio2:.2f} "
          f"| <= 1.1 | {verdict(ratio2 <= 1.1)} |")
    print(f"| 3 | complete model mounted (`wagent mount` of a version complete in the store: "
          f"{'/'.join(sorted(set(res['whole_from'])))}) vs from the store directly (1 MiB reads, "
          f"cache dropped) | {g[('whole', MiB)]:.2f} / {g[('store/whole', MiB)]:.2f} GB/s = "
          f"{ratio3:.2f} | >= 0.9 | {verdict(ratio3 >= 0.9)} |")
    print(f"| 3b | the same through row 1's mount, made while pulling (FUSE), once complete "
          f"| {g[('mount', MiB)]:.2f} / {g[('store/mount', MiB)]:.2f} GB/s = {ratio3b:.2f} "
          f"| reported | |")
    print(f"| 4 | GB/s of the mounts on local reads, 128 KiB and 1 MiB reads "
          f"| FUSE {g[('mount', 128 * KiB)]:.2f} and {g[('mount', MiB)]:.2f} (store beside "
          f"it: {g[('store/mount', 128 * KiB)]:.2f} and {g[('store/mount', MiB)]:.2f}); the "
          f"view {g[('whole', 128 * KiB)]:.2f} and {g[('whole', MiB)]:.2f} (store: "
          f"{g[('store/whole', 128 * KiB)]:.2f} and {g[('store/whole', MiB)]:.2f}) GB/s "
          f"| reported | |")
    print()
    print(f"details: pull alone {res['pull_only']:.2f} s, then load "
          f"{res['pull_all'] - res['pull_only']:.3f} s; through the mount the version was "
          f"complete {res['b_complete']:.2f} s after the mount (row 1's run: "
          f"{res['a_complete']:.2f} s)")
    print(f"        mounts status: after the first tensor {res['first_status']}; row 2's run "
          f"{res['b_status']}; row 1's run at the end {res['a_status']}")
    print("        GB/s per pass: " + ", ".join(
        f"{w} {b // KiB} KiB {v}" for (w, b), v in sorted(res["gbps_all"].items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
