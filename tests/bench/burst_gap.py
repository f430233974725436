"""After a burst: how soon the pull is back at 80% of the link (issue 23, "≤ 50 ms").

``yield.py`` samples the pull every 100 ms: right for a flow's seconds, blind to a burst's gap.
Here a sampler inside the node reads the IFB's received bytes (distribution's traffic only: the
ingress filters steal nothing else to it) about every millisecond, and for each burst the time
from its end (its ack, the sender's clock: CLOCK_MONOTONIC, one clock for every namespace) to
the first moment the pull runs at ``BACK_SHARE`` of the link over the next ``WINDOW`` is taken
("back"), if that comes before the next burst starts. The same measure from instants 50 ms
apart over the two seconds before the bursts says what the pull's own dips cost (a piece
finishing, a file verified, a busy CPU): the floor under any "back" figure.

Pullers, each started afresh (its own store) beside each pattern, shipped defaults:

- ``wagent``: the fast path as shipped (``burst_hold: 5ms``);
- ``ticks alone``: the peer, the same wagent with ``burst_hold: null`` (what a node without
  CAP_BPF or a shaped ingress gets: the 100 ms ticks judge the bursts).

    python tests/bench/burst_gap.py [--pattern 6MB@0.12 --pattern 24MB@0.5] [--bursts 20]
                                    [--queue shallow|deep] [--link 1gbit] [--cc cubic]

Needs root; the model lives in /dev/shm, the stores in /var/tmp; all are deleted at the end.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.backoff_helpers import SHIPPED_POLICY  # noqa: E402

# yield.py's burst patterns ("yield" is a keyword: imported by name)
_yield_bench = importlib.import_module("tests.bench.yield")
Pattern, parse_pattern = _yield_bench.Pattern, _yield_bench.parse_pattern

DIST_PORT, BURST_PORT = 8080, 41001
MODEL, VERSION = "gapmodel", "v1"
BACK_SHARE = 0.8
WINDOW = 0.005                   # "runs at 80%": over the next 5 ms (a few samples' jitter)
SAMPLE_EVERY = 0.001
WARMUP = 5.0
QUEUES = {"shallow": "bfifo", "deep": "pfifo"}
PULLERS = ("wagent", "ticks alone")


# --- the sampler, run inside the node's namespace --------------------------------------------
def sampler(interval: float) -> None:
    """Print ``monotonic rx_bytes`` of the node's IFB devices every ``interval`` until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    files: list[Path] = []
    while True:
        now = time.monotonic()
        if not files:
            files = [p / "statistics" / "rx_bytes" for p in Path("/sys/class/net").iterdir()
                     if p.name.startswith("wg-")]
        total = 0
        for f in files:
            try:
                total += int(f.read_text())
            except OSError:
                files = []
        print(f"{now:.6f} {total}", flush=True)
        time.sleep(max(0.0, interval - (time.monotonic() - now)))


def back_after(t: list[float], b: list[int], end: float, until: float,
               link_bps: float) -> float | None:
    """Seconds from ``end`` to the first sample from which the pull carries ``BACK_SHARE`` of
    the link over ``WINDOW``; None if not before ``until``."""
    j = 0
    for i, ti in enumerate(t):
        if ti < end:
            continue
        if ti + WINDOW > until:
            return None
        j = max(j, i)
        while j < len(t) and t[j] - ti < WINDOW:
            j += 1
        if j >= len(t):
            return None
        if (b[j] - b[i]) * 8 / (t[j] - ti) >= BACK_SHARE * link_bps:
            return ti - end
    return None


