"""The only module that speaks netlink (through pyroute2): dumps tc state into ``shaping.observed``
values and executes ``shaping.plan`` actions.

Why not ``IPRoute.tc()``: Debian 12's pyroute2 0.7.2 can't encode HTB rates at or above 2^32
bytes/s (34.4 Gbit/s; no TCA_HTB_RATE64) nor decode them, ignores u32 ``nexthdr``, and its
``tc('del')`` without an interface index deletes the root qdisc of every link. So the tc messages
are declared here on pyroute2's ``nlmsg``/``nla`` marshalling (stable from 0.7 to 0.9), their
structs packed explicitly, every request carries an interface index, and they go over a plain
NETLINK_ROUTE socket: one request, one ack, the same on every pyroute2 release (0.9's IPRoute runs
an asyncio core per socket; the backoff loop's ceil change wants a single syscall pair). Links
(the IFB) go through ``IPRoute.link()``, whose API is the same in both.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence

from pyroute2 import IPRoute
from pyroute2.netlink import nla, nlmsg
from pyroute2.netlink.exceptions import NetlinkError

from shaping.errors import NET_ADMIN_HINT, ShapingError
from shaping.observed import (
    TC_H_INGRESS,
    TC_H_ROOT,
    Device,
    FilterState,
    HtbClassState,
    Qdisc,
    U32Key,
)
from shaping.plan import (
    ETH_P_ALL,
    INGRESS_HANDLE,
    Action,
    AddIngress,
    CreateIfb,
    DeleteClass,
    DeleteFilter,
    DeleteLink,
    DeleteQdisc,
    Filter,
    HtbClass,
    RestoreRoot,
    SetClass,
    SetFilter,
    SetLinkUp,
    SetRootHtb,
    bytes_to_ticks,
)

RTM_NEWQDISC, RTM_DELQDISC, RTM_GETQDISC = 36, 37, 38
RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS = 40, 41, 42
RTM_NEWTFILTER, RTM_DELTFILTER, RTM_GETTFILTER = 44, 45, 46
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
SOL_NETLINK, NETLINK_EXT_ACK, NLMSGERR_ATTR_MSG = 270, 11, 1
TC_ACT_STOLEN, TCA_EGRESS_REDIR = 4, 1
TC_U32_TERMINAL = 1
TCA_BPF_FLAG_ACT_DIRECT = 1
READ_SPAN, READ_ATTEMPTS = 0.0005, 3    # ingress counters: a read over 0.5 ms is redone
LINKLAYER_ETHERNET = 1
U32_MAX = 0xFFFFFFFF
IFF_UP = 0x1

_RATESPEC = "BBHhHI"
_HTB_OPT = struct.Struct("=" + _RATESPEC + _RATESPEC + "IIIII")   # struct tc_htb_opt
_HTB_GLOB = struct.Struct("=IIIII")                               # struct tc_htb_glob
_U32_SEL = struct.Struct("=BBBxHHhhI")                            # struct tc_u32_sel (no keys)
_U32_KEY = struct.Struct("=4s4sii")                               # mask, val (be), off, offmask
_MIRRED = struct.Struct("=IIiiiiI")                               # struct tc_mirred
_ESTIMATOR = struct.Struct("=bB")                                 # struct tc_estimator


class _stats2(nla):
    nla_map = (("TCA_STATS_UNSPEC", "none"), ("TCA_STATS_BASIC", "cdata"),
               ("TCA_STATS_RATE_EST", "cdata"), ("TCA_STATS_QUEUE", "cdata"),
               ("TCA_STATS_APP", "cdata"), ("TCA_STATS_RATE_EST64", "cdata"),
               ("TCA_STATS_PAD", "cdata"), ("TCA_STATS_BASIC_HW", "cdata"),
               ("TCA_STATS_PKT64", "uint64"))


class _htb_options(nla):
    nla_map = (("TCA_HTB_UNSPEC", "none"), ("TCA_HTB_PARMS", "cdata"),
               ("TCA_HTB_INIT", "cdata"), ("TCA_HTB_CTAB", "cdata"),
               ("TCA_HTB_RTAB", "cdata"), ("TCA_HTB_DIRECT_QLEN", "uint32"),
               ("TCA_HTB_RATE64", "uint64"), ("TCA_HTB_CEIL64", "uint64"),
               ("TCA_HTB_PAD", "cdata"), ("TCA_HTB_OFFLOAD", "flag"))


class _mirred_options(nla):
    # Decoded as mirred's; another action kind's PARMS is only read if its KIND is mirred.
    nla_map = (("TCA_MIRRED_UNSPEC", "none"), ("TCA_MIRRED_TM", "cdata"),
               ("TCA_MIRRED_PARMS", "cdata"))


class _action(nla):
    nla_map = (("TCA_ACT_UNSPEC", "none"), ("TCA_ACT_KIND", "asciiz"),
               ("TCA_ACT_OPTIONS", "options"), ("TCA_ACT_INDEX", "uint32"),
               ("TCA_ACT_STATS", "cdata"))
    options = _mirred_options


class _actions(nla):
    # Actions are keyed by their order (1, 2, ...), each one nested.
    nla_map = tuple((i, f"TCA_ACT_PRIO_{i}", "action") for i in range(1, 33))
    action = _action


class _u32_options(nla):
    nla_map = (("TCA_U32_UNSPEC", "none"), ("TCA_U32_CLASSID", "uint32"),
               ("TCA_U32_HASH", "uint32"), ("TCA_U32_LINK", "uint32"),
               ("TCA_U32_DIVISOR", "uint32"), ("TCA_U32_SEL", "cdata"),
               ("TCA_U32_POLICE", "cdata"), ("TCA_U32_ACT", "actions"),
               ("TCA_U32_INDEV", "asciiz"), ("TCA_U32_PCNT", "cdata"),
               ("TCA_U32_MARK", "cdata"), ("TCA_U32_FLAGS", "uint32"))
    actions = _actions


def _tc_class(name: str, options: str, **nested: type[nla]) -> type[nlmsg]:
    """A struct tcmsg whose TCA_OPTIONS decodes as ``options``. Built as separate classes, not
    subclasses: pyroute2 caches the compiled attribute map on the class and a subclass would
    inherit its parent's."""
    body = {
        "fields": (("family", "B"), ("pad1", "B"), ("pad2", "H"), ("index", "i"),
                   ("handle", "I"), ("parent", "I"), ("info", "I")),
        "nla_map": (("TCA_UNSPEC", "none"), ("TCA_KIND", "asciiz"), ("TCA_OPTIONS", options),
                    ("TCA_STATS", "cdata"), ("TCA_XSTATS", "cdata"), ("TCA_RATE", "cdata"),
                    ("TCA_FCNT", "cdata"), ("TCA_STATS2", "stats2"), ("TCA_STAB", "cdata")),
        "stats2": _stats2,
        **nested,
    }
    return type(name, (nlmsg,), body)


