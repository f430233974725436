"""Helpers for the shaping integration tests and bench: policies, the CLI in a host, counters.

Counters are read with `tc -s class show` (text: Debian 12's tc has no JSON for classes), not
with wagent's own adapter, so the tests don't grade wagent with wagent.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.testbed import WAGENT_CMD, Host

SAMPLER = r"""
import re, subprocess, sys, time
dev, period = sys.argv[1], float(sys.argv[2])
pat = re.compile(r"class htb (\S+) .*?\n Sent (\d+) bytes", re.S)
while True:
    out = subprocess.run(["tc", "-s", "class", "show", "dev", dev], capture_output=True,
                         text=True).stdout
    t = time.monotonic()
    print(t, " ".join(f"{h}={b}" for h, b in pat.findall(out)), flush=True)
    time.sleep(period)
"""


def write_policy(path: Path, interface: str, state_dir: Path, *, link_rate: str, rate: str,
                 ceil: str, serve_ports: tuple[int, ...] = (), pull_ports: tuple[int, ...] = (),
                 sources: tuple[str, ...] = (), take_over: bool = False,
                 enabled: bool = True) -> Path:
    doc = {
        "version": 1,
        "sources": [{"url": u} for u in sources],
        "shaping": {"enabled": enabled, "interfaces": [interface], "link_rate": link_rate,
                    "rate": rate, "ceil": ceil, "serve_ports": list(serve_ports),
                    "pull_ports": list(pull_ports), "priority": 7, "take_over": take_over},
        "state_dir": str(state_dir),
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def wagent(host: Host, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return host.run([*WAGENT_CMD, *map(str, args)], check=check, timeout=60)


def snapshot(host: Host) -> tuple[str, str]:
    """What `clear` must give back: every qdisc and every link (addresses aside)."""
    qdiscs = host.run(["tc", "qdisc", "show"]).stdout
    links = host.run(["ip", "-o", "link", "show"]).stdout
    return qdiscs, re.sub(r"link/ether \S+", "link/ether X", links)


def qdisc_sent(host: Host, device: str, handle: str = "5747:") -> int:
    """Bytes the qdisc ``handle`` on ``device`` has sent (`tc -s qdisc show`): on wagent's IFB,
    every byte the ingress filters redirected into it."""
    out = host.run(["tc", "-s", "qdisc", "show", "dev", device], check=True).stdout
    found = re.search(rf"qdisc \S+ {re.escape(handle)} .*?\n Sent (\d+) bytes", out, re.S)
    if found is None:
        raise AssertionError(f"no qdisc {handle} on {device}:\n{out}")
    return int(found.group(1))


def ingress_filters(host: Host, device: str) -> str:
    return host.run(["tc", "filter", "show", "dev", device, "ingress"], check=True).stdout


@dataclass
class Sampler:
    """Byte counters of a device's HTB classes, sampled every `period` s in the host."""

    host: Host
    device: str
    period: float = 0.1
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def __enter__(self) -> Sampler:
        self.proc = self.host.popen([sys.executable, "-c", SAMPLER, self.device,
                                     str(self.period)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            t, *pairs = line.split()
            self.samples.append((float(t), {k: int(v) for k, v in
                                            (p.split("=") for p in pairs)}))

    def rates(self, classid: str, window: float = 0.5) -> list[tuple[float, float]]:
        """(end time, bits/s over the preceding `window` s) for one class."""
        out = []
        for i, (t, c) in enumerate(self.samples):
            j = next((k for k in range(i, -1, -1) if t - self.samples[k][0] >= window), None)
            if j is None or classid not in c or classid not in self.samples[j][1]:
                continue
            dt = t - self.samples[j][0]
            out.append((t, (c[classid] - self.samples[j][1][classid]) * 8 / dt))
        return out


def first_time(rates: list[tuple[float, float]], after: float,
               ok: Callable[[float], bool]) -> float | None:
    """Seconds from `after` to the end of the first window whose rate satisfies `ok` (an upper
    bound: the window may have got there earlier)."""
    for t, r in rates:
        if t >= after and ok(r):
            return t - after
    return None


def now() -> float:
    return time.monotonic()
