"""Actions as the equivalent ``ip``/``tc`` command lines, for ``wagent shaping apply --dry-run``.

wagent itself never runs these: it sends the same requests over netlink. They are here so a person
can read, diff or replay a plan.
"""

from __future__ import annotations

from shaping.observed import TC_H_INGRESS, U32Key
from shaping.plan import (
    ETH_P_ALL,
    ETH_P_IP,
    ETH_P_IPV6,
    Action,
    AddIngress,
    CreateIfb,
    DeleteClass,
    DeleteFilter,
    DeleteLink,
    DeleteQdisc,
    Filter,
    RestoreRoot,
    SetClass,
    SetFilter,
    SetLinkUp,
    SetRootHtb,
    handle_str,
)

_PROTOCOLS = {ETH_P_ALL: "all", ETH_P_IP: "ip", ETH_P_IPV6: "ipv6"}


def render(action: Action) -> str:
    match action:
        case CreateIfb(name, txqlen):
            return f"ip link add {name} txqueuelen {txqlen} type ifb && ip link set {name} up"
        case SetLinkUp(name):
            return f"ip link set {name} up"
        case DeleteLink(name):
            return f"ip link del {name}"
        case SetRootHtb(device, defcls):
            return f"tc qdisc replace dev {device} root handle 5747: htb default {defcls:x}"
        case AddIngress(device):
            return f"tc qdisc add dev {device} ingress"
        case DeleteQdisc(device, parent, handle, kind):
            where = "ingress" if parent == TC_H_INGRESS else f"root handle {handle_str(handle)}"
            return f"tc qdisc del dev {device} {where} {kind}".rstrip()
        case RestoreRoot(device, kind, handle):
            return f"tc qdisc replace dev {device} root handle {handle_str(handle)} {kind}"
        case SetClass(device, c, create):
            verb = "add" if create else "change"
            return (f"tc class {verb} dev {device} parent {handle_str(c.parent)} classid "
                    f"{handle_str(c.classid)} htb rate {c.rate}bit ceil {c.ceil}bit "
                    f"burst {c.burst}b cburst {c.cburst}b quantum {c.quantum} prio {c.prio}")
        case DeleteClass(device, classid):
            return f"tc class del dev {device} classid {handle_str(classid)}"
        case SetFilter(device, f, create):
            return _filter(device, f, "add" if create else "replace")
        case DeleteFilter(device, parent, protocol, pref, handle):
            node = f" handle {_u32_handle(handle)}" if handle else ""    # 0: the whole pref
            return (f"tc filter del dev {device} parent {handle_str(parent)} protocol "
                    f"{_PROTOCOLS.get(protocol, hex(protocol))} pref {pref}{node} u32")
    raise TypeError(f"not an action: {action!r}")


def _filter(device: str, f: Filter, verb: str) -> str:
    matches = " ".join(_match(k) for k in f.keys)
    target = (f"action mirred egress redirect dev {f.redirect}" if f.redirect
              else f"flowid {handle_str(f.classid)}")
    return (f"tc filter {verb} dev {device} parent {handle_str(f.parent)} protocol "
            f"{_PROTOCOLS.get(f.protocol, hex(f.protocol))} pref {f.pref} handle "
            f"{_u32_handle(f.handle)} u32 {matches} {target}")


def _match(k: U32Key) -> str:
    return f"match u32 0x{k.val:08x} 0x{k.mask:08x} at {k.off}"


def _u32_handle(handle: int) -> str:
    bucket = (handle >> 12) & 0xFF
    table = f"{handle >> 20:x}" if handle >> 20 else ""
    return f"{table}:{bucket:x}:{handle & 0xFFF:x}" if bucket else f"{table}::{handle & 0xFFF:x}"