class _bpf_options(nla):
    nla_map = (("TCA_BPF_UNSPEC", "none"), ("TCA_BPF_ACT", "cdata"),
               ("TCA_BPF_POLICE", "cdata"), ("TCA_BPF_CLASSID", "uint32"),
               ("TCA_BPF_OPS_LEN", "uint16"), ("TCA_BPF_OPS", "cdata"),
               ("TCA_BPF_FD", "uint32"), ("TCA_BPF_NAME", "asciiz"),
               ("TCA_BPF_FLAGS", "uint32"))


_tc = _tc_class("_tc", "cdata")
_bpf_tc = _tc_class("_bpf_tc", "bpf", bpf=_bpf_options)
_htb_tc = _tc_class("_htb_tc", "htb", htb=_htb_options)
_u32_tc = _tc_class("_u32_tc", "u32", u32=_u32_options)


_BY_KIND: dict[str, type[nlmsg]] = {"htb": _htb_tc, "u32": _u32_tc}


def _kind_of(data: bytes) -> str:
    """TCA_KIND of a raw tc message, read ahead so the right message class can decode it."""
    off = 16 + 20
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            break
        if kind & 0x3FFF == 1:
            return data[off + 4:off + length].rstrip(b"\0").decode("ascii", "replace")
        off += (length + 3) & ~3
    return ""


def _attr(msg: nla | nlmsg, name: str, default: object = None) -> object:
    value = msg.get_attr(name)
    return default if value is None else value


