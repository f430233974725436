"""Yield benchmark: does training traffic keep the link while something pulls weights beside it?

Issue 12's table, in one run, with wagent's SHIPPED DEFAULTS ONLY: the policy names the
interface, the link's rate and ``training_ports: [29500]``, as a user writes it. On the testbed:
an origin serving a generated model with nginx, a 1 Gbit/s bottleneck upstream of the pulling
node (HTB and a 50 ms bfifo on the origin's egress: a switch queue the node's own caps can't
reach), iperf3 servers and a burst sender on the origin, so training data flows origin -> node
like the pull's.

Each scenario runs with three pullers beside it, each started afresh (its own store):

- ``wagent``: ``wagent pull --policy P`` with the shipped defaults;
- ``aria2c -j8``: a peer tool that yields to nothing;
- ``backoff off``: the same wagent pull with ``backoff: {enabled: false}`` (shaping on, no yield).

Scenarios: a sustained 20 s flow (iperf3 -R) on the listed port 29500, then on an unlisted
port; all-reduce-like bursts (24 MB, then 0.5 s idle, acked by the receiver: tests/testbed/
bursts.py) on an unlisted port; the pull alone (the seconds before the training starts); the
pull's goodput while the bursts run, as a share of the idle capacity between them; the time the
pull takes, after a sustained flow ends, to be back at 80% of the link. References are measured
in the same run: the flow alone (before and after the pullers, their mean) and the bursts alone.

A sampler inside the node reads every TCP socket's received bytes through sock_diag every 100 ms,
so the pull's rate is measured apart from what wagent reports about itself; it runs in every
run, references included, so each carries the same measuring load.

    python tests/bench/yield.py               # 20 s flows, 30 bursts, a 4 GB model (~8 min)
    python tests/bench/yield.py --quick       # 8 s flows, 12 bursts, 2.5 GB
    python tests/bench/yield.py --cc cubic    # the senders' congestion control (default: the
                                              # machine's), set on the origin's route

Needs root. The model lives in a tmpfs (/dev/shm), the pulled copies on disk (/var/tmp); all are
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.backoff_helpers import SHIPPED_POLICY  # noqa: E402

LINK = 10**9
DIST_PORT = 8080
LISTED, UNLISTED, BURST_PORT = 29500, 41000, 41001
TRAINING_PORTS = (LISTED, UNLISTED, BURST_PORT)
SAMPLE_EVERY = 0.1
MODEL, VERSION = "yieldmodel", "v1"
BURST_SIZE, BURST_GAP = 24 * 10**6, 0.5
BACK_SHARE = 0.8                 # "back": the pull at 80% of the link, over half a second
PULLERS = ("wagent", "aria2c -j8", "backoff off")



# --- the sampler, run inside the node's namespace --------------------------------------------
def sampler(interval: float) -> None:
    """Print ``monotonic dist_bytes training_bytes`` every ``interval`` until SIGTERM."""
    from agent.yielding.detect.sockdiag import dump_tcp

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    last: dict[tuple, int] = {}
    dist = train = 0
    while True:
        now = time.monotonic()
        seen: dict[tuple, int] = {}
        for s in dump_tcp():
            port = s.remote[1]
            if s.bytes_received is None or (port != DIST_PORT and port not in TRAINING_PORTS):
                continue
            key = (s.local, s.remote, s.inode)
            seen[key] = s.bytes_received
            moved = max(0, s.bytes_received - last.get(key, 0))
            if port == DIST_PORT:
                dist += moved
            else:
                train += moved
        last = seen
        print(f"{now:.4f} {dist} {train}", flush=True)
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

    def _at(self, t: float) -> int:
        for k, tk in enumerate(self.t):
            if tk >= t:
                return k
        return len(self.t) - 1

    def bytes(self, series: list[int], start: float, end: float) -> int:
        return series[self._at(end)] - series[self._at(start)]

    def rate(self, series: list[int], start: float, end: float) -> float:
        """Bits/s of ``series`` between the samples nearest ``start`` and ``end``."""
        i, j = self._at(start), self._at(end)
        if j <= i:
            return 0.0
        return (series[j] - series[i]) * 8 / (self.t[j] - self.t[i])

    def back_after(self, start: float, share: float, within: float) -> float | None:
        """Seconds from ``start`` until the pull runs at ``share`` of the link over 0.5 s."""
        k = start
        while k < start + within:
            if self.rate(self.dist, k, k + 0.5) >= share * LINK:
                return k - start
            k += SAMPLE_EVERY
        return None


# --- results -----------------------------------------------------------------------------------
@dataclass
class Flow:
    mean: float                           # bits/s over the whole flow
    first: float                          # its first second
    after1: float                         # after its first second
    intervals: list[float]                # per second
    pull: float | None = None             # the pull's bits/s while the flow ran (after 1 s)
    back_after: float | None = None       # s from its end until the pull is back (see above)


@dataclass
class Bursts:
    seconds: list[float]                  # each burst, first to ack
    pull_share: float | None = None       # pull's goodput / idle capacity between bursts

    @property
    def first(self) -> float:
        return self.seconds[0]

    @property
    def p50(self) -> float:
        return statistics.median(self.seconds[1:] or self.seconds)

    def p99(self, after_first: bool = True) -> float:
        s = sorted(self.seconds[1:] if after_first and len(self.seconds) > 1 else self.seconds)
        return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


@dataclass
class PullerRun:
    listed: Flow | None = None
    unlisted: Flow | None = None
    bursts: Bursts | None = None
    alone: list[float] = field(default_factory=list)   # pull alone, bits/s, each warm-up
    load: list[str] = field(default_factory=list)      # 1-min load average after each scenario
    notes: list[str] = field(default_factory=list)


# --- the benchmark ----------------------------------------------------------------------------
class Bench:
    def __init__(self, tb: object, shm: Path, files: list[Path], seconds: float, bursts: int,
                 warmup: float, recovery: float) -> None:
        from tests.testbed import WAGENT

        self.tb, self.shm, self.files = tb, shm, files
        self.seconds, self.count = seconds, bursts
        self.warmup, self.recovery = warmup, recovery
        self.wagent = WAGENT
        self.t0_bps = float(LINK)
        self._burst_times: list[tuple[float, float]] = []
        self.origin, self.node = tb.host("origin"), tb.host("node")  # type: ignore[attr-defined]
        self.link = tb.connect(self.origin, self.node, rate=LINK)  # type: ignore[attr-defined]

    def setup(self, cc: str | None) -> None:
        if cc:
            # The senders' congestion control (iperf3's, nginx's, the bursts'): a route
            # attribute on the origin, which a namespace may set for any algorithm the kernel
            # has (its default sysctl is limited to tcp_allowed_congestion_control).
            self.origin.run(["ip", "route", "replace", f"{self.link.b.ip4}/32", "dev",
                             self.link.a.ifname, "congctl", cc])
        srv = self.tb.nginx(self.origin, root=self.shm / "origin", port=DIST_PORT)  # type: ignore
        self.base = srv.url_for(self.link.a)
        for port in (LISTED, UNLISTED):
            self.tb.iperf3_server(self.origin, port=port)  # type: ignore[attr-defined]

    # -- training traffic -----------------------------------------------------------------------
    def flow(self, port: int) -> tuple[Flow, float, float]:
        res = None
        t0 = time.monotonic()
        res = self.tb.iperf3(self.node, server=self.link.a.ip4, port=port,  # type: ignore
                             seconds=self.seconds, reverse=True)
        t1 = time.monotonic()
        iv = [r for _, _, r in res.intervals]
        later = iv[1:] or iv
        return Flow(res.bps, iv[0] if iv else 0.0, sum(later) / len(later), iv), t0, t1

    def bursts(self) -> Bursts:
        # At most as long as 30 bursts take alone (with a puller that doesn't yield, a burst
        # takes seconds: fewer of them fit).
        got = self.tb.bursts(self.origin, self.node, server=self.link.a.ip4,  # type: ignore
                             port=BURST_PORT, size=BURST_SIZE, gap=BURST_GAP,
                             count=self.count, seconds=self.count * (BURST_GAP + 0.25)).result()
        self._burst_times = [(b.started, b.started + b.seconds) for b in got]
        return Bursts([b.seconds for b in got])

    # -- pullers --------------------------------------------------------------------------------
    def start_puller(self, name: str) -> tuple[subprocess.Popen, Path]:
        store = Path(tempfile.mkdtemp(prefix="wagent-yield-store-", dir="/var/tmp"))
        self.policy = None
        if name == "aria2c -j8":
            listing = self.shm / "aria2c.list"
            listing.write_text("".join(f"{self.base}/{MODEL}/{VERSION}/{p.name}\n"
                                       for p in self.files))
            argv = ["aria2c", "-j8", "-q", "--dir", str(store), "--input-file", str(listing),
                    "--file-allocation=none", "--allow-overwrite=true",
                    "--auto-file-renaming=false"]
        else:
            state = Path(tempfile.mkdtemp(prefix="state-", dir=self.shm))
            text = SHIPPED_POLICY.format(store=store, ifname=self.link.b.ifname, state=state)
            if name == "backoff off":
                text = text.replace("backoff:\n", "backoff:\n  enabled: false\n")
            policy = self.policy = state / "policy.yaml"
            policy.write_text(text)
            argv = [self.wagent, "-v", "pull", f"{self.base}/{MODEL}/{VERSION}", "--store",
                    str(store), "--policy", str(policy), "-q"]
        # A puller that yields to nothing may finish the model within a scenario: it starts
        # again on an empty store, so the scenario keeps something pulling beside it (and the
        # log says so: RESTARTED lines).
        loop = (f'while :; do "$@"; echo RESTARTED; rm -rf {store}; mkdir -p {store}; done')
        proc = self.node.popen(["sh", "-c", loop, "puller", *argv],  # type: ignore[attr-defined]
                               log=f"yield-{name.split()[0]}")
        return proc, store

    def scenario(self, name: str, run: PullerRun, what: str) -> None:
        sproc, slog = start_sampler(self.node)
        puller, store = self.start_puller(name)
        try:
            time.sleep(self.warmup)
            if puller.poll() is not None or "RESTARTED" in Path(puller.log_path).read_text(
                    errors="replace"):
                raise RuntimeError(f"{name} ended during the warm-up:\n"
                                   + Path(puller.log_path).read_text(errors="replace")[-3000:])
            t_ready = time.monotonic()
            if what == "bursts":
                b = self.bursts()
                t_end = time.monotonic()
            else:
                f, t0, t_end = self.flow(LISTED if what == "listed" else UNLISTED)
            time.sleep(self.recovery)
        finally:
            stop(puller)
            stop(sproc)
            shutil.rmtree(store, ignore_errors=True)
            if self.policy is not None:
                # A pull killed before it could clear its caps must not cap the next puller.
                self.node.run([self.wagent, "shaping", "clear", "--policy",  # type: ignore
                               str(self.policy)], check=False)
        restarts = Path(puller.log_path).read_text(errors="replace").count("RESTARTED")
        if restarts:
            run.notes.append(f"{what}: {name} finished the model and started again "
                             f"{restarts}x")
        s = Samples.read(slog)
        run.alone.append(s.rate(s.dist, t_ready - 3.0, t_ready - 0.1))
        run.load.append(Path("/proc/loadavg").read_text().split()[0])
        if what == "bursts":
            starts = self._burst_times
            idle = sum(b0 - a1 for (_, a1), (b0, _) in zip(starts[:-1], starts[1:],
                                                           strict=True))
            pulled = s.bytes(s.dist, starts[0][0], starts[-1][1]) * 8
            b.pull_share = pulled / (self.t0_bps * idle) if idle > 0 else None
            run.bursts = b
        else:
            f.pull = s.rate(s.dist, t0 + 1.0, t_end - 0.2)
            f.back_after = s.back_after(t_end, BACK_SHARE, self.recovery - 0.5)
            if what == "listed":
                run.listed = f
            else:
                run.unlisted = f

    def reference(self) -> tuple[Flow, float]:
        sproc, _ = start_sampler(self.node)
        try:
            f, _, _ = self.flow(UNLISTED)
        finally:
            stop(sproc)
        return f, float(Path("/proc/loadavg").read_text().split()[0])

    def bursts_alone(self) -> Bursts:
        sproc, _ = start_sampler(self.node)
        try:
            return self.bursts()
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


# --- the table ---------------------------------------------------------------------------------
@dataclass
class Results:
    seconds: float
    count: int
    cc: str
    t0: Flow
    t0_runs: tuple[float, float]
    b0: Bursts
    runs: dict[str, PullerRun]

    def flow_cells(self, f: Flow | None) -> str:
        if f is None:
            return "-"
        return (f"{100 * f.mean / self.t0.mean:.1f}% / {100 * f.after1 / self.t0.after1:.1f}% / "
                f"{100 * f.first / self.t0.first:.1f}%")

    def burst_cells(self, b: Bursts | None) -> str:
        if b is None:
            return "-"
        ref = self.b0.p50
        return (f"{b.first / ref:.2f}x / {b.p50 / ref:.3f}x / {b.p99() / ref:.3f}x "
                f"(all: {b.p99(after_first=False) / ref:.2f}x)")

    def rows(self) -> list[tuple[str, str, list[str]]]:
        r = [self.runs[p] for p in PULLERS]

        def back(run: PullerRun) -> str:
            vals = [f.back_after for f in (run.listed, run.unlisted) if f is not None]
            if any(v is None for v in vals):
                return f"not within {self.recovery_s:g} s"
            return " / ".join(f"{v:.1f} s" for v in vals)

        return [
            (f"sustained flow, listed port 29500, {self.seconds:g} s: over the run / after "
             "1 s / first second, vs alone", "≥98% / ≥99.5% / ≥90%",
             [self.flow_cells(x.listed) for x in r]),
            (f"sustained flow, unlisted port {UNLISTED}, {self.seconds:g} s: same",
             "≥98% / ≥99.5% / ≥90%", [self.flow_cells(x.unlisted) for x in r]),
            (f"bursts of {BURST_SIZE / 1e6:.0f} MB every {BURST_GAP:g} s, unlisted port, "
             f"{self.count} bursts: first / p50 / p99 after the first, vs alone's p50",
             "≤1.5x / ≤1.02x / ≤1.05x", [self.burst_cells(x.bursts) for x in r]),
            ("pull alone, share of the link (mean of the warm-ups)", "≥90%",
             [f"{100 * statistics.mean(x.alone) / LINK:.1f}%" if x.alone else "-"
              for x in r]),
            ("pull while the bursts run: goodput / idle capacity between bursts",
             "moonshot ≥50%",
             [f"{100 * x.bursts.pull_share:.1f}%" if x.bursts and x.bursts.pull_share
              is not None else "-" for x in r]),
            (f"after training stops: back to {100 * BACK_SHARE:.0f}% of the link (listed / "
             "unlisted run)", "≤5 s", [back(x) for x in r]),
        ]

    recovery_s: float = 0.0

    def print(self) -> None:
        from agent.units import format_rate

        print(f"\nYield on a 1 Gbit/s bottleneck upstream of the node, senders' congestion "
              f"control: {self.cc}; wagent with the shipped defaults\n")
        print("| scenario | target | wagent | aria2c -j8 beside | wagent, backoff off |")
        print("|---|---|---|---|---|")
        for name, target, cells in self.rows():
            print(f"| {name} | {target} | " + " | ".join(cells) + " |")
        print(f"\nalone: flow {format_rate(self.t0.mean)} (runs before and after: "
              f"{format_rate(self.t0_runs[0])}, {format_rate(self.t0_runs[1])}), first second "
              f"{format_rate(self.t0.first)}; bursts first {1000 * self.b0.first:.0f} ms, p50 "
              f"{1000 * self.b0.p50:.0f} ms, p99 {1000 * self.b0.p99(False):.0f} ms")
        for p in PULLERS:
            run = self.runs[p]
            pulls = ", ".join(format_rate(f.pull) for f in (run.listed, run.unlisted)
                              if f is not None and f.pull is not None)
            print(f"{p}: pull during the sustained flows {pulls}; load average after each "
                  f"scenario {', '.join(run.load)}")
            for f, what in ((run.listed, "listed"), (run.unlisted, "unlisted")):
                if f is not None:
                    print(f"  {what} flow per second (Mbit/s): "
                          + " ".join(f"{r / 1e6:.0f}" for r in f.intervals))
            if run.bursts is not None:
                print("  bursts (ms): " + " ".join(f"{1000 * s:.0f}" for s in run.bursts.seconds))
            for n in run.notes:
                print(f"  note: {n}")
        print("  T0 per second (Mbit/s): " + " ".join(f"{r / 1e6:.0f}" for r in self.t0.intervals))
        print("  bursts alone (ms): " + " ".join(f"{1000 * s:.0f}" for s in self.b0.seconds))

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "bursts": self.count, "cc": self.cc,
                "t0": asdict(self.t0), "t0_runs": self.t0_runs, "bursts_alone": asdict(self.b0),
                "runs": {p: asdict(r) for p, r in self.runs.items()},
                "table": [{"scenario": n, "target": t, "cells": dict(zip(PULLERS, c,
                                                                           strict=True))}
                          for n, t, c in self.rows()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 s flows, 12 bursts, 2.5 GB")
    ap.add_argument("--seconds", type=float, help="sustained flow length (default 20)")
    ap.add_argument("--bursts", type=int, help="bursts per run (default 30)")
    ap.add_argument("--model-size", help="e.g. 4GB (default 4GB, quick 2.5GB)")
    ap.add_argument("--cc", help="the senders' TCP congestion control (default: the machine's)")
    ap.add_argument("--only", choices=PULLERS, action="append",
                    help="run only these pullers (repeatable)")
    ap.add_argument("--sampler", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.sampler:
        sampler(SAMPLE_EVERY)
        return 0
    from agent.units import parse_size

    seconds = args.seconds or (8.0 if args.quick else 20.0)
    count = args.bursts or (12 if args.quick else 30)
    size = parse_size(args.model_size or ("2.5GB" if args.quick else "4GB"))
    return run(seconds, count, size, args.cc, args.only or list(PULLERS), args.json)


def run(seconds: float, count: int, size: int, cc: str | None, pullers: list[str],
        json_out: str | None) -> int:
    from tests.modelgen import generate_sized
    from tests.testbed import WAGENT, Testbed

    shm = Path(tempfile.mkdtemp(prefix="wagent-yield-", dir="/dev/shm"))
    try:
        vdir = shm / "origin" / MODEL / VERSION
        t = time.monotonic()
        generate_sized(vdir, size, shards=16)
        subprocess.run([WAGENT, "manifest", "build", str(vdir)], check=True,
                       capture_output=True)
        (vdir.parent / "latest").write_text(VERSION + "\n")
        files = sorted(p for p in vdir.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        print(f"model: {len(files)} files, {total / 1e9:.2f} GB, generated in "
              f"{time.monotonic() - t:.0f}s", file=sys.stderr)
        with Testbed(tmp_parent=shm) as tb:
            bench = Bench(tb, shm, files, seconds, count, warmup=6.0, recovery=7.0)
            bench.setup(cc)
            cc_name = cc or bench.origin.run(["sysctl", "-n",
                                              "net.ipv4.tcp_congestion_control"]).stdout.strip()
            first, _ = bench.reference()
            bench.t0_bps = first.mean
            b0 = bench.bursts_alone()
            runs: dict[str, PullerRun] = {}
            for name in PULLERS:
                runs[name] = PullerRun()
                if name not in pullers:
                    continue
                for what in ("listed", "unlisted", "bursts"):
                    print(f"{name}: {what}", file=sys.stderr)
                    bench.scenario(name, runs[name], what)
            last, _ = bench.reference()
            t0 = Flow((first.mean + last.mean) / 2, (first.first + last.first) / 2,
                      (first.after1 + last.after1) / 2, first.intervals + last.intervals)
        res = Results(seconds, count, cc_name, t0, (first.mean, last.mean), b0, runs)
        res.recovery_s = bench.recovery - 0.5
        res.print()
        if json_out:
            Path(json_out).write_text(json.dumps(res.as_dict(), indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
