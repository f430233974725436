"""How long the backoff controller's ceil change takes: wagent's set_ceil against its peers.

Peers, run on the same class in the same namespace: pyroute2's own ``IPRoute.tc('change-class')``
and the ``tc class change`` command. Each alternates between two ceilings, N times; the table
shows median and p99 per change and the ratio to ``tc``. Absolute times are noise on a shared
machine; the ratios are the figure.

    .venv/bin/python tests/bench/shaping_rate_change.py [--changes 200] [--load]

``--load`` keeps a flow through the class while measuring (curl from nginx over the veth).
Needs root (it builds a testbed namespace).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.shaping_helpers import wagent, write_policy
from tests.testbed import Testbed

MEASURE = r"""
import json, statistics, subprocess, sys, time
from agent.policy import load_policy
from shaping.shaper import Shaper
from shaping.plan import DIST_CLASS, ROOT_CLASS, burst_for, quantum_for
from pyroute2 import IPRoute

policy, dev, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = load_policy(policy)
ceils = (50_000_000, 400_000_000)
out = {}

def timed(fn):
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(ceils[i % 2])
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {"median": statistics.median(times), "p99": times[min(n - 1, int(n * 0.99))]}

shaper = Shaper(p.shaping, p.sources, p.state_dir)
shaper.set_ceil(ceils[0])                        # opens the socket, resolves the index
out["wagent set_ceil"] = timed(shaper.set_ceil)

ipr = IPRoute()
index = ipr.link_lookup(ifname=dev)[0]
rate = p.shaping.rate
def lib(ceil):
    ipr.tc("change-class", "htb", index, DIST_CLASS, parent=ROOT_CLASS, rate=f"{rate}bit",
           ceil=f"{ceil}bit", burst=burst_for(rate), cburst=burst_for(ceil),
           quantum=quantum_for(rate), prio=p.shaping.priority)
out["pyroute2 IPRoute.tc"] = timed(lib)

def tc(ceil):
    subprocess.run(["tc", "class", "change", "dev", dev, "parent", "5747:1", "classid",
                    "5747:20", "htb", "rate", f"{rate}bit", "ceil", f"{ceil}bit", "burst",
                    f"{burst_for(rate)}b", "cburst", f"{burst_for(ceil)}b", "quantum",
                    str(quantum_for(rate)), "prio", str(p.shaping.priority)], check=True)
out["tc class change"] = timed(tc)
import importlib.metadata
try:
    out["_pyroute2"] = importlib.metadata.version("pyroute2")
except importlib.metadata.PackageNotFoundError:
    out["_pyroute2"] = "?"
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=200)
    ap.add_argument("--load", action="store_true", help="measure under a running flow")
    args = ap.parse_args()
    with Testbed() as tb:
        node, peer = tb.host("node"), tb.host("peer")
        link = tb.connect(node, peer)
        policy = write_policy(tb.tmpdir("p") / "policy.yaml", link.a.ifname, tb.tmpdir("state"),
                              link_rate="1gbit", rate="10mbit", ceil="400mbit",
                              serve_ports=(8080,))
        wagent(node, "shaping", "apply", "--policy", policy)
        if args.load:
            www = tb.tmpdir("www")
            with open(www / "big.bin", "wb") as f:
                f.truncate(8 << 30)
            srv = tb.nginx(node, root=www, port=8080)
            peer.popen(["curl", "-s", "-o", "/dev/null", "--max-time", "120",
                        srv.url_for(link.a) + "/big.bin"])
        res = node.run([sys.executable, "-c", MEASURE, str(policy), link.a.ifname,
                        str(args.changes)], timeout=600)
        data = json.loads(res.stdout)
    version = data.pop("_pyroute2")
    base = data["tc class change"]["median"]
    print(f"ceil change of one HTB class, {args.changes} changes"
          f"{' under load' if args.load else ''}; pyroute2 {version}, python "
          f"{sys.version.split()[0]}")
    print(f"{'method':<22} {'median ms':>10} {'p99 ms':>10} {'vs tc':>8}")
    for name, t in data.items():
        print(f"{name:<22} {t['median']:>10.3f} {t['p99']:>10.3f} {t['median'] / base:>7.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