class Netlink:
    """tc and link requests in the current network namespace. Use as a context manager."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock               # times the counter reads (see ``ingress_counters``)
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        except OSError as e:
            raise ShapingError(f"can't open a netlink socket: {e}") from None
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        except OSError:
            pass                         # kernels before 4.12: errors without the kernel's words
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self._sock.settimeout(10.0)
        self._sock.bind((0, 0))
        self._seq = itertools.count(int.from_bytes(os.urandom(2), "big") + 1)
        self._ipr: IPRoute | None = None
        self._buf = bytearray(1 << 20)

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    @property
    def ipr(self) -> IPRoute:
        if self._ipr is None:
            self._ipr = IPRoute()
        return self._ipr

    # ---- reading -------------------------------------------------------------------------
    def links(self) -> dict[str, tuple[int, str, bool, int]]:
        """name -> (index, kind, up, txqlen) of every link in the namespace."""
        out = {}
        for msg in self.ipr.get_links():
            info = msg.get_attr("IFLA_LINKINFO")
            kind = (info.get_attr("IFLA_INFO_KIND") if info is not None else None) or ""
            out[msg.get_attr("IFLA_IFNAME")] = (msg["index"], kind, bool(msg["flags"] & IFF_UP),
                                                msg.get_attr("IFLA_TXQLEN") or 0)
        return out

    def device(self, name: str, links: dict[str, tuple[int, str, bool, int]] | None = None
               ) -> Device:
        """One link with its qdiscs, HTB classes and u32 filters (root tree and ingress)."""
        links = self.links() if links is None else links
        if name not in links:
            return Device(name, exists=False)
        index, kind, up, txqlen = links[name]
        qdiscs = tuple(self._qdiscs(index))
        classes: tuple[HtbClassState, ...] = ()
        filters: list[FilterState] = []
        root = next((q for q in qdiscs if q.parent == TC_H_ROOT), None)
        if root is not None and root.kind == "htb":
            classes = tuple(c for c, _ in self._classes(index))
            filters += self._filters(index, root.handle)
        if any(q.parent == TC_H_INGRESS and q.kind == "ingress" for q in qdiscs):
            filters += self._filters(index, 0xFFFF0000)
        return Device(name, True, index, kind, up, txqlen, qdiscs, classes, tuple(filters))

    def wagent_roots(self) -> set[int]:
        """Indexes of links whose root qdisc carries wagent's handle (one dump for all links)."""
        out = set()
        for raw in self._dump(RTM_GETQDISC, 0, 0):
            index, q = parse_qdisc(raw)
            if q.parent == TC_H_ROOT and q.handle >> 16 == 0x5747 and q.kind == "htb":
                out.add(index)
        return out

    def class_stats(self, index: int) -> list[tuple[HtbClassState, dict[str, int]]]:
        return list(self._classes(index))

    def ingress_counters(self, index: int) -> tuple[int, int] | None:
        """(bytes every packet arriving on the link counted, bytes redirected to the IFB): the
        ingress qdisc's and its mirred actions' counters, both taken by the kernel in one place
        with one accounting (skb->len at ingress, GRO'd packets as they are), so their
        difference is exactly the traffic that is not distribution traffic, whatever the
        driver counts in rx_bytes (per frame on a NIC, per GSO packet on a veth). None: no
        ingress qdisc. Decoded by hand, not by pyroute2: this runs every backoff tick.

        The two dumps can't be one, and what arrives between them counts on one side only: a
        read stretched by the scheduler is done again (at 1 Gbit/s, 10 ms between the reads of
        one tick and not of the next is 100 Mbit/s of phantom traffic over a 100 ms tick: a
        false backoff, measured before this), so the error stays under the link's rate times
        ``READ_SPAN`` per tick. The span is the filters' dump and the qdiscs' up to the ingress
        qdisc's message, in that order: a qdisc dump carries every qdisc of the namespace
        (``_ingress_seen``), and what comes after this link's is no part of the error."""
        best: tuple[float, int, int] | None = None
        for _ in range(READ_ATTEMPTS):
            started = self.clock()
            redirected = sum(mirred_bytes(raw, index)
                             for raw in self._dump(RTM_GETTFILTER, index, 0xFFFF0000))
            got = self._ingress_seen(index)
            if got is None:
                return None
            seen, at = got
            span = at - started
            if best is None or span < best[0]:
                best = (span, seen, redirected)
            if span <= READ_SPAN:
                break
        assert best is not None
        return best[1], best[2]

    def _ingress_seen(self, index: int) -> tuple[int, float] | None:
        """(bytes, when its message came) of link ``index``'s ingress qdisc."""
        # Linux (6.1 as this machine's) answers a qdisc dump with every qdisc of the namespace,
        # whatever link it names: on a stock host, an mq root and a child per transmit queue
        # for each multiqueue NIC, hundreds on a node of several. Only the ingress one of this
        # link is decoded (tests/bench/link_counters.py).
        seen = None
        for raw in self._stream(RTM_GETQDISC, index, 0, only=(index, TC_H_INGRESS)):
            got = ingress_bytes(raw, index)
            if got is not None:
                seen = (got, self.clock())
        return seen

    def _qdiscs(self, index: int) -> Iterator[Qdisc]:
        for raw in self._dump(RTM_GETQDISC, index, 0):
            owner, q = parse_qdisc(raw)
            if owner == index:
                yield q

    def _classes(self, index: int) -> Iterator[tuple[HtbClassState, dict[str, int]]]:
        for raw in self._dump(RTM_GETTCLASS, index, 0):
            owner, parsed = parse_class(raw)
            if owner == index and parsed is not None:
                yield parsed

    def _filters(self, index: int, parent: int) -> Iterator[FilterState]:
        for raw in self._dump(RTM_GETTFILTER, index, parent):
            owner, f = parse_filter(raw, parent)
            if owner == index and f is not None:
                yield f

    # ---- writing -------------------------------------------------------------------------
    def execute(self, actions: Sequence[Action]) -> None:
        """Run actions in order; the first failure raises ShapingError naming the action."""
        for action in actions:
            self._execute(action)

    def _execute(self, action: Action) -> None:
        match action:
            case CreateIfb(name, txqlen):
                self._link("add", ifname=name, kind="ifb", txqlen=txqlen)
                self._link("set", index=self.index(name), state="up")
            case SetLinkUp(name):
                self._link("set", index=self.index(name), state="up")
            case DeleteLink(name):
                self._link("del", index=self.index(name))
            case SetRootHtb(device, defcls):
                glob = _HTB_GLOB.pack(3, 10, defcls, 0, 0)
                self._tc(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE, _htb_tc, self.index(device),
                         0x57470000, TC_H_ROOT, 0, "htb",
                         {"attrs": [["TCA_HTB_INIT", glob]]}, what=f"htb on {device}")
            case AddIngress(device):
                self._tc(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, _tc, self.index(device),
                         0xFFFF0000, TC_H_INGRESS, 0, "ingress", None,
                         what=f"ingress qdisc on {device}")
            case DeleteQdisc(device, parent, handle, kind):
                self._tc(RTM_DELQDISC, 0, _tc, self.index(device), handle, parent, 0, None,
                         None, what=f"{kind} qdisc on {device}")
            case RestoreRoot(device, kind, handle):
                self._tc(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE, _tc, self.index(device),
                         handle, TC_H_ROOT, 0, kind, None, what=f"{kind} qdisc on {device}")
            case SetClass(device, cls, create):
                self.set_class(self.index(device), cls, create)
            case DeleteClass(device, classid):
                self._tc(RTM_DELTCLASS, 0, _tc, self.index(device), classid, 0, 0, None, None,
                         what=f"class {classid:#x} on {device}")
            case SetFilter(device, flt, create):
                self._set_filter(device, flt, create)
            case DeleteFilter(device, parent, protocol, pref, handle):
                info = (pref << 16) | socket.htons(protocol)
                self._tc(RTM_DELTFILTER, 0, _tc, self.index(device), handle, parent, info, "u32",
                         None, what=f"filter pref {pref} on {device}")
            case _:
                raise TypeError(f"not an action: {action!r}")

    def set_class(self, index: int, cls: HtbClass, create: bool = False) -> None:
        """Add or change one HTB class with every parameter: one request, one ack."""
        msg = class_message(index, cls, create)
        flags = NLM_F_CREATE | NLM_F_EXCL if create else 0
        self._request(msg, RTM_NEWTCLASS, flags, f"class {cls.name} ({cls.classid:#x})", "htb")

    def _set_filter(self, device: str, flt: Filter, create: bool) -> None:
        sel = _U32_SEL.pack(TC_U32_TERMINAL, 0, len(flt.keys), 0, 0, 0, 0, 0) + b"".join(
            _U32_KEY.pack(k.mask.to_bytes(4, "big"), k.val.to_bytes(4, "big"), k.off, k.offmask)
            for k in flt.keys)
        attrs: list[list[object]] = [["TCA_U32_SEL", sel]]
        if flt.redirect:
            mirred = _MIRRED.pack(0, 0, TC_ACT_STOLEN, 0, 0, TCA_EGRESS_REDIR,
                                  self.index(flt.redirect))
            attrs.append(["TCA_U32_ACT", {"attrs": [["TCA_ACT_PRIO_1", {"attrs": [
                ["TCA_ACT_KIND", "mirred"],
                ["TCA_ACT_OPTIONS", {"attrs": [["TCA_MIRRED_PARMS", mirred]]}]]}]]}])
        else:
            attrs.insert(0, ["TCA_U32_CLASSID", flt.classid])
        info = (flt.pref << 16) | socket.htons(flt.protocol)
        flags = NLM_F_CREATE | (NLM_F_EXCL if create else 0)
        self._tc(RTM_NEWTFILTER, flags, _u32_tc, self.index(device), flt.handle, flt.parent,
                 info, "u32", {"attrs": attrs}, what=f"u32 filter on {device}")

    def has_filter(self, index: int, parent: int, pref: int) -> bool:
        """A filter of any kind at ``pref`` under ``parent`` on link ``index`` (tcmsg's info,
        after the netlink header, carries the pref in its upper half)."""
        return any(struct.unpack_from("=I", raw, 16 + 16)[0] >> 16 == pref
                   for raw in self._dump(RTM_GETTFILTER, index, parent))

    def attach_detector(self, device: str, fd: int, name: str, pref: int) -> None:
        """The burst detector (``shaping.bpf``) on ``device``'s ingress at ``pref``, in place of
        whatever held that pref (a detector a crashed agent left: its program goes with it).
        Direct action: the program's verdict (TC_ACT_UNSPEC) lets every packet on."""
        self.detach_detector(device, pref)
        info = (pref << 16) | socket.htons(ETH_P_ALL)
        self._tc(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, _bpf_tc, self.index(device), 1,
                 INGRESS_HANDLE, info, "bpf",
                 {"attrs": [["TCA_BPF_FD", fd], ["TCA_BPF_NAME", name],
                            ["TCA_BPF_FLAGS", TCA_BPF_FLAG_ACT_DIRECT]]},
                 what=f"burst detector on {device}")

    def detach_detector(self, device: str, pref: int) -> None:
        """Removes the filters at ``pref`` on ``device``'s ingress; none there is no error."""
        try:
            self._tc(RTM_DELTFILTER, 0, _tc, self.index(device), 0, INGRESS_HANDLE,
                     pref << 16, None, None, what=f"burst detector on {device}")
        except ShapingError as e:
            if e.code not in (errno.ENOENT, errno.EINVAL):
                raise

    # ---- transport -----------------------------------------------------------------------
    def index(self, name: str) -> int:
        found = self.ipr.link_lookup(ifname=name)
        if not found:
            raise ShapingError(f"no interface {name!r} on this host (see `ip link`)")
        return int(found[0])

    def _link(self, command: str, **kwarg: object) -> None:
        try:
            self.ipr.link(command, **kwarg)
        except NetlinkError as e:
            what = f"ip link {command} {kwarg.get('ifname') or kwarg.get('index')}"
            if e.code in (errno.EPERM, errno.EACCES):
                raise ShapingError(f"{what}: permission denied. {NET_ADMIN_HINT}") from None
            if command == "add" and e.code in (errno.EOPNOTSUPP, errno.ENOENT, errno.EINVAL):
                raise ShapingError(f"{what}: this kernel can't create an ifb device (load the "
                                   "module: modprobe ifb; kernel option CONFIG_IFB)") from None
            raise ShapingError(f"{what}: {e}") from None

    def _tc(self, msg_type: int, flags: int, cls: type[nlmsg], index: int, handle: int,
            parent: int, info: int, kind: str | None, options: dict | None,
            extra: list | None = None, what: str = "") -> None:
        if index <= 0:
            # Index 0 means "every link" to some kernel paths: never send it.
            raise ShapingError(f"{what}: no interface index")
        msg = cls()
        msg["family"], msg["index"], msg["handle"] = socket.AF_UNSPEC, index, handle
        msg["parent"], msg["info"] = parent, info
        attrs: list[list[object]] = []
        if kind:
            attrs.append(["TCA_KIND", kind])
        if options is not None:
            attrs.append(["TCA_OPTIONS", options])
        msg["attrs"] = attrs + (extra or [])
        self._request(msg, msg_type, flags, what, kind or "")

    def _request(self, msg: nlmsg, msg_type: int, flags: int, what: str, kind: str) -> None:
        seq = next(self._seq)
        msg["header"]["type"] = msg_type
        msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
        msg["header"]["sequence_number"] = seq
        msg.encode()
        self._sock.send(bytes(msg.data))
        for mtype, mflags, mseq, body in self._replies():
            if mseq == seq and mtype == NLMSG_ERROR:
                code = -struct.unpack_from("=i", body)[0]
                if code:
                    raise tc_error(code, _ext_ack(body, mflags), what, kind, msg_type)
                return

    def _dump(self, msg_type: int, index: int, parent: int,
              only: tuple[int, int] | None = None) -> list[bytes]:
        """Raw messages of one dump (recorded as-is under tests/unit/data/netlink/). With
        ``only`` (a link index and a parent), just that tc object's messages: the others are
        passed over by their headers, never copied or decoded."""
        return list(self._stream(msg_type, index, parent, only))

    def _stream(self, msg_type: int, index: int, parent: int,
                only: tuple[int, int] | None = None) -> Iterator[bytes]:
        """``_dump``'s messages as they come (read it to its end: the dump must be drained)."""
        seq = next(self._seq)
        # A bare tcmsg, packed by hand: this runs every backoff tick (pyroute2's encoder costs
        # more than the dump itself).
        self._sock.send(struct.pack("=IHHII", 16 + _TCMSG.size, msg_type,
                                    NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
                        + _TCMSG.pack(socket.AF_UNSPEC, index, 0, parent, 0))
        tcmsg = _TCMSG.unpack_from
        for mtype, mflags, mseq, data, start, end in self._frames():
            if mseq != seq:
                continue
            if mtype == NLMSG_DONE:
                break
            if mtype == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, start)[0]
                if code:
                    raise tc_error(code, _ext_ack(data[start:end], mflags), "reading tc state",
                                   "", msg_type)
                break
            if only is not None:
                if end - start < _TCMSG.size:
                    continue
                _family, owner, _handle, of, _info = tcmsg(data, start)
                if (owner, of) != only:
                    continue
            yield struct.pack("=IHHII", 16 + end - start, mtype, 0, mseq, 0) + data[start:end]

    def _replies(self) -> Iterator[tuple[int, int, int, bytes]]:
        for mtype, flags, seq, data, start, end in self._frames():
            yield mtype, flags, seq, data[start:end]

    def _frames(self) -> Iterator[tuple[int, int, int, bytes, int, int]]:
        """(type, flags, sequence, the datagram, where the body starts, where it ends) of each
        message received, the body left in place."""
        while True:
            try:
                # Into one buffer kept for the socket's life: a fresh 1 MiB per recv (mapped,
                # faulted in, unmapped) cost more than the dump, every backoff tick.
                n = self._sock.recv_into(self._buf)
            except TimeoutError:
                raise ShapingError("netlink: no answer from the kernel within 10 s") from None
            data = bytes(memoryview(self._buf)[:n])
            off = 0
            while off + 16 <= n:
                length, mtype, flags, seq, _pid = _NLMSGHDR.unpack_from(data, off)
                if length < 16 or off + length > n:
                    break
                yield mtype, flags, seq, data, off + 16, off + length
                off += (length + 3) & ~3


