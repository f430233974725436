"""TCP connections on training ports (torch.distributed's 29500, NCCL's socket ports).

Reads ``{root}/proc/net/tcp`` and ``tcp6``, which list the sockets of the reader's network
namespace. A connection counts when its local *or* remote port is in a configured range and it
is ESTABLISHED, SYN_SENT or SYN_RECV: its mere presence is the signal, because a training flow
that distribution traffic is starving carries little at first, and waiting for its bytes would
react late.

On a live node (root "/") the sockets come from sock_diag (``agent.yielding.detect.sockdiag``),
which also gives each connection's bytes, so ``bps`` is the port's traffic; from /proc (fixture
trees, or a kernel that refuses sock_diag) there are no byte counts and ``bps`` is None.

    det = PortsDetector([(29500, 29500), (50000, 51000)])
    det.sample(now)  # -> (PortReading(port=29500, connections=2, peers=("10.0.0.1:29500",)),)
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.yielding.detect import sockdiag
from agent.yielding.detect.readings import PortReading

# /proc/net/tcp "st" column (include/net/tcp_states.h)
ESTABLISHED, SYN_SENT, SYN_RECV = 0x01, 0x02, 0x03
LIVE_STATES = frozenset({ESTABLISHED, SYN_SENT, SYN_RECV})
MAX_PEERS = 4  # kept per port for the reason line


@dataclass(frozen=True)
class TcpSocket:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    inode: int
    bytes: int | None = None      # sent + received, where the source counts them


class PortsDetector:
    def __init__(self, ranges: Sequence[tuple[int, int]], root: str | Path = "/",
                 use_sockdiag: bool | None = None) -> None:
        self._ranges = tuple((int(lo), int(hi)) for lo, hi in ranges)
        self._net = Path(root) / "proc" / "net"
        # sock_diag answers for the caller's own namespace only: never for a fixture tree.
        self._sockdiag = Path(root) == Path("/") if use_sockdiag is None else use_sockdiag
        self._bytes: dict[tuple, int] = {}
        self._at: float | None = None
        self._known: list[sockdiag.DiagSocket] = []   # the last dump's matching connections
        self._last: tuple[PortReading, ...] = ()

    def matches(self, port: int) -> bool:
        return any(lo <= port <= hi for lo, hi in self._ranges)

    def sample(self, now: float) -> tuple[PortReading, ...]:
        return self._readings(now, self.sockets())

    def refresh(self, now: float) -> tuple[PortReading, ...]:
        """The connections the last ``sample`` found, looked up again one by one (cheap: no
        table walk), so a connection that ended is seen to end within a tick even while full
        scans are paced; new connections wait for the next ``sample``."""
        if not self._known:
            return ()
        try:
            found = sockdiag.lookup_tcp(self._known)
        except OSError:
            return self._last
        return self._readings(now, (self._socket(i) for i in found), keep=False)

    def _readings(self, now: float, sockets: Iterable[TcpSocket],
                  keep: bool = True) -> tuple[PortReading, ...]:
        counts: dict[int, int] = {}
        peers: dict[int, list[str]] = {}
        moved: dict[int, int] = {}
        seen: dict[tuple, int] = {}
        counted = True
        for sock in sockets:
            if sock.state not in LIVE_STATES:
                continue
            if self.matches(sock.local[1]):
                port = sock.local[1]
            elif self.matches(sock.remote[1]):
                port = sock.remote[1]
            else:
                continue
            counts[port] = counts.get(port, 0) + 1
            p = peers.setdefault(port, [])
            peer = _format_addr(sock.remote)
            if len(p) < MAX_PEERS and peer not in p:
                p.append(peer)
            if sock.bytes is None:
                counted = False
                continue
            key = (sock.local, sock.remote, sock.inode)
            seen[key] = sock.bytes
            # A connection first seen now moved its bytes since the last tick (or it is the
            # first tick, which reports no rate at all).
            moved[port] = moved.get(port, 0) + sock.bytes - self._bytes.get(key, 0)
        dt = None if self._at is None or now <= self._at else now - self._at
        self._bytes, self._at = seen, now
        if not keep:
            self._known = [i for i in self._known if (i.local, i.remote, i.inode) in seen]
        self._last = tuple(
            PortReading(port, n, moved.get(port, 0) * 8 / dt if counted and dt else None,
                        tuple(peers[port]))
            for port, n in sorted(counts.items()))
        return self._last

    def sockets(self) -> Iterator[TcpSocket]:
        if self._sockdiag:
            try:
                infos = sockdiag.dump_tcp(
                    sockdiag.LIVE_STATES,
                    wanted=lambda lp, rp: self.matches(lp) or self.matches(rp))
            except OSError:
                self._sockdiag = False  # e.g. a seccomp filter without AF_NETLINK: use /proc
            else:
                self._known = list(infos)
                for i in infos:
                    yield self._socket(i)
                return
        for name in ("tcp", "tcp6"):
            try:
                text = (self._net / name).read_text()
            except OSError:
                continue  # no IPv6 in this kernel, or no /proc in a fixture tree
            yield from parse_proc_net_tcp(text)


    @staticmethod
    def _socket(i: sockdiag.DiagSocket) -> TcpSocket:
        total = None
        if i.bytes_acked is not None and i.bytes_received is not None:
            total = i.bytes_acked + i.bytes_received
        return TcpSocket(i.local, i.remote, i.state, i.inode, total)


def parse_proc_net_tcp(text: str) -> Iterator[TcpSocket]:
    """Sockets from the text of /proc/net/tcp or tcp6; malformed lines are skipped."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            local = parse_addr(fields[1])
            remote = parse_addr(fields[2])
            state = int(fields[3], 16)
            inode = int(fields[9])
        except ValueError:
            continue
        yield TcpSocket(local, remote, state, inode)


def parse_addr(text: str) -> tuple[str, int]:
    """``0100007F:0CEA`` -> ("127.0.0.1", 3306): the address is in host byte order words."""
    hexaddr, _, hexport = text.partition(":")
    if len(hexaddr) not in (8, 32):
        raise ValueError(f"bad address {text!r}")
    # The kernel prints each 32-bit word of the address as a host-order integer; /proc is read
    # on the host that wrote it, so packing each word in native order ("=") gives the bytes back.
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, len(hexaddr), 8)]
    packed = b"".join(struct.pack("=I", w) for w in words)
    addr = ipaddress.ip_address(packed)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr), int(hexport, 16)


def _format_addr(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
