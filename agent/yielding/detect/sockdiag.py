"""TCP sockets with their byte counts, from the kernel's sock_diag netlink interface.

/proc/net/tcp has no byte counts; ``tcp_info`` (INET_DIAG_INFO) has ``tcpi_bytes_acked`` and
``tcpi_bytes_received`` (Linux 4.1+). This speaks the few structures it needs with ``socket``
and ``struct`` (pyroute2 stays in ``shaping/netlink.py``). No privileges are needed: any process
may dump the TCP sockets of its own network namespace.

>>> socks = dump_tcp()                      # doctest: +SKIP
>>> socks[0]                                # doctest: +SKIP
DiagSocket(local=('10.0.0.2', 51234), remote=('10.0.0.1', 29500), state=1, inode=5521,
        bytes_acked=1, bytes_received=1180000000)
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
NLMSG_HDR = struct.Struct("=IHHII")
REQ_V2 = struct.Struct("=BBBxI")                    # family, protocol, ext, pad, states
SOCKID = struct.Struct("!HH16s16s")                 # sport, dport, src, dst (network order)
PORTS = struct.Struct("!HH")
SOCKID_TAIL = struct.Struct("=III")                 # if, cookie[2]
DIAG_MSG = struct.Struct("=BBBB")                   # family, state, timer, retrans
DIAG_MSG_TAIL = struct.Struct("=IIIII")             # expires, rqueue, wqueue, uid, inode
RTATTR = struct.Struct("=HH")
TCPI_BYTES = struct.Struct("=QQ")                   # bytes_acked, bytes_received
TCPI_BYTES_OFFSET = 120                             # in struct tcp_info (include/uapi/linux/tcp.h)
DIAG_MSG_SIZE = DIAG_MSG.size + SOCKID.size + SOCKID_TAIL.size + DIAG_MSG_TAIL.size  # 72


class SockDiagError(OSError):
    """The kernel refused or garbled a sock_diag dump."""


@dataclass(frozen=True)
class DiagSocket:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    inode: int
    bytes_acked: int | None       # None: a kernel too old for these tcp_info fields
    bytes_received: int | None
    family: int = 0               # AF_INET or AF_INET6, and the kernel's id of the socket, for
    key: bytes = b""              # a later lookup of this very socket (``lookup_tcp``)


ALL_STATES = 0xFFF
LIVE_STATES = (1 << 1) | (1 << 2) | (1 << 3)  # ESTABLISHED, SYN_SENT, SYN_RECV

PortFilter = Callable[[int, int], bool]


def dump_tcp(states: int = ALL_STATES,
             families: tuple[int, ...] = (socket.AF_INET, socket.AF_INET6),
             wanted: PortFilter | None = None) -> list[DiagSocket]:
    """Every TCP socket in the caller's network namespace whose state bit is set in ``states``
    (the kernel filters those) and, if given, for which ``wanted(local_port, remote_port)``
    holds (checked before anything else is decoded: a node may hold thousands of sockets)."""
    out: list[DiagSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
        for seq, family in enumerate(families, start=1):
            s.sendto(build_request(family, states, seq), (0, 0))
            out += _receive(s, seq, wanted)
    return out


def build_request(family: int, states: int, seq: int) -> bytes:
    body = (REQ_V2.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), states)
            + SOCKID.pack(0, 0, b"\0" * 16, b"\0" * 16) + SOCKID_TAIL.pack(0, 0, 0))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY,
                          NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _receive(s: socket.socket, seq: int, wanted: PortFilter | None) -> list[DiagSocket]:
    out: list[DiagSocket] = []
    buf = bytearray(1 << 20)         # one buffer per dump, not a fresh 1 MiB per datagram
    while True:
        n = s.recv_into(buf)
        data = bytes(memoryview(buf)[:n])
        if not data:
            raise SockDiagError("sock_diag: the kernel closed the dump")
        done, socks = parse_messages(data, seq, wanted)
        out += socks
        if done:
            return out


def parse_messages(data: bytes, seq: int | None = None,
                   wanted: PortFilter | None = None) -> tuple[bool, list[DiagSocket]]:
    """(dump finished, sockets) from one datagram of netlink messages."""
    out: list[DiagSocket] = []
    off = 0
    while off + NLMSG_HDR.size <= len(data):
        length, mtype, _flags, mseq, _pid = NLMSG_HDR.unpack_from(data, off)
        if length < NLMSG_HDR.size or off + length > len(data):
            raise SockDiagError(f"sock_diag: bad message length {length}")
        if seq is not None and mseq != seq:
            off += _align(length)
            continue
        if mtype == NLMSG_DONE:
            return True, out
        if mtype == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, off + NLMSG_HDR.size)
            raise SockDiagError(-err, f"sock_diag: {os.strerror(-err)}")
        if mtype == SOCK_DIAG_BY_FAMILY:
            at = off + NLMSG_HDR.size
            if wanted is None or wanted(*PORTS.unpack_from(data, at + DIAG_MSG.size)):
                out.append(parse_diag_msg(data[at:off + length]))
        off += _align(length)
    return False, out


def parse_diag_msg(msg: bytes) -> DiagSocket:
    if len(msg) < DIAG_MSG_SIZE:
        raise SockDiagError(f"sock_diag: short inet_diag_msg ({len(msg)} bytes)")
    family, state, _timer, _retrans = DIAG_MSG.unpack_from(msg, 0)
    sport, dport, src, dst = SOCKID.unpack_from(msg, DIAG_MSG.size)
    off = DIAG_MSG.size + SOCKID.size + SOCKID_TAIL.size
    *_, inode = DIAG_MSG_TAIL.unpack_from(msg, off)
    acked = received = None
    off = DIAG_MSG_SIZE
    while off + RTATTR.size <= len(msg):
        alen, atype = RTATTR.unpack_from(msg, off)
        if alen < RTATTR.size:
            break
        payload = msg[off + RTATTR.size:off + alen]
        if atype == INET_DIAG_INFO and len(payload) >= TCPI_BYTES_OFFSET + TCPI_BYTES.size:
            acked, received = TCPI_BYTES.unpack_from(payload, TCPI_BYTES_OFFSET)
        off += _align(alen)
    key = msg[DIAG_MSG.size:DIAG_MSG.size + SOCKID.size + SOCKID_TAIL.size]
    return DiagSocket((_addr(family, src), sport), (_addr(family, dst), dport), state, inode,
                   acked, received, family, key)


def lookup_tcp(known: list[DiagSocket]) -> list[DiagSocket]:
    """The sockets of ``known`` that still exist, as they are now: one exact lookup each (a
    hash lookup in the kernel, where a dump walks its whole table), all in one datagram."""
    asking = [k for k in known if k.key]
    if not asking:
        return []
    out: list[DiagSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
        s.sendto(b"".join(_lookup_request(k, seq) for seq, k in enumerate(asking, start=1)),
                 (0, 0))
        pending = set(range(1, len(asking) + 1))
        while pending:
            data = s.recv(1 << 16)
            if not data:
                raise SockDiagError("sock_diag: the kernel closed the socket")
            off = 0
            while off + NLMSG_HDR.size <= len(data):
                length, mtype, _flags, mseq, _pid = NLMSG_HDR.unpack_from(data, off)
                if length < NLMSG_HDR.size or off + length > len(data):
                    raise SockDiagError(f"sock_diag: bad message length {length}")
                if mseq in pending:
                    pending.discard(mseq)
                    if mtype == SOCK_DIAG_BY_FAMILY:   # else an error: ENOENT, it is gone
                        out.append(parse_diag_msg(data[off + NLMSG_HDR.size:off + length]))
                off += _align(length)
    return out


def _lookup_request(k: DiagSocket, seq: int) -> bytes:
    body = REQ_V2.pack(k.family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), ALL_STATES) \
        + k.key
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq,
                          0) + body


V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _addr(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    if raw.startswith(V4_MAPPED):
        return socket.inet_ntop(socket.AF_INET, raw[12:16])
    return socket.inet_ntop(socket.AF_INET6, raw)


def _align(n: int) -> int:
    return (n + 3) & ~3