def class_message(index: int, cls: HtbClass, create: bool) -> nlmsg:
    """RTM_NEWTCLASS body for an HTB class: every parameter, 64-bit rates as TCA_HTB_RATE64."""
    rate, ceil = cls.rate // 8, cls.ceil // 8
    parms = _HTB_OPT.pack(0, LINKLAYER_ETHERNET, 0, 0, 0, min(rate, U32_MAX),
                          0, LINKLAYER_ETHERNET, 0, 0, 0, min(ceil, U32_MAX),
                          bytes_to_ticks(cls.burst, cls.rate),
                          bytes_to_ticks(cls.cburst, cls.ceil), cls.quantum, 0, cls.prio)
    attrs: list[list[object]] = [["TCA_HTB_PARMS", parms]]
    if rate > U32_MAX:
        attrs.append(["TCA_HTB_RATE64", rate])
    if ceil > U32_MAX:
        attrs.append(["TCA_HTB_CEIL64", ceil])
    msg = _htb_tc()
    msg["family"], msg["index"], msg["handle"] = socket.AF_UNSPEC, index, cls.classid
    msg["parent"], msg["info"] = cls.parent, 0
    msg["attrs"] = [["TCA_KIND", "htb"], ["TCA_OPTIONS", {"attrs": attrs}]]
    if create:
        # A rate estimator (every 1 s, averaged over ~4 s) so stats() can report a current
        # rate; left out on change, where the kernel keeps the one it has.
        msg["attrs"].append(["TCA_RATE", _ESTIMATOR.pack(0, 2)])
    return msg


