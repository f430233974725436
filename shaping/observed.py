"""What the kernel has, as plain values: the adapter (``shaping.netlink``) dumps into these and the
pure diff (``shaping.reconcile``) reads them. No pyroute2 types leak past the adapter.

Handles are the kernel's 32-bit ``major:minor`` integers (``0x57470020`` is ``5747:20``). HTB
``buffer``/``cbuffer`` are kept in the kernel's unit, psched ticks (64 ns), exactly as dumped, so a
comparison with the plan is exact (see ``shaping.plan.bytes_to_ticks``).
"""

from __future__ import annotations

from dataclasses import dataclass

TC_H_ROOT = 0xFFFFFFFF
TC_H_INGRESS = 0xFFFFFFF1


@dataclass(frozen=True)
class Qdisc:
    kind: str
    handle: int
    parent: int
    defcls: int = 0                      # htb only: minor of the default class


@dataclass(frozen=True)
class HtbClassState:
    classid: int
    parent: int
    rate: int                            # bytes/s, 64-bit (TCA_HTB_RATE64 folded in)
    ceil: int                            # bytes/s
    buffer: int                          # psched ticks
    cbuffer: int                         # psched ticks
    quantum: int
    prio: int
    leaf: int = 0                        # handle of the leaf qdisc, 0 for inner classes


@dataclass(frozen=True)
class U32Key:
    val: int
    mask: int
    off: int
    offmask: int = 0


@dataclass(frozen=True)
class FilterState:
    parent: int
    protocol: int                        # ETH_P_* in host order
    pref: int
    handle: int                          # u32 knode handle (800::1); node id 0 = a hash table
    kind: str = "u32"
    classid: int = 0
    keys: tuple[U32Key, ...] = ()
    redirect_ifindex: int = 0            # mirred egress redirect target, 0 if none


@dataclass(frozen=True)
class ClassStats:
    """Counters of one HTB class; ``rate`` is the kernel's estimate in bits/s (0 if none)."""

    device: str
    classid: str                         # "5747:20"
    name: str                            # "distribution", "default", "root" or "?"
    bytes: int
    packets: int
    drops: int
    overlimits: int
    backlog: int                         # bytes queued
    rate: int                            # bits/s


@dataclass(frozen=True)
class LinkCounters:
    """Cumulative counters of one shaped interface for the link detector (bytes).

    ``rx_seen`` and ``rx_dist`` come from the same hook (the ingress qdisc and its redirects),
    so ``rx_seen - rx_dist`` is exactly what arrived that is not distribution traffic; without
    an ingress hook ``rx_seen`` is None and the link's own rx_bytes stands in."""

    rx_dist: int = 0                     # distribution bytes that arrived
    tx_dist: int = 0                     # distribution bytes sent (the egress class)
    rx_seen: int | None = None           # every byte that arrived, as the ingress hook counts


@dataclass(frozen=True)
class Device:
    """One link and its tc objects. ``exists`` False: no such link (then the rest is empty)."""

    name: str
    exists: bool = True
    index: int = 0
    kind: str = ""                       # IFLA_INFO_KIND: "ifb", "veth", "" for physical
    up: bool = True
    txqlen: int = 0
    qdiscs: tuple[Qdisc, ...] = ()
    classes: tuple[HtbClassState, ...] = ()
    filters: tuple[FilterState, ...] = ()

    def root(self) -> Qdisc | None:
        return next((q for q in self.qdiscs if q.parent == TC_H_ROOT), None)

    def ingress(self) -> Qdisc | None:
        return next((q for q in self.qdiscs if q.parent == TC_H_INGRESS), None)