@dataclass
class Run:
    backs: list[float | None]
    bursts: list[float]
    alone: list[float | None]             # the same measure from instants before the bursts

    @staticmethod
    def spread(xs: list[float | None]) -> str:
        got = sorted(x for x in xs if x is not None)
        if not got:
            return "never"
        p99 = got[min(len(got) - 1, int(round(0.99 * (len(got) - 1))))]
        return (f"{1000 * statistics.median(got):.1f} / {1000 * p99:.1f} ms ({len(got)} of "
                f"{len(xs)})")

    def cells(self, alone_p50: float) -> str:
        slow = statistics.median(self.bursts[1:]) / alone_p50
        return (f"after a burst {self.spread(self.backs)}; the pull alone, from any instant, "
                f"{self.spread(self.alone)}; bursts p50 {slow:.3f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pattern", type=parse_pattern, action="append", metavar="SIZE@GAP")
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--queue", choices=QUEUES, default="shallow")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--cc", help="the senders' congestion control (default: the machine's)")
    ap.add_argument("--sampler", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sampler:
        sampler(SAMPLE_EVERY)
        return 0
    from agent.units import parse_rate
    from tests.modelgen import generate_sized
    from tests.testbed import WAGENT, Testbed
    from tests.testbed.hosts import stop_process

    link_bps = parse_rate(args.link)
    patterns = args.pattern or [Pattern(6 * 10**6, 0.12), Pattern(24 * 10**6, 0.5)]
    shm = Path(tempfile.mkdtemp(prefix="wagent-gap-", dir="/dev/shm"))
    stores: list[Path] = []
    try:
        vdir = shm / "origin" / MODEL / VERSION
        generate_sized(vdir, 3 * 10**9, shards=12)
        subprocess.run([WAGENT, "manifest", "build", str(vdir)], check=True,
                       capture_output=True)
        with Testbed(tmp_parent=shm) as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=link_bps, leaf=QUEUES[args.queue])
            if args.cc:
                origin.run(["ip", "route", "replace", f"{link.b.ip4}/32", "dev",
                            link.a.ifname, "congctl", args.cc])
            base = tb.nginx(origin, root=shm / "origin", port=DIST_PORT).url_for(link.a)

            def bursts(p: Pattern) -> list:
                return tb.bursts(origin, node, server=link.a.ip4, port=BURST_PORT, size=p.size,
                                 gap=p.gap, count=args.bursts).result()

            alone = {p.label: statistics.median(b.seconds for b in bursts(p)[1:])
                     for p in patterns}
            runs: dict[tuple[str, str], Run] = {}
            for name in PULLERS:
                for p in patterns:
                    print(f"{name}: {p.label}", file=sys.stderr)
                    store = Path(tempfile.mkdtemp(prefix="wagent-gap-store-", dir="/var/tmp"))
                    stores.append(store)
                    state = Path(tempfile.mkdtemp(prefix="state-", dir=shm))
                    text = SHIPPED_POLICY.format(store=store, ifname=link.b.ifname, state=state)
                    text = text.replace("link_rate: 1gbit", f"link_rate: {args.link}")
                    if name == "ticks alone":
                        text = text.replace("backoff:\n", "backoff:\n  burst_hold: null\n")
                    (state / "policy.yaml").write_text(text)
                    puller = node.popen([WAGENT, "pull", f"{base}/{MODEL}/{VERSION}", "--store",
                                         str(store), "--policy", str(state / "policy.yaml"),
                                         "-q"], log=f"gap-{name.split()[0]}")
                    samp = node.popen([sys.executable, str(Path(__file__).resolve()),
                                       "--sampler"], log="gap-sampler")
                    try:
                        time.sleep(WARMUP)
                        if puller.poll() is not None:
                            raise RuntimeError(Path(puller.log_path).read_text()[-2000:])
                        quiet = time.monotonic()
                        got = bursts(p)
                    finally:
                        stop_process(samp)
                        stop_process(puller)
                    t, b = [], []
                    for line in Path(samp.log_path).read_text().splitlines():
                        parts = line.split()
                        if len(parts) == 2:
                            t.append(float(parts[0]))
                            b.append(int(parts[1]))
                    backs = [back_after(t, b, x.started + x.seconds, nxt.started, link_bps)
                             for x, nxt in zip(got, got[1:], strict=False)]
                    # The peer measure: the pull's own dips (a piece finishing, a file
                    # verified, a busy CPU) from instants 50 ms apart over the 2 s before the
                    # bursts, as if a burst had ended there.
                    alone_backs = [back_after(t, b, quiet - 2.0 + k * 0.05,
                                              quiet - 2.0 + k * 0.05 + p.gap, link_bps)
                                   for k in range(40)]
                    runs[(name, p.label)] = Run(backs, [x.seconds for x in got], alone_backs)
        print(f"\nAfter a burst ends, the pull back at {100 * BACK_SHARE:.0f}% of the link "
              f"(over {1000 * WINDOW:g} ms): p50 / p99 over the gaps; {args.link}, "
              f"{args.queue} queue, senders' cc {args.cc or 'default'}, {args.bursts} bursts\n")
        print("| bursts | target | " + " | ".join(PULLERS) + " |")
        print("|---|---|" + "---|" * len(PULLERS))
        for p in patterns:
            print(f"| {p.label} (alone p50 {1000 * alone[p.label]:.0f} ms) | ≤50 ms | "
                  + " | ".join(runs[(n, p.label)].cells(alone[p.label]) for n in PULLERS)
                  + " |")
        return 0
    finally:
        for s in stores:
            shutil.rmtree(s, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
