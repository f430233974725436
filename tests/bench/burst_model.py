"""The burst model across link rates: the shipped yield against faster ones (issue 23).

    .venv/bin/python tests/bench/burst_model.py [--rtt 0.05ms] [--count 12]

For each burst pattern and link rate, the bursts' slowdown (p99 after the first, and the first)
and the idle capacity the pull used, from ``agent.yielding.burst_model`` (one bottleneck, the
shipped controller), for:

- ``shipped``: the fast path as shipped (the kernel's leaky bucket, 64 KiB deep, drained at
  5% of the link; the readers held until 5 ms after a burst; the windows' burst bound), which
  is also what ``wagent plan --bursts`` prints;
- ``ticks alone``: the slow path only (100 ms tick, 5% threshold, 3 s quiet), what a node
  without the fast path gets (``burst_hold: null``, no CAP_BPF, no shaped ingress);
- ``bins 1 ms`` and ``bins 0.1 ms``: issue 23's sketch of a fast path that cuts the windows and
  the bucket to their floor when training bytes show up within a bin, and restores them in one
  step after a hold of five bins (a userspace loop reaches 1 ms at best: its wake-ups are late
  by 2.4 ms p99 alone, 22 ms with a busy GIL);
- ``per packet``: the same at 10 us (a kernel program on every ACK, as the BPF spike did).

No peer runs here: the model's peers are the measurements it was checked against
(tests/unit/test_burst_model.py: the yield bench at 1 Gbit/s, and issue 23's own fluid model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent import units
from agent.policy.model import Backoff
from agent.yielding.burst_model import Bursts, FastPath, Link, simulate

PATTERNS = ((6 * 10**6, 0.12), (24 * 10**6, 0.5), (48 * 10**6, 1.2))
RATES = (10**9, 10**10, 10**11, 4 * 10**11)
TICKS = Backoff(burst_hold=None)
DESIGNS = (("shipped", None, Backoff()), ("ticks alone", None, TICKS),
           ("bins 1 ms", FastPath(0.001, 0.005), TICKS),
           ("bins 0.1 ms", FastPath(0.0001, 0.0005), TICKS),
           ("per packet", FastPath(1e-5, 5e-5), TICKS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt", default="0.05ms", help="the pull path's base RTT (default 0.05ms)")
    ap.add_argument("--count", type=int, default=12, help="bursts per run (default 12)")
    args = ap.parse_args()
    rtt = units.parse_duration(args.rtt)
    print(f"Bursts beside a pull, shipped parameters, base RTT {rtt * 1e6:g} us: p99 slowdown "
          "(first) / idle capacity used\n")
    print("| bursts | link | " + " | ".join(name for name, _, _ in DESIGNS) + " |")
    print("|---|---|" + "---|" * len(DESIGNS))
    for size, every in PATTERNS:
        for rate in RATES:
            cells = []
            for _, fast, backoff in DESIGNS:
                o = simulate(Link(rate, rtt), Bursts(size, every, args.count), backoff,
                             fast=fast)
                cells.append(f"{o.p99:.3f}x ({o.first:.2f}x) / {100 * o.idle_used:.0f}%")
            print(f"| {size // 10**6} MB every {every * 1e3:g} ms | "
                  f"{units.format_rate(rate)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
