"""What the link detector's counters cost each backoff tick, against the qdiscs of the host.

Every tick (100 ms by default) the link detector reads, per shaped interface, the ingress
hook's counters: the ingress qdisc's bytes and its mirred filters' bytes
(``shaping.netlink.Netlink.ingress_counters``, through ``Shaper.counters``). The filter dump is
one link's, but Linux (6.1 as this machine's) answers a qdisc dump with every qdisc of the
namespace whatever link it names; and a stock host has many: Debian 12 gives each multiqueue
NIC an ``mq`` root with one child qdisc per transmit queue (fq_codel there; pfifo_fast on this
kernel), and a GPU node has several NICs of 64 queues or more.

Inside one namespace: wagent's shaping applied to the pulling link (the shipped policy), then
``--nics`` more links of ``--queues`` transmit queues each, every one with an ``mq`` root, as
a stock kernel gives them. For each host shape the script times ``Shaper.counters()`` (thread
CPU, ``--calls`` calls) and prints its cost per tick, and its share of one core at the
default tick, against the peer in the same run: the same namespace before the extra links.

    python tests/bench/link_counters.py [--nics 1,4,8] [--queues 64] [--calls 2000]

Needs root. Everything it makes is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.backoff_helpers import SHIPPED_POLICY  # noqa: E402

DRIVER = r"""
import json, sys, time
from agent.policy import load_policy
from agent.policy.model import Source
from shaping.shaper import Shaper

policy_path, source, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
policy = load_policy(policy_path)
shaper = Shaper(policy.shaping, [Source(source)], policy.state_dir)
shaper.apply(quiet=True)
for line in sys.stdin:                       # one line per host shape to measure
    shaper.counters()                        # warm: link indexes cached, buffers allocated
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        got = shaper.counters()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    print(json.dumps({"cpu_us": 1e6 * cpu / calls, "wall_us": 1e6 * wall / calls,
                      "read": sorted(got)}), flush=True)
shaper.close()
"""

TICK = 0.1


def qdiscs(node) -> int:
    out = node.run(["tc", "qdisc", "show"]).stdout
    return sum(1 for line in out.splitlines() if line.startswith("qdisc "))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nics", default="1,4,8", help="extra multiqueue links, cumulative steps")
    ap.add_argument("--queues", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    from tests.testbed import Testbed

    steps = [int(n) for n in args.nics.split(",") if n]
    shm = Path(tempfile.mkdtemp(prefix="wagent-lctr-", dir="/dev/shm"))
    rows = []
    try:
        with Testbed(tmp_parent=shm) as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node, rate=10**9)
            store, state = tb.tmpdir("store"), tb.tmpdir("state")
            policy = shm / "policy.yaml"
            policy.write_text(SHIPPED_POLICY.format(store=store, ifname=link.b.ifname,
                                                    state=state))
            driver = node.popen([sys.executable, "-c", DRIVER, str(policy),
                                 f"http://{link.a.ip4}:8080", str(args.calls)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=str(REPO))
            assert driver.stdin is not None and driver.stdout is not None

            def measure(nics: int) -> None:
                driver.stdin.write("go\n")
                driver.stdin.flush()
                line = driver.stdout.readline()
                if not line:
                    raise RuntimeError(f"the driver failed:\n{tb.logs()}")
                res = json.loads(line)
                rows.append({"nics": nics, "qdiscs": qdiscs(node), **res})

            measure(0)
            made = 0
            for n in steps:
                while made < n:
                    # Both ends in the node: a multiqueue link with a stock root (mq, one
                    # child per queue), as a kernel gives a multiqueue NIC.
                    a, b = f"mq{made}a", f"mq{made}b"
                    node.run(["ip", "link", "add", a, "numtxqueues", str(args.queues),
                              "numrxqueues", str(args.queues), "type", "veth", "peer", "name",
                              b, "numtxqueues", str(args.queues), "numrxqueues",
                              str(args.queues)])
                    node.run(["ip", "link", "set", a, "up"])
                    node.run(["tc", "qdisc", "replace", "dev", a, "root", "handle", "1:", "mq"])
                    made += 1
                measure(made)
            driver.stdin.close()
            driver.wait(30)
        base = rows[0]["cpu_us"]
        print(f"\nThe link detector's counters (Shaper.counters), {args.calls} calls per row, "
              f"extra links of {args.queues} queues with an mq root:\n")
        print("| extra multiqueue links | qdiscs in the namespace | CPU per tick | wall per tick "
              f"| share of one core at a {1000 * TICK:.0f} ms tick | vs no extra links |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['nics']} | {r['qdiscs']} | {r['cpu_us']:.0f} us | {r['wall_us']:.0f} us "
                  f"| {r['cpu_us'] / 1e6 / TICK:.2%} | {r['cpu_us'] / base:.2f}x |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
