"""The Testbed: hosts as network namespaces joined by veth pairs and bridges, removed on exit.

```
    origin ──veth (HTB rate on origin's side)── node          tb.connect(origin, node, rate=...)
    n1 ──┐
    n2 ──┼── sw (a bridge in its own namespace)                 tb.attach(n1, sw, rate=...)
    n3 ──┘
```
Addresses: link k gets 10.(200+k/256).(k%256).{1,2}/24 and fd77:0:0:k::{1,2}/64; switch s gets
10.(100+s/256).(s%256).n/24 and fd78:0:0:s::n/64 for its n-th attached host. IPv6 addresses carry
`nodad` so they work at once.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.units import parse_rate
from tests.testbed import owners
from tests.testbed.hosts import Endpoint, Host, Link, stop_processes

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,11}$")

# A bottleneck's leaf queue: "bfifo" holds 50 ms at the rate (a shallow switch queue), "pfifo"
# holds PFIFO_PACKETS packets whatever their size (a deep-buffer switch: with veth's 64 KiB GSO
# packets, up to 64 MiB, half a second at 1 Gbit/s).
Leaf = Literal["bfifo", "pfifo"]
PFIFO_PACKETS = 1000

# Per-namespace settings: veth at 1-10 Gbit/s wants bigger socket buffers than the defaults, and
# IPv6 addresses must be usable without waiting for duplicate address detection.
HOST_SYSCTLS = {
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
    "net.core.rmem_max": 64 << 20,
    "net.core.wmem_max": 64 << 20,
    "net.ipv4.tcp_rmem": f"4096 131072 {64 << 20}",
    "net.ipv4.tcp_wmem": f"4096 16384 {64 << 20}",
}

_LIVE: set[Testbed] = set()  # strong refs: a testbed nobody closed is still closed at exit
_HANDLERS_INSTALLED = False


def to_bps(rate: str | int | None) -> int | None:
    """A rate as bits/s: '100mbit', '1gbit', '200MB/s', or an int already in bits/s."""
    if rate is None or isinstance(rate, int):
        return rate
    return parse_rate(rate)


@dataclass(eq=False)
class Switch:
    """An L2 segment: a Linux bridge `br0` inside its own namespace."""

    name: str
    index: int
    host: Host  # the namespace holding the bridge
    ports: dict[str, str] = field(default_factory=dict)  # attached host name -> port ifname


class Testbed:
    """Builds hosts, links, switches and servers; `close()` (or leaving `with`) removes them all.

    Also removed on SIGTERM/SIGHUP, Ctrl-C (through the `with`) and interpreter exit; a run killed
    outright is swept by the next Testbed that starts.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, tmp_parent: str | Path | None = None, sweep: bool = True) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the testbed needs root (network namespaces); run as root")
        if sweep:
            owners.sweep()
        parent = Path(tmp_parent or os.environ.get("WAGENT_TESTBED_TMP") or tempfile.gettempdir())
        self.prefix, self.root = owners.claim_prefix(parent)
        self._pid = os.getpid()
        self._lock = threading.RLock()  # re-entered by the SIGTERM handler
        self.hosts: dict[str, Host] = {}
        self.switches: dict[str, Switch] = {}
        self.links: list[Link] = []
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._links = 0
        self._closed = False
        self._logs = self.root / "logs"
        self._logs.mkdir()
        _LIVE.add(self)
        _install_handlers()

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill tracked processes, delete namespaces (with their links), remove temp dirs."""
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._closed = True
        stop_processes(self._procs)
        for ns in reversed(self._namespaces):
            owners.delete_netns(ns)
        if os.environ.get("WAGENT_TESTBED_KEEP"):
            # Kept for a post-mortem; the record goes, so the next sweep won't count it as ours.
            print(f"testbed: kept {self.root} (WAGENT_TESTBED_KEEP is set)", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)
        owners.release_prefix(self.prefix)
        _LIVE.discard(self)

    def logs(self, tail: int = 2000) -> str:
        """The last `tail` characters of every process log and nginx error log, for reports."""
        parts = []
        for path in sorted([*self._logs.glob("*.log"), *self.root.glob("nginx-*/error.log")]):
            text = path.read_text(errors="replace").strip()
            if text:
                parts.append(f"--- {path.relative_to(self.root)}\n{text[-tail:]}")
        return "\n".join(parts)

    def track(self, proc: subprocess.Popen) -> None:
        self._procs.append(proc)

    def log_path(self, stem: str) -> Path:
        path, n = self._logs / f"{stem}.log", 1
        while path.exists():
            n += 1
            path = self._logs / f"{stem}-{n}.log"
        return path

    def tmpdir(self, name: str = "tmp") -> Path:
        """A fresh directory under the run's temp root, removed on exit."""
        path, n = self.root / name, 1
        while path.exists():
            n += 1
            path = self.root / f"{name}-{n}"
        path.mkdir(parents=True)
        return path

    # --- topology --------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        """A new namespace `<prefix>-<name>` with lo up and the testbed's sysctls."""
        if not NAME_RE.match(name):
            raise ValueError(f"host name {name!r}: use 1-12 of a-z, 0-9, '-', starting a-z")
        if name in self.hosts or name in self.switches:
            raise ValueError(f"host name {name!r} is already used in this testbed")
        ns = f"{self.prefix}-{name}"
        self._namespaces.append(ns)  # before creating, so close() removes a half-made one
        _ip("netns", "add", ns)
        host = Host(name, ns, self)
        _ip("-n", ns, "link", "set", "lo", "up")
        # -e: keys this kernel keeps global (not per namespace) are skipped, not fatal.
        host.run(["sysctl", "-q", "-e", "-w", *(f"{k}={v}" for k, v in HOST_SYSCTLS.items())],
                 check=False)
        self.hosts[name] = host
        return host

    def connect(self, a: Host, b: Host, rate: str | int | None = None,
                rate_back: str | int | None = None, leaf: Leaf = "bfifo") -> Link:
        """A veth pair between two hosts; `rate` caps a -> b, `rate_back` caps b -> a.

        `leaf` is the caps' queue, as in shape().
        """
        k = self._links
        self._links += 1
        net4 = f"10.{200 + k // 256}.{k % 256}"
        net6 = f"fd77:0:0:{k:x}"
        ea = Endpoint(a, _ifname(a, f"to-{b.name}"), f"{net4}.1", _v6(f"{net6}::1"))
        eb = Endpoint(b, _ifname(b, f"to-{a.name}"), f"{net4}.2", _v6(f"{net6}::2"))
        _veth(a, ea.ifname, b, eb.ifname)
        for ep in (ea, eb):
            _address(ep)
            ep.host.endpoints.append(ep)
        link = Link(ea, eb, to_bps(rate), to_bps(rate_back))
        if link.rate:
            self.shape(a, ea.ifname, link.rate, leaf=leaf)
        if link.rate_back:
            self.shape(b, eb.ifname, link.rate_back, leaf=leaf)
        self.links.append(link)
        return link

    def switch(self, name: str) -> Switch:
        """A bridge in its own namespace; attach() hosts to it."""
        host = self.host(name)
        del self.hosts[name]
        sw = Switch(name, len(self.switches), host)
        host.run(["ip", "link", "add", "name", "br0", "type", "bridge", "stp_state", "0",
                  "mcast_snooping", "0"])
        host.run(["ip", "link", "set", "dev", "br0", "up"])
        self.switches[name] = sw
        return sw

    def attach(self, host: Host, sw: Switch, rate: str | int | None = None,
               rate_back: str | int | None = None) -> Endpoint:
        """Put `host` on the switch; `rate` caps host -> switch, `rate_back` switch -> host.

        Same direction convention as connect(host, sw): `rate_back` is the port's download cap.
        """
        n = len(sw.ports) + 1
        if n > 250:
            raise ValueError(f"switch {sw.name!r} is full (250 hosts)")
        s = sw.index
        ep = Endpoint(host, _ifname(host, f"to-{sw.name}"), f"10.{100 + s // 256}.{s % 256}.{n}",
                      _v6(f"fd78:0:0:{s:x}::{n:x}"))
        port = _ifname(sw.host, f"p-{host.name}")
        _veth(host, ep.ifname, sw.host, port)
        sw.host.run(["ip", "link", "set", port, "master", "br0", "up"])
        _address(ep)
        host.endpoints.append(ep)
        sw.ports[host.name] = port
        if rate:
            self.shape(host, ep.ifname, to_bps(rate))
        if rate_back:
            self.shape(sw.host, port, to_bps(rate_back))
        self.links.append(Link(ep, Endpoint(sw.host, port, "", ""), to_bps(rate),
                               to_bps(rate_back)))
        return ep

    def shape(self, host: Host, ifname: str, rate: str | int | None,
              limit_bytes: int | None = None, leaf: Leaf = "bfifo") -> None:
        """A bottleneck: HTB root 1:, class 1:1 at `rate`, a `leaf` queue; replaces any root qdisc.

        Burst and cburst are explicit (1 ms at rate, at least 128 KiB, as veth hands over 64 KiB
        GSO packets), so high rates are accurate; the leaf holds 50 ms at rate (>= 2 MiB) so loss
        stays rare. `leaf="pfifo"`: a pfifo of PFIFO_PACKETS packets instead, a deep-buffer
        switch (`limit_bytes` is for the bfifo only).
        """
        bps = to_bps(rate)
        if not bps:
            raise ValueError("shape() needs a rate")
        if leaf not in ("bfifo", "pfifo"):
            raise ValueError(f"shape(): leaf {leaf!r}, not bfifo or pfifo")
        if leaf == "pfifo" and limit_bytes is not None:
            raise ValueError("shape(): limit_bytes sets a bfifo's limit, not a pfifo's")
        byte_rate = bps // 8
        burst = max(byte_rate // 1000, 128 << 10)
        limit = limit_bytes or min(max(byte_rate // 20, 2 << 20), 64 << 20)
        batch = (f"qdisc replace dev {ifname} root handle 1: htb default 1\n"
                 f"class add dev {ifname} parent 1: classid 1:1 htb rate {bps}bit ceil {bps}bit "
                 f"burst {burst}b cburst {burst}b quantum 60000\n"
                 f"qdisc add dev {ifname} parent 1:1 handle 10: "
                 + (f"bfifo limit {limit}b\n" if leaf == "bfifo"
                    else f"pfifo limit {PFIFO_PACKETS}\n"))
        host.run(["tc", "-batch", "-"], input=batch)

    # --- servers and traffic (thin wrappers; the work is in nginx.py and traffic.py) -------
    def nginx(self, host: Host, root: str | Path, port: int = 8080,
              limit_rate: str | int | None = None, **kwargs: Any) -> Any:
        from tests.testbed.nginx import start_nginx
        return start_nginx(self, host, Path(root), port, limit_rate, **kwargs)

    def s3(self, host: Host, port: int = 8333) -> Any:
        """SeaweedFS's S3 gateway in `host` (tests/testbed/seaweed.py), once it takes writes."""
        from tests.testbed.seaweed import start_seaweed
        return start_seaweed(self, host, port)

    def rsyncd(self, host: Host, root: str | Path, port: int = 873) -> Any:
        """An rsync daemon serving `root` read-only as module `data` (url_for() gives the URL)."""
        from tests.testbed.nginx import start_rsyncd
        return start_rsyncd(self, host, Path(root), port)

    def iperf3_server(self, host: Host, port: int = 5201) -> subprocess.Popen:
        from tests.testbed.traffic import iperf3_server
        return iperf3_server(host, port)

    def iperf3(self, host: Host, server: str, port: int = 5201, seconds: float = 10,
               reverse: bool = False, **kwargs: Any) -> Any:
        from tests.testbed.traffic import iperf3_start
        return iperf3_start(host, server, port, seconds, reverse, **kwargs).result()

    def iperf3_start(self, host: Host, server: str, port: int = 5201, seconds: float = 10,
                     reverse: bool = False, **kwargs: Any) -> Any:
        """Like iperf3() but returns at once; `.result()` waits and parses."""
        from tests.testbed.traffic import iperf3_start
        return iperf3_start(host, server, port, seconds, reverse, **kwargs)

    def bursts(self, sender: Host, receiver: Host, server: str, port: int, **kwargs: Any) -> Any:
        """On/off bursts from ``sender`` to ``receiver``, each acked and timed (bursts.py);
        returns at once, ``.result()`` waits: a list of ``Burst``."""
        from tests.testbed.bursts import start_bursts
        return start_bursts(sender, receiver, server, port, **kwargs)

    def goodput(self, host: Host, url: str, seconds: float = 10, **kwargs: Any) -> float:
        from tests.testbed.traffic import goodput
        return goodput(host, url, seconds, **kwargs)


def _v6(addr: str) -> str:
    return str(ipaddress.IPv6Address(addr))  # canonical form, as `ip` and logs print it


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _ifname(host: Host, base: str) -> str:
    """A name unused on this host, at most 15 characters (the kernel's IFNAMSIZ - 1)."""
    used = {ep.ifname for ep in host.endpoints}
    sw = host.bed.switches.get(host.name)
    if sw is not None:
        used |= set(sw.ports.values())
    name, n = base[:15], 1
    while name in used:
        n += 1
        name = f"{base[:15 - len(str(n))]}{n}"
    return name


def _veth(a: Host, a_if: str, b: Host, b_if: str) -> None:
    # Created straight into both namespaces: the names never touch the root namespace.
    _ip("link", "add", a_if, "netns", a.ns, "type", "veth", "peer", "name", b_if, "netns", b.ns)
    _ip("-n", a.ns, "link", "set", a_if, "up")
    _ip("-n", b.ns, "link", "set", b_if, "up")


def _address(ep: Endpoint) -> None:
    ns = ep.host.ns
    _ip("-n", ns, "addr", "add", f"{ep.ip4}/{ep.prefix4}", "dev", ep.ifname)
    _ip("-n", ns, "-6", "addr", "add", f"{ep.ip6}/{ep.prefix6}", "dev", ep.ifname, "nodad")


def close_all() -> None:
    for bed in list(_LIVE):
        bed.close()


def _install_handlers() -> None:
    """Close every live testbed at exit and on SIGTERM/SIGHUP (SIGINT unwinds `with` blocks)."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: object, previous: Any = previous) -> None:
            close_all()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