def decode(raw: bytes) -> nlmsg:
    """A raw tc message (header included), decoded with the class its TCA_KIND calls for."""
    msg = _BY_KIND.get(_kind_of(raw), _tc)(raw)
    msg.decode()
    return msg


def parse_qdisc(raw: bytes) -> tuple[int, Qdisc]:
    msg = decode(raw)
    kind = str(_attr(msg, "TCA_KIND", ""))
    defcls = 0
    if kind == "htb":
        opts = msg.get_attr("TCA_OPTIONS")
        glob = opts.get_attr("TCA_HTB_INIT") if opts is not None else None
        if glob:
            defcls = _HTB_GLOB.unpack_from(glob)[2]
    return msg["index"], Qdisc(kind, msg["handle"], msg["parent"], defcls)


def parse_class(raw: bytes) -> tuple[int, tuple[HtbClassState, dict[str, int]] | None]:
    """One RTM_NEWTCLASS message (header included): its link, and the HTB class with its
    counters (None: not an HTB class). Decoded by hand, not by pyroute2: the backoff tick reads
    the egress class every tick, and `wagent status` every class of every tree (pyroute2's
    decoding took 20-30 ms a status on the emulated cluster, a quarter of a daemon's CPU)."""
    _family, index, handle, parent, info = _TCMSG.unpack_from(raw, 16)
    top = (16 + _TCMSG.size, len(raw))
    kind = _find(raw, TCA_KIND, *top)
    if kind is None or raw[kind[0]:kind[1]].rstrip(b"\0") != b"htb":
        return index, None
    opts = _find(raw, TCA_OPTIONS, *top)
    parms = _find(raw, TCA_HTB_PARMS, *opts) if opts else None
    if opts is None or parms is None or parms[1] - parms[0] < _HTB_OPT.size:
        return index, None
    p = _HTB_OPT.unpack_from(raw, parms[0])
    rate = _u64(raw, _find(raw, TCA_HTB_RATE64, *opts)) or p[5]
    ceil = _u64(raw, _find(raw, TCA_HTB_CEIL64, *opts)) or p[11]
    # A top-level class reports parent TC_H_ROOT; it was added under the qdisc's handle.
    parent = handle & 0xFFFF0000 if parent == TC_H_ROOT else parent
    cls = HtbClassState(handle, parent, rate, ceil, p[12], p[13], p[14], p[16], info)
    return index, (cls, _class_stats(raw, _find(raw, TCA_STATS2, *top)))


