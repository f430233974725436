"""Yield benchmark: does a training flow keep the link while wagent pulls beside it?

On the testbed: an origin serving a generated model with nginx, a 1 Gbit/s bottleneck into the
pulling node (HTB on the origin's egress), an iperf3 server on the origin's port 29500; the
training flow is an iperf3 client on the node with -R, so its data flows origin -> node like the
pull's. Three runs of the same flow:

- T0: the training flow alone (run first and last; their mean is the reference);
- aria2c: the flow while ``aria2c -j8`` pulls the model (no shaping, no backoff);
- wagent: the flow started in the middle of ``wagent pull --policy P`` with backoff on (tick
  100 ms) and the node's ingress shaping (IFB) on.

A sampler inside the node reads every TCP socket's bytes through sock_diag every 100 ms, so the
distribution rate (sockets to port 8080) and the training rate (port 29500) are measured apart,
independently of what wagent reports about itself; it runs in every run, T0 included, so each
carries the same measuring load. Targets (issue 6): the flow keeps >= 95% of
T0 over its whole run and >= 98% after its first 2 s; the distribution rate is at the floor within
1 s of the flow's start; without training the pull uses >= 90% of the link; after training stops
the pull is back to 90% of the link within 10 s.

    python tests/bench/yield.py            # 20 s flows, a 3.2 GB model in /dev/shm
    python tests/bench/yield.py --quick    # 8 s flows, 2.5 GB

Needs root. The model lives in a tmpfs (/dev/shm), the pulled copies on disk (/var/tmp); all are
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LINK = 10**9
DIST_PORT = 8080
TRAIN_PORT = 29500
FLOOR = 10**7
SAMPLE_EVERY = 0.1
MODEL = "yieldmodel"
VERSION = "v1"


# --- the sampler, run inside the node's namespace --------------------------------------------
def sampler(interval: float) -> None:
    """Print ``monotonic dist_bytes train_bytes`` every ``interval`` until SIGTERM."""
    from shaping.detect.sockdiag import dump_tcp

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    last: dict[tuple, int] = {}
    totals = {DIST_PORT: 0, TRAIN_PORT: 0}
    while True:
        now = time.monotonic()
        seen: dict[tuple, int] = {}
        for s in dump_tcp():
            port = s.remote[1]
            if port not in totals or s.bytes_received is None:
                continue
            key = (s.local, s.remote, s.inode)
            seen[key] = s.bytes_received
            totals[port] += max(0, s.bytes_received - last.get(key, 0))
        last = seen
        print(f"{now:.4f} {totals[DIST_PORT]} {totals[TRAIN_PORT]}", flush=True)
        time.sleep(max(0.0, interval - (time.monotonic() - now)))


@dataclass
class Samples:
    t: list[float]
    dist: list[int]
    train: list[int]

    @classmethod
    def read(cls, path: Path) -> Samples:
        t, d, r = [], [], []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                t.append(float(parts[0]))
                d.append(int(parts[1]))
                r.append(int(parts[2]))
        return cls(t, d, r)

    def rate(self, series: list[int], start: float, end: float) -> float:
        """Bits/s of ``series`` between the samples nearest ``start`` and ``end``."""
        i, j = self._at(start), self._at(end)
        if j <= i:
            return 0.0
        return (series[j] - series[i]) * 8 / (self.t[j] - self.t[i])

    def _at(self, t: float) -> int:
        for k, tk in enumerate(self.t):
            if tk >= t:
                return k
        return len(self.t) - 1

    def first(self, series: list[int], after: float, min_bytes: int) -> float | None:
        base = series[self._at(after)]
        for tk, v in zip(self.t, series, strict=True):
            if tk >= after and v - base >= min_bytes:
                return tk
        return None


# --- the benchmark --------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 s flows and a 2.5 GB model")
    ap.add_argument("--seconds", type=float, help="training flow length (default 20, quick 8)")
    ap.add_argument("--model-size", help="e.g. 3.2GB (default 3.2GB, quick 2GB)")
    ap.add_argument("--sampler", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.sampler:
        sampler(SAMPLE_EVERY)
        return 0
    from agent.units import parse_size

    seconds = args.seconds or (8.0 if args.quick else 20.0)
    size = parse_size(args.model_size or ("2.5GB" if args.quick else "3.2GB"))
    return run(seconds, size, args.json)


def run(seconds: float, size: int, json_out: str | None) -> int:
    from tests.modelgen import generate_sized
    from tests.testbed import WAGENT, Testbed

    shm = Path(tempfile.mkdtemp(prefix="wagent-yield-", dir="/dev/shm"))
    try:
        origin_root = shm / "origin"
        vdir = origin_root / MODEL / VERSION
        t = time.monotonic()
        generate_sized(vdir, size, shards=16)
        subprocess.run([WAGENT, "manifest", "build", str(vdir)], check=True,
                       capture_output=True)
        (origin_root / MODEL / "latest").write_text(VERSION + "\n")
        files = sorted(p for p in vdir.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        print(f"model: {len(files)} files, {total / 1e9:.2f} GB, generated in "
              f"{time.monotonic() - t:.0f}s", file=sys.stderr)
        with Testbed(tmp_parent=shm) as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=LINK)
            srv = tb.nginx(origin, root=origin_root, port=DIST_PORT)
            base = srv.url_for(link.a)
            tb.iperf3_server(origin, port=TRAIN_PORT)
            res = Results(seconds)
            # aria2c first; then T0 right before and right after the wagent run, whose mean is
            # the reference: on a shared machine the link's goodput drifts with the CPU load.
            res.aria2 = with_aria2c(tb, node, link, base, files, seconds, shm)
            first = training_reference(tb, node, link, seconds)
            res.wagent = with_wagent(tb, node, link, base, seconds, shm, WAGENT,
                                     warmup=6.0 if seconds < 20 else 9.0)
            last = training_reference(tb, node, link, seconds)
            res.t0 = Flow((first.mean + last.mean) / 2, (first.after2 + last.after2) / 2,
                          first.intervals + last.intervals, load=f"{first.load}, {last.load}")
            res.t0_runs = (first.mean, last.mean)
        res.print()
        if json_out:
            Path(json_out).write_text(json.dumps(res.as_dict(), indent=2) + "\n")
        return 0 if res.ok() else 1
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@dataclass
class Flow:
    mean: float                          # bits/s over the whole flow
    after2: float                        # bits/s after its first 2 s
    intervals: list[tuple[float, float, float]]
    dist: float | None = None            # distribution bits/s while the flow ran
    load: str = ""                       # /proc/loadavg's 1-minute figure after the run


def flow_of(res: object) -> Flow:
    iv = res.intervals  # type: ignore[attr-defined]
    late = [(a, b, r) for a, b, r in iv if a >= 2.0 - 1e-6]
    after2 = sum((b - a) * r for a, b, r in late) / max(1e-9, sum(b - a for a, b, _ in late))
    return Flow(res.bps, after2, iv)  # type: ignore[attr-defined]


def training_alone(tb: object, node: object, link: object, seconds: float) -> Flow:
    flow = flow_of(tb.iperf3(node, server=link.a.ip4, port=TRAIN_PORT,  # type: ignore
                             seconds=seconds, reverse=True))
    flow.load = Path("/proc/loadavg").read_text().split()[0]
    return flow


def training_reference(tb: object, node: object, link: object, seconds: float) -> Flow:
    """T0: the flow alone, with the sampler running as in the other runs (same CPU load)."""
    sproc, _ = start_sampler(node)
    try:
        return training_alone(tb, node, link, seconds)
    finally:
        stop(sproc)


def start_sampler(node: object) -> tuple[subprocess.Popen, Path]:
    proc = node.popen([sys.executable, str(Path(__file__).resolve()), "--sampler"],  # type: ignore
                      log="yield-sampler")
    return proc, Path(proc.log_path)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def with_aria2c(tb: object, node: object, link: object, base: str, files: list[Path],
                seconds: float, shm: Path) -> Flow:
    out = Path(tempfile.mkdtemp(prefix="wagent-yield-aria2c-", dir="/var/tmp"))  # like the store
    listing = shm / "aria2c.list"
    listing.write_text("".join(f"{base}/{MODEL}/{VERSION}/{p.name}\n" for p in files))
    sproc, slog = start_sampler(node)
    aria = node.popen(["aria2c", "-j8", "-q", "--dir", str(out), "--input-file",  # type: ignore
                       str(listing), "--file-allocation=none", "--allow-overwrite=true",
                       "--auto-file-renaming=false"], log="yield-aria2c")
    try:
        time.sleep(3.0)
        t_start = time.monotonic()
        flow = training_alone(tb, node, link, seconds)
        t_end = time.monotonic()
    finally:
        stop(aria)
        stop(sproc)
        shutil.rmtree(out, ignore_errors=True)
    s = Samples.read(slog)
    flow.dist = s.rate(s.dist, t_start + 1.0, t_end - 0.5)
    return flow


@dataclass
class WagentRun:
    flow: Flow
    alone: float                          # pull rate with no training, bits/s
    floor_after: float | None             # s from the flow's start to the distribution at floor
    first_data: float | None              # s from iperf3's start to its first 64 KiB received
    back_after: float | None              # s from the flow's end to the pull at 90% of the link
    dist_during: float                    # distribution bits/s while the flow ran (after 1 s)
    log: str = ""                         # wagent pull's output


POLICY = """\
version: 1
sources:
  - url: {base}
