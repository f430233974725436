"""`make demo`: the real agent on a local testbed of network namespaces.

What it shows, in order:
1. A publisher builds a model (real safetensors shards) and its manifest on an nginx origin.
2. `wagent run` starts on a GPU node behind a 1 Gbit/s link, applies its ingress cap through an
   IFB device, waits for its slot and pulls the version with parallel verified range requests.
3. A training flow (iperf3 on port 29500) starts in the middle of the pull: wagent backs off at
   once and the flow keeps its bandwidth; when it stops, the pull ramps up again.
4. The publisher releases a next version that changes two layers: the node fetches only those.
5. A summary: GB pulled, mean rate, the training flow's throughput kept, backoff events.
Everything it makes (namespaces, links, processes, files) is removed when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.units import format_rate, format_size, parse_size
from tests.modelgen import generate_sized, next_version
from tests.testbed import WAGENT, Testbed

LINK = "1gbit"
MODEL = "demo-model"
POLICY_TEMPLATE = Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def publish(root: Path, version: str, src: Path | None = None, size: int = 0) -> Any:
    """Write a version the way a publisher does: files, manifest, then `latest` last."""
    vdir = root / MODEL / version
    if src is None:
        spec = generate_sized(vdir, total_bytes=size, shards=8, seed=7)
    else:
        spec = next_version(src, vdir, change_layers=[2, 5])
    subprocess.run([WAGENT, "manifest", "build", str(vdir), "--model", MODEL, "--version",
                    version, "--quiet"], check=True)
    tmp = root / MODEL / ".latest.tmp"
    tmp.write_text(version + "\n")
    os.replace(tmp, root / MODEL / "latest")
    return spec


def write_policy(path: Path, source: str, ifname: str, run_dir: Path) -> None:
    text = POLICY_TEMPLATE.read_text()
    text = text.replace("- url: http://10.0.0.1:8080", "# (no cache node in this demo)", 1)
    text = re.sub(r"http://10\.0\.0\.2:8080", source, text)
    text = text.replace("[demo0]", f"[{ifname}]")
    text = text.replace("/tmp/wagent-demo/store", str(run_dir / "store"))
    text = text.replace("/tmp/wagent-demo/state", str(run_dir / "state"))
    text = text.replace("/tmp/wagent-demo/control.sock", str(run_dir / "control.sock"))
    path.write_text(text)


def status(node: Any, sock: Path) -> dict[str, Any]:
    try:
        out = node.run([WAGENT, "status", "--json", "--socket", str(sock)], check=False,
                       timeout=10)
        return json.loads(out.stdout)
    except (ValueError, subprocess.TimeoutExpired):
        return {"running": False}


def line(doc: dict[str, Any]) -> str:
    if not doc.get("pulls"):
        return "daemon starting"
    p = doc["pulls"][0]
    b = doc.get("backoff", {})
    done, total = p.get("bytes_done") or 0, p.get("bytes_total") or 0
    pct = f"{100 * done / total:5.1f}%" if total else "  -  "
    return (f"{p.get('state', '?'):15} {p.get('version') or '-':4} {pct} "
            f"{format_rate(p.get('rate_bps') or 0):>12}  backoff={b.get('state', '?'):10} "
            f"ceil={format_rate(b.get('rate_bps') or 0):>12}  {b.get('reason', '')}")


def watch(node: Any, sock: Path, until: Any, timeout: float, every: float = 1.0) -> dict:
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = status(node, sock)
        print("   " + line(doc), flush=True)
        if until(doc):
            return doc
        time.sleep(every)
    raise SystemExit(f"demo: timed out waiting; last status: {json.dumps(doc)[:2000]}")


def pulled(doc: dict, version: str) -> bool:
    pulls = doc.get("pulls") or []
    return bool(pulls) and pulls[0].get("local_version") == version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("make demo needs root (it builds network namespaces)", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    with Testbed() as tb:
        say(f"testbed: an nginx origin and a GPU node joined by a {LINK} link")
        origin, node = tb.host("origin"), tb.host("node")
        link = tb.connect(origin, node, rate=LINK)
        root = tb.tmpdir("origin")
        run_dir = tb.tmpdir("node")
        say(f"publisher: generating {MODEL} v1 ({format_size(size)}, 8 safetensors shards) and "
            "its manifest")
        publish(root, "v1", size=size)
        v1 = root / MODEL / "v1"
        srv = tb.nginx(origin, root=root, port=8080)
        tb.iperf3_server(origin, port=29500)
        t0 = tb.iperf3(node, server=link.a.ip4, port=29500, seconds=4, reverse=True).bps
        print(f"   a training flow alone gets {format_rate(t0)} (T0)")

        policy = run_dir / "policy.yaml"
        write_policy(policy, srv.url_for(link.a), link.b.ifname, run_dir)
        subprocess.run([WAGENT, "policy", "check", str(policy)], check=True)
        sock = run_dir / "control.sock"
        say("node: `wagent run` (shaping on the node's ingress, backoff on, waves of seconds)")
        daemon = node.popen([WAGENT, "run", "--policy", str(policy), "--hostname", "node1"])
        started = time.monotonic()
        watch(node, sock, lambda d: any(p.get("state") == "pulling" and
                                        (p.get("bytes_done") or 0) > size * 0.25
                                        for p in d.get("pulls") or []), timeout=180)
        say("training starts on port 29500 in the middle of the pull")
        flow = tb.iperf3_start(node, server=link.a.ip4, port=29500, seconds=8, reverse=True)
        watch(node, sock, lambda d: False if flow.running() else True, timeout=30, every=1.0)
        kept = flow.result().bps
        print(f"   training flow got {format_rate(kept)} beside the pull: "
              f"{100 * kept / t0:.0f}% of T0")
        say("training stopped; the pull ramps back up")
        doc = watch(node, sock, lambda d: pulled(d, "v1"), timeout=300)
        v1_secs = time.monotonic() - started
        print(node.run([WAGENT, "status", "--socket", str(sock)], check=False).stdout)

        say("publisher: v2 changes two layers; the node fetches only what changed")
        v2 = publish(root, "v2", src=v1)
        before = srv.bytes_sent(f"/{MODEL}/")
        doc = watch(node, sock, lambda d: pulled(d, "v2"), timeout=300)
        delta = srv.bytes_sent(f"/{MODEL}/") - before
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=10)
        node.run([WAGENT, "shaping", "clear", "--policy", str(policy)], check=False)

        b = doc.get("backoff", {})
        total = srv.bytes_sent(f"/{MODEL}/")
        say("summary")
        print(f"   pulled          {total / 1e9:.2f} GB from the origin")
        print(f"   v2 delta        {format_size(delta)} fetched for 2 changed layers "
              f"(their tensors and headers: {format_size(v2.delta_bytes)}; "
              f"the whole version: {format_size(v2.total_bytes)})")
        print(f"   mean rate (v1)  {format_rate(size * 8 / v1_secs)} over {v1_secs:.0f} s "
              "including slot wait and backoff")
        print(f"   training flow   {100 * kept / t0:.0f}% of its bandwidth alone kept")
        print(f"   backoff events  {b.get('events_total', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
