"""The tc trees wagent wants, as values, and the steps from what the kernel has to what it wants.

Pure: policy in, ``TcPlan`` out; ``TcPlan`` + observed ``Device`` values in, a list of actions out.
The adapter (``shaping.netlink``) executes the actions; ``render`` prints them as the equivalent
``tc``/``ip`` command lines for ``wagent shaping apply --dry-run``.

One tree per direction, same shape on both::

    htb 5747: (default 5747:10)            on eth0 (egress, serving ports)
     └─ 5747:1   rate = ceil = link_rate       or on the IFB wg-eth0 (ingress, pulled ports)
         ├─ 5747:10  default:      prio 0, rate link_rate - dist rate, ceil link_rate
         └─ 5747:20  distribution: prio 7, rate 0.2% (2mbit), ceil 500mbit  <- u32 sport filters

Ingress: ``ingress`` qdisc on eth0 whose u32 filters match only distribution traffic (TCP from a
pulled port, IPv4 and IPv6, the same keys as the HTB filters) and redirect it (mirred egress) to
wg-eth0, whose own egress HTB tree does the shaping. Everything else (training traffic, tens to
hundreds of Gbit/s) never enters the single-queue IFB: wagent stays out of its way. The IFB tree
keeps its default class as a safety net. Older wagent redirected everything with one match-all
filter (protocol all, pref 10); ``reconcile`` adopts it and swaps it for the port filters.
The handle major 0x5747 ("WG") and the IFB's name are how wagent recognises its own objects
after a crash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from agent.policy.model import LEAST_HTB_RATE, Shaping, Source
from shaping.errors import PlanError
from shaping.observed import FilterState, HtbClassState, U32Key

MAJOR = 0x5747
ROOT_HANDLE = MAJOR << 16
ROOT_CLASS = ROOT_HANDLE | 0x1
DEFAULT_CLASS = ROOT_HANDLE | 0x10
DIST_CLASS = ROOT_HANDLE | 0x20
INGRESS_HANDLE = 0xFFFF0000
ETH_P_ALL, ETH_P_IP, ETH_P_IPV6 = 0x0003, 0x0800, 0x86DD
PREF_V4, PREF_V6 = 10, 11
# Ingress redirect filters. u32 keeps one table per (pref, protocol) and refuses a second protocol
# on a pref in use, so these can't share pref 10 with the old match-all redirect (PREF_LEGACY):
# while both are installed the match-all (lower pref) wins, so the switch never uncaps anything.
PREF_REDIRECT_V4, PREF_REDIRECT_V6, PREF_LEGACY = 20, 21, 10
IFB_TXQLEN = 1000                        # ifb's own default is 32 packets: drops at 500 Mbit/s
IPPROTO_TCP = 6

MTU = 1600                               # what tc adds to its default burst
BURST_TIME_US = 5000                     # bucket depth: 5 ms at the rate, plus two MTUs
QUANTUM_MIN, QUANTUM_MAX = 1600, 200000  # outside this the kernel warns (when it computes it)
TICKS_PER_SECOND = 15_625_000            # psched ticks: 64 ns since Linux 2.6.31

# Root qdiscs the kernel attaches by itself; replacing them takes nothing from anyone.
DEFAULT_KINDS = frozenset({"noqueue", "pfifo_fast", "fq_codel", "fq", "mq", "noop"})
# Kinds wagent re-creates (with kernel-default parameters) when it restores a taken-over root.
# mq comes back with the default qdisc (net.core.default_qdisc) on each queue.
RESTORABLE_KINDS = frozenset({"pfifo", "bfifo", "pfifo_fast", "fq_codel", "fq", "sfq", "codel",
                              "cake", "mq"})


@dataclass(frozen=True)
class HtbClass:
    name: str                            # "root", "default", "distribution"
    classid: int
    parent: int
    rate: int                            # bits/s
    ceil: int                            # bits/s
    prio: int
    burst: int                           # bytes
    cburst: int                          # bytes
    quantum: int                         # bytes

    def matches(self, have: HtbClassState) -> bool:
        return (have.parent == self.parent and have.rate == self.rate // 8
                and have.ceil == self.ceil // 8 and have.prio == self.prio
                and have.quantum == self.quantum
                and have.buffer == bytes_to_ticks(self.burst, self.rate)
                and have.cbuffer == bytes_to_ticks(self.cburst, self.ceil))


@dataclass(frozen=True)
class Filter:
    """A u32 knode: ``keys`` all match -> ``classid``, or -> redirect to the device ``redirect``."""

    parent: int
    protocol: int
    pref: int
    handle: int                          # node id; the kernel puts it in the pref's own table
    keys: tuple[U32Key, ...]
    classid: int = 0
    redirect: str = ""

    def matches(self, have: FilterState, ifindex: Mapping[str, int]) -> bool:
        target = ifindex.get(self.redirect, -1) if self.redirect else 0
        return (have.keys == self.keys and have.classid == self.classid
                and have.redirect_ifindex == target)


@dataclass(frozen=True)
class Tree:
    device: str
    ports: tuple[int, ...]
    classes: tuple[HtbClass, ...]        # parents before children
    filters: tuple[Filter, ...]

    def distribution(self) -> HtbClass:
        return next(c for c in self.classes if c.classid == DIST_CLASS)


@dataclass(frozen=True)
class InterfacePlan:
    interface: str
    egress: Tree | None                  # on the interface itself
    ingress: Tree | None                 # on the IFB
    ifb: str = ""
    redirects: tuple[Filter, ...] = ()   # on the interface's ingress qdisc: distribution only


@dataclass(frozen=True)
class TcPlan:
    interfaces: tuple[InterfacePlan, ...] = ()
    take_over: bool = False

    def trees(self) -> list[Tree]:
        return [t for ip in self.interfaces for t in (ip.egress, ip.ingress) if t is not None]


# Actions: one netlink request each (CreateIfb: two, create and set up).
@dataclass(frozen=True)
class CreateIfb:
    name: str
    txqlen: int = IFB_TXQLEN


@dataclass(frozen=True)
class SetLinkUp:
    name: str


@dataclass(frozen=True)
class DeleteLink:
    name: str


@dataclass(frozen=True)
class SetRootHtb:
    device: str
    defcls: int = DEFAULT_CLASS & 0xFFFF


@dataclass(frozen=True)
class AddIngress:
    device: str


@dataclass(frozen=True)
class DeleteQdisc:
    device: str
    parent: int
    handle: int
    kind: str


@dataclass(frozen=True)
class RestoreRoot:
    device: str
    kind: str
    handle: int


@dataclass(frozen=True)
class SetClass:
    device: str
    cls: HtbClass
    create: bool


@dataclass(frozen=True)
class DeleteClass:
    device: str
    classid: int


@dataclass(frozen=True)
class SetFilter:
    device: str
    filter: Filter
    create: bool


@dataclass(frozen=True)
class DeleteFilter:
    device: str
    parent: int
    protocol: int
    pref: int
    handle: int


Action = (CreateIfb | SetLinkUp | DeleteLink | SetRootHtb | AddIngress | DeleteQdisc | RestoreRoot
          | SetClass | DeleteClass | SetFilter | DeleteFilter)


def handle_str(handle: int) -> str:
    return f"{handle >> 16:x}:{handle & 0xFFFF:x}" if handle & 0xFFFF else f"{handle >> 16:x}:"


def bytes_to_ticks(size: int, rate_bits: int) -> int:
    """HTB's bucket depth in psched ticks, exactly as tc computes it (time to send ``size`` at
    the rate, truncated to whole microseconds first), so the dry run's tc lines build the very
    same classes."""
    micros = size * 1_000_000 // max(rate_bits // 8, 1)
    return micros * TICKS_PER_SECOND // 1_000_000


def ticks_to_bytes(ticks: int, rate_bytes: int) -> int:
    return ticks * rate_bytes // TICKS_PER_SECOND


def burst_for(rate_bits: int) -> int:
    """Bytes HTB may send at once: 5 ms at the rate plus two MTUs.

    tc's default is ``rate/HZ + mtu`` with HZ read from /proc/net/psched, which modern kernels
    report as 1e9: the bucket shrinks to one MTU, and above ~13 Gbit/s a tick is shorter than the
    time to send it, so throughput drops. A few ms at the rate rides over timer and scheduling
    jitter; it adds at most BURST_TIME_US of traffic above the cap, once.
    """
    return rate_bits // 8 * BURST_TIME_US // 1_000_000 + 2 * MTU


def quantum_for(rate_bits: int) -> int:
    """HTB's DRR quantum, rate/r2q (r2q=10) clamped to what the kernel accepts without a warning."""
    return min(max(rate_bits // 8 // 10, QUANTUM_MIN), QUANTUM_MAX)


def htb_class(name: str, classid: int, parent: int, rate: int, ceil: int, prio: int) -> HtbClass:
    return HtbClass(name, classid, parent, rate, ceil, prio, burst_for(rate), burst_for(ceil),
                    quantum_for(rate))


def with_ceil(cls: HtbClass, ceil: int) -> HtbClass:
    """The class with a new ceil (the backoff controller's move); rate never above the ceil."""
    if ceil < LEAST_HTB_RATE:
        raise PlanError(f"ceil {ceil} bit/s is below 1 byte/s; the smallest usable cap is 8bit")
    rate = min(cls.rate, ceil)
    return replace(cls, rate=rate, ceil=ceil, burst=burst_for(rate), cburst=burst_for(ceil),
                   quantum=quantum_for(rate))


def ifb_name(interface: str) -> str:
    """wagent's IFB for an interface: ``wg-eth0``; a long name is cut and hashed to 15 chars."""
    name = f"wg-{interface}"
    if len(name) <= 15:
        return name
    digest = hashlib.sha1(interface.encode()).hexdigest()[:5]
    return f"wg-{interface[:6]}-{digest}"


def source_ports(sources: Sequence[Source]) -> tuple[int, ...]:
    """Ports the pulls come from: each source's (and proxy's) explicit port, else 80/443."""
    ports: set[int] = set()
    for source in sources:
        try:
            base = source.base              # an s3:// source's endpoint
        except ValueError as e:
            raise PlanError(f"source {source.url!r}: {e}") from None
        for url in (base, source.proxy):
            if not url:
                continue
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError as e:
                raise PlanError(f"source {url!r}: bad port ({e})") from None
            ports.add(port or (443 if parts.scheme == "https" else 80))
    return tuple(sorted(ports))


def build_plan(shaping: Shaping, sources: Sequence[Source] = ()) -> TcPlan:
    """The trees for every interface the policy names; nothing if shaping is disabled."""
    if not shaping.enabled:
        return TcPlan((), shaping.take_over)
    _check_rates(shaping)
    pull_ports = _checked_ports(shaping.pull_ports or source_ports(sources), "pull_ports")
    serve_ports = _checked_ports(shaping.serve_ports, "serve_ports")
    plans = []
    ifbs: dict[str, str] = {}
    for interface in shaping.interfaces:
        if not interface or len(interface) > 15 or "/" in interface or " " in interface:
            raise PlanError(f"shaping.interfaces: {interface!r} is not an interface name "
                            "(1 to 15 characters, no '/' or spaces)")
        if pull_ports:
            # A cut name can equal another interface's (or a named interface): one IFB would
            # then carry two interfaces' ingress, and clearing one would drop the other's.
            clash = ifbs.get(ifb_name(interface)) or (
                ifb_name(interface) if ifb_name(interface) in shaping.interfaces else None)
            if clash is not None:
                raise PlanError(f"shaping.interfaces: {interface!r} and {clash!r} would share "
                                f"wagent's IFB {ifb_name(interface)!r}; rename one of them")
            ifbs[ifb_name(interface)] = interface
        egress = _tree(interface, serve_ports, shaping) if serve_ports else None
        ifb, ingress, redirects = "", None, ()
        if pull_ports:
            ifb = ifb_name(interface)
            ingress = _tree(ifb, pull_ports, shaping)
            redirects = _redirects(ifb, pull_ports)
        plans.append(InterfacePlan(interface, egress, ingress, ifb, redirects))
    return TcPlan(tuple(plans), shaping.take_over)


def _check_rates(s: Shaping) -> None:
    for key, value in (("link_rate", s.link_rate), ("rate", s.rate), ("ceil", s.ceil)):
        if not isinstance(value, int) or value < LEAST_HTB_RATE:
            raise PlanError(f"shaping.{key}: {value!r} is not a rate of at least 8bit "
                            "(write e.g. 10gbit, 500mbit)")
    if s.rate >= s.link_rate:
        raise PlanError(f"shaping.rate ({s.rate} bit/s) must be below shaping.link_rate "
                        f"({s.link_rate} bit/s): the rest is the default class's guarantee")
    if not 0 <= s.priority <= 7:
        raise PlanError(f"shaping.priority: {s.priority} is not an HTB priority (0..7)")


def _checked_ports(ports: Sequence[int], key: str) -> tuple[int, ...]:
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise PlanError(f"shaping.{key}: {port!r} is not a port (1..65535)")
    if len(set(ports)) > 2000:
        raise PlanError(f"shaping.{key}: more than 2000 ports; list the sources' ports only")
    return tuple(sorted(set(ports)))


def _tree(device: str, ports: tuple[int, ...], s: Shaping) -> Tree:
    classes = (
        htb_class("root", ROOT_CLASS, ROOT_HANDLE, s.link_rate, s.link_rate, 0),
        htb_class("default", DEFAULT_CLASS, ROOT_CLASS, s.link_rate - s.rate, s.link_rate, 0),
        htb_class("distribution", DIST_CLASS, ROOT_CLASS, s.rate, max(s.ceil, s.rate),
                  s.priority),
    )
    filters = []
    for i, port in enumerate(ports, start=1):
        filters.append(Filter(ROOT_HANDLE, ETH_P_IP, PREF_V4, i, sport_keys_v4(port),
                              DIST_CLASS))
        filters.append(Filter(ROOT_HANDLE, ETH_P_IPV6, PREF_V6, i,
                              sport_keys_v6(port), DIST_CLASS))
    return Tree(device, ports, classes, tuple(filters))


def _redirects(ifb: str, ports: tuple[int, ...]) -> tuple[Filter, ...]:
    """The ingress filters: distribution packets (and only those) go to the IFB."""
    filters = []
    for i, port in enumerate(ports, start=1):
        filters.append(Filter(INGRESS_HANDLE, ETH_P_IP, PREF_REDIRECT_V4, i,
                              sport_keys_v4(port), redirect=ifb))
        filters.append(Filter(INGRESS_HANDLE, ETH_P_IPV6, PREF_REDIRECT_V6, i,
                              sport_keys_v6(port), redirect=ifb))
    return tuple(filters)


def legacy_redirect(ifb: str) -> Filter:
    """The match-all redirect older wagent versions installed (every packet to the IFB)."""
    return Filter(INGRESS_HANDLE, ETH_P_ALL, PREF_LEGACY, 1, (U32Key(0, 0, 0),), redirect=ifb)


def sport_keys_v4(port: int) -> tuple[U32Key, ...]:
    """TCP source port over IPv4, header without options (tc's ``match ip sport`` reads offset 20).

    u32 can follow the IHL only through a linked hash table (nexthdr offsets apply after a
    ``link``), so instead the filter requires IHL=5 and a first fragment: a packet with IP options
    (practically never seen on TCP data) falls to the default class rather than being misread;
    on ingress such a packet is not redirected at all, so it passes uncapped.
    """
    return (U32Key(0x05000000, 0x0F000000, 0),          # version/IHL: IHL = 5
            U32Key(0x00000000, 0x00001FFF, 4),          # fragment offset 0
            U32Key(IPPROTO_TCP << 16, 0x00FF0000, 8),   # protocol
            U32Key(port << 16, 0xFFFF0000, 20))         # source port


def sport_keys_v6(port: int) -> tuple[U32Key, ...]:
    """TCP source port over IPv6. u32 can't walk extension headers, so the transport header is
    taken at the fixed offset 40: packets with extension headers fall to the default class (on
    ingress: are not redirected, so pass uncapped)."""
    return (U32Key(IPPROTO_TCP << 8, 0x0000FF00, 4),   # next header = TCP
            U32Key(port << 16, 0xFFFF0000, 40))