models:
  - name: {model}
store:
  path: {store}
pulls:
  streams: 8
shaping:
  enabled: true
  interfaces: [{ifname}]
  link_rate: 1gbit
  pull_ports: [{port}]
  rate: 10mbit
  ceil: 1gbit
backoff:
  enabled: true
  tick: 100ms
  floor: 10mbit
  cap: 1gbit
  increase: 250mbit
  quiet: 2s
  link_threshold: 100mbit
  training_ports: [{train}]
  nccl_processes: false
state_dir: {state}
"""


def with_wagent(tb: object, node: object, link: object, base: str, seconds: float, shm: Path,
                wagent: str, warmup: float) -> WagentRun:
    # The store is on disk: it keeps this machine's shared RAM free, and 125 MB/s of writes is
    # within a disk's reach (the pull alone is checked against 90% of the link all the same).
    store = Path(tempfile.mkdtemp(prefix="wagent-yield-store-", dir="/var/tmp"))
    state = shm / "state"
    state.mkdir()
    policy = shm / "yield-policy.yaml"
    policy.write_text(POLICY.format(base=base, model=MODEL, store=store, ifname=link.b.ifname,
                                    port=DIST_PORT, train=TRAIN_PORT, state=state))
    sproc, slog = start_sampler(node)
    pull_args = [f"{base}/{MODEL}/{VERSION}", "--store", str(store), "--policy", str(policy),
                 "-q"]
    argv = [wagent, "-v", "pull", *pull_args]
    pull = node.popen(argv, log="yield-wagent-pull")
    early = None
    try:
        time.sleep(warmup)
        if pull.poll() is not None:
            raise RuntimeError(f"wagent pull exited {pull.returncode}:\n"
                               + Path(pull.log_path).read_text(errors="replace")[-3000:])
        t_start = time.monotonic()
        flow = training_alone(tb, node, link, seconds)
        t_end = time.monotonic()
        time.sleep(12.0)
        early = pull.poll()
    finally:
        stop(pull)
        stop(sproc)
        pull_log = Path(pull.log_path).read_text(errors="replace")
        shutil.rmtree(store, ignore_errors=True)
    if early is not None:
        print(f"warning: wagent pull ended before the run did (exit {early}; a model too small "
              "for the run?); its last lines:\n  " + "\n  ".join(pull_log.splitlines()[-25:]),
              file=sys.stderr)
    s = Samples.read(slog)
    # The pull alone, in its steady state: the last seconds before the training flow.
    alone = s.rate(s.dist, t_start - (warmup - 3.0), t_start - 0.2)
    data_start = s.first(s.train, t_start, 64 * 1024)
    floor_after = None
    step = 0.25
    k = t_start
    while k < t_start + 5.0:
        if s.rate(s.dist, k, k + step) <= 1.5 * FLOOR:
            floor_after = k - t_start
            break
        k += SAMPLE_EVERY
    back_after = None
    k = t_end
    while k < t_end + 12.0:
        if s.rate(s.dist, k, k + 1.0) >= 0.9 * LINK:
            back_after = k - t_end
            break
        k += SAMPLE_EVERY
    flow.dist = s.rate(s.dist, t_start + 1.0, t_end - 0.5)
    first_data = None if data_start is None else data_start - t_start
    return WagentRun(flow, alone, floor_after, first_data, back_after, flow.dist, pull_log)


@dataclass
class Results:
    seconds: float
    t0: Flow | None = None
    t0_runs: tuple[float, float] = (0.0, 0.0)
    aria2: Flow | None = None
    wagent: WagentRun | None = None

    def ok(self) -> bool:
        return all(v for _, v in self.checks())

    def checks(self) -> list[tuple[str, bool]]:
        assert self.t0 and self.wagent
        w = self.wagent
        return [
            ("training flow >= 95% of T0 over its run", w.flow.mean >= 0.95 * self.t0.mean),
            ("training flow >= 98% of T0 after its first 2 s",
             w.flow.after2 >= 0.98 * self.t0.after2),
            ("distribution at the floor within 1 s", w.floor_after is not None
             and w.floor_after <= 1.0),
            ("pull alone >= 90% of the link", w.alone >= 0.9 * LINK),
            ("pull back to 90% of the link within 10 s", w.back_after is not None
             and w.back_after <= 10.0),
        ]

    def print(self) -> None:
        from agent.units import format_rate

        assert self.t0 and self.aria2 and self.wagent
        t0, a, w = self.t0, self.aria2, self.wagent
        print(f"\nYield on a 1 Gbit/s bottleneck, training flow {self.seconds:g} s "
              "(iperf3 -R, port 29500)\n")
        print("| run | training flow | vs T0 | after 2 s vs T0 | distribution meanwhile | "
              "load avg |")
        print("|---|---|---|---|---|---|")
        print(f"| T0: training alone (mean of a run right before wagent's, "
              f"{format_rate(self.t0_runs[0])}, and one right after, "
              f"{format_rate(self.t0_runs[1])}) | {format_rate(t0.mean)} | 100% | 100% | - | "
              f"{t0.load} |")
        for name, f in (("aria2c -j8 beside it", a), ("wagent pull, backoff on", w.flow)):
            print(f"| {name} | {format_rate(f.mean)} | {100 * f.mean / t0.mean:.1f}% | "
                  f"{100 * f.after2 / t0.after2:.1f}% | {format_rate(f.dist or 0)} | {f.load} |")
        fa = "never" if w.floor_after is None else f"{w.floor_after:.2f} s"
        ba = "not within 12 s" if w.back_after is None else f"{w.back_after:.1f} s"
        print(f"\nwagent pull alone: {format_rate(w.alone)} ({100 * w.alone / LINK:.0f}% of the "
              "link)")
        fd = "?" if w.first_data is None else f"{w.first_data:.2f} s"
        print(f"distribution at the floor (<= 15 Mbit/s over 250 ms) {fa} after iperf3 started "
              f"(its first 64 KiB arrived at {fd})")
        print(f"pull back at 90% of the link {ba} after the flow ended\n")
        for name, f in (("T0", t0), ("aria2c", a), ("wagent", w.flow)):
            print(f"{name:>7} per second (Mbit/s): "
                  + " ".join(f"{r / 1e6:.0f}" for _, _, r in f.intervals))
        print()
        for name, ok in self.checks():
            print(f"  [{'ok' if ok else 'FAIL'}] {name}")

    def as_dict(self) -> dict:
        assert self.t0 and self.aria2 and self.wagent
        return {
            "seconds": self.seconds,
            "t0_bps": self.t0.mean, "t0_after2_bps": self.t0.after2,
            "aria2c_bps": self.aria2.mean, "aria2c_after2_bps": self.aria2.after2,
            "aria2c_dist_bps": self.aria2.dist,
            "wagent_bps": self.wagent.flow.mean, "wagent_after2_bps": self.wagent.flow.after2,
            "wagent_dist_bps": self.wagent.dist_during, "pull_alone_bps": self.wagent.alone,
            "floor_after_s": self.wagent.floor_after, "back_after_s": self.wagent.back_after,
            "checks": dict(self.checks()),
        }


if __name__ == "__main__":
    sys.exit(main())