def parse_filter(raw: bytes, parent: int) -> tuple[int, FilterState | None]:
    msg = decode(raw)
    if _attr(msg, "TCA_KIND") != "u32":
        return msg["index"], None
    info = msg["info"]
    opts = msg.get_attr("TCA_OPTIONS")
    keys: tuple[U32Key, ...] = ()
    classid = redirect = 0
    if opts is not None:
        sel = opts.get_attr("TCA_U32_SEL")
        if sel:
            nkeys = _U32_SEL.unpack_from(sel)[2]
            keys = tuple(_key(*_U32_KEY.unpack_from(sel, _U32_SEL.size + 16 * i))
                         for i in range(nkeys))
        classid = opts.get_attr("TCA_U32_CLASSID") or 0
        redirect = _redirect_of(opts.get_attr("TCA_U32_ACT"))
    return msg["index"], FilterState(parent, socket.ntohs(info & 0xFFFF), info >> 16,
                                     msg["handle"], "u32", classid, keys, redirect)


# -- hand-decoded counters (the backoff tick's hot path) -------------------------------------
TCA_KIND, TCA_OPTIONS, TCA_STATS2 = 1, 2, 7
TCA_STATS_BASIC, TCA_STATS_RATE_EST, TCA_STATS_QUEUE = 1, 2, 3
TCA_STATS_RATE_EST64, TCA_STATS_PKT64 = 5, 8
TCA_HTB_PARMS, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 6, 7
TCA_U32_ACT = 7
TCA_ACT_KIND, TCA_ACT_STATS = 1, 4
_NLMSGHDR = struct.Struct("=IHHII")                              # length, type, flags, seq, pid
_TCMSG = struct.Struct("=BxxxiIII")                              # family, index, handle, parent,
_NLA = struct.Struct("=HH")                                      # info
_BASIC = struct.Struct("=QI")                                    # struct gnet_stats_basic
_QUEUE = struct.Struct("=IIIII")                                 # struct gnet_stats_queue
_U32, _U64 = struct.Struct("=I"), struct.Struct("=Q")


def _nlas(data: bytes, off: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(type, start, end) of the attributes in data[off:end]; the nested flag is dropped."""
    end = len(data) if end is None else end
    while off + 4 <= end:
        length, kind = _NLA.unpack_from(data, off)
        if length < 4 or off + length > end:
            return
        yield kind & 0x3FFF, off + 4, off + length
        off += (length + 3) & ~3


def _find(data: bytes, kind: int, off: int, end: int) -> tuple[int, int] | None:
    # The loop of _nlas written out: this runs a few dozen times every backoff tick.
    unpack = _NLA.unpack_from
    while off + 4 <= end:
        length, k = unpack(data, off)
        if length < 4 or off + length > end:
            return None
        if k & 0x3FFF == kind:
            return off + 4, off + length
        off += (length + 3) & ~3
    return None


def _u64(raw: bytes, span: tuple[int, int] | None) -> int | None:
    if span is None or span[1] - span[0] < 8:
        return None
    return int(_U64.unpack_from(raw, span[0])[0])


def _class_stats(raw: bytes, stats: tuple[int, int] | None) -> dict[str, int]:
    """A class's TCA_STATS2: bytes, packets, the queue's drops, overlimits and backlog, and the
    rate estimator's bits/s (0 without one)."""
    out = {"bytes": 0, "packets": 0, "drops": 0, "overlimits": 0, "backlog": 0, "rate": 0}
    if stats is None:
        return out
    basic = _find(raw, TCA_STATS_BASIC, *stats)
    if basic is not None and basic[1] - basic[0] >= _BASIC.size:
        out["bytes"], out["packets"] = _BASIC.unpack_from(raw, basic[0])
    pkt64 = _u64(raw, _find(raw, TCA_STATS_PKT64, *stats))
    if pkt64:
        out["packets"] = pkt64
    queue = _find(raw, TCA_STATS_QUEUE, *stats)
    if queue is not None and queue[1] - queue[0] >= _QUEUE.size:
        _qlen, out["backlog"], out["drops"], _req, out["overlimits"] = _QUEUE.unpack_from(
            raw, queue[0])
    est64 = _u64(raw, _find(raw, TCA_STATS_RATE_EST64, *stats))
    est = _find(raw, TCA_STATS_RATE_EST, *stats)
    if est64:
        out["rate"] = est64 * 8
    elif est is not None and est[1] - est[0] >= 4:
        out["rate"] = _U32.unpack_from(raw, est[0])[0] * 8
    return out


def _basic_bytes(raw: bytes, stats: tuple[int, int] | None) -> int | None:
    basic = _find(raw, TCA_STATS_BASIC, *stats) if stats else None
    if basic is None or basic[1] - basic[0] < _BASIC.size:
        return None
    return _BASIC.unpack_from(raw, basic[0])[0]


def ingress_bytes(raw: bytes, index: int) -> int | None:
    """Bytes counted by the ingress qdisc of link ``index`` in one RTM_NEWQDISC message (header
    included); None for any other qdisc."""
    _family, owner, _handle, parent, _info = _TCMSG.unpack_from(raw, 16)
    if owner != index or parent != TC_H_INGRESS:
        return None
    kind = _find(raw, TCA_KIND, 16 + _TCMSG.size, len(raw))
    if kind is None or raw[kind[0]:kind[1]].rstrip(b"\0") not in (b"ingress", b"clsact"):
        return None
    return _basic_bytes(raw, _find(raw, TCA_STATS2, 16 + _TCMSG.size, len(raw)))


def mirred_bytes(raw: bytes, index: int) -> int:
    """Bytes counted by the mirred actions of one RTM_NEWTFILTER message (a u32 knode on link
    ``index``); 0 for hash tables and filters without one."""
    _family, owner, _handle, _parent, _info = _TCMSG.unpack_from(raw, 16)
    if owner != index:
        return 0
    opts = _find(raw, TCA_OPTIONS, 16 + _TCMSG.size, len(raw))
    acts = _find(raw, TCA_U32_ACT, *opts) if opts else None
    if acts is None:
        return 0
    total = 0
    for _prio, a, b in _nlas(raw, *acts):
        kind = _find(raw, TCA_ACT_KIND, a, b)
        if kind is None or raw[kind[0]:kind[1]].rstrip(b"\0") != b"mirred":
            continue
        total += _basic_bytes(raw, _find(raw, TCA_ACT_STATS, a, b)) or 0
    return total


def _key(mask: bytes, val: bytes, off: int, offmask: int) -> U32Key:
    return U32Key(int.from_bytes(val, "big"), int.from_bytes(mask, "big"), off, offmask)


def _redirect_of(actions: nla | None) -> int:
    if actions is None:
        return 0
    for _name, act in actions["attrs"]:
        if not isinstance(act, nla) or act.get_attr("TCA_ACT_KIND") != "mirred":
            continue
        opts = act.get_attr("TCA_ACT_OPTIONS")
        parms = opts.get_attr("TCA_MIRRED_PARMS") if opts is not None else None
        if parms:
            return _MIRRED.unpack_from(parms)[6]
    return 0


def _ext_ack(body: bytes, flags: int) -> str:
    """The kernel's own words from an extended ack (NLMSGERR_ATTR_MSG), if it sent any."""
    if len(body) < 20 or not flags & 0x200:          # NLM_F_ACK_TLVS
        return ""
    orig_len = struct.unpack_from("=I", body, 4)[0]
    off = 4 + (16 if flags & 0x100 else (orig_len + 3) & ~3)   # NLM_F_CAPPED
    while off + 4 <= len(body):
        length, atype = struct.unpack_from("=HH", body, off)
        if length < 4:
            break
        if atype == NLMSGERR_ATTR_MSG:
            return body[off + 4:off + length].rstrip(b"\0").decode("utf-8", "replace")
        off += (length + 3) & ~3
    return ""


def tc_error(code: int, kernel: str, what: str, kind: str, msg_type: int) -> ShapingError:
    err = _tc_error(code, kernel, what, kind, msg_type)
    err.code = code
    return err


def _tc_error(code: int, kernel: str, what: str, kind: str, msg_type: int) -> ShapingError:
    detail = f"{os.strerror(code)}" + (f" ({kernel})" if kernel else "")
    if code in (errno.EPERM, errno.EACCES):
        return ShapingError(f"{what}: permission denied. {NET_ADMIN_HINT}")
    if code == errno.ENOENT and msg_type == RTM_NEWQDISC and kind and "unknown" in kernel.lower():
        module = {"htb": "sch_htb", "ingress": "sch_ingress"}.get(kind, f"sch_{kind}")
        return ShapingError(f"{what}: this kernel has no {kind} qdisc (load it: modprobe "
                            f"{module}); {detail}")
    if code == errno.ENOENT and msg_type == RTM_NEWTFILTER and "unknown" in kernel.lower():
        return ShapingError(f"{what}: this kernel lacks the u32 classifier or the mirred action "
                            f"(modprobe cls_u32 act_mirred); {detail}")
    return ShapingError(f"{what}: {detail}")
