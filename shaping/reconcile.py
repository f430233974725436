"""From what the kernel has to what the plan wants (or to what was there before wagent): pure.

``reconcile`` never deletes and re-adds a root qdisc of wagent's (that leaves the link unshaped
for a moment and stops its queues): classes are changed in place, filters replaced by handle.
A root qdisc that is neither the kernel's default nor wagent's belongs to someone else and is
left alone unless the policy says ``take_over``; the caller reports the note.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from shaping.errors import PlanError
from shaping.observed import TC_H_INGRESS, TC_H_ROOT, Device, FilterState, Qdisc
from shaping.plan import (
    DEFAULT_KINDS,
    ETH_P_ALL,
    ETH_P_IP,
    ETH_P_IPV6,
    INGRESS_HANDLE,
    MAJOR,
    PREF_LEGACY,
    PREF_REDIRECT_V4,
    PREF_REDIRECT_V6,
    RESTORABLE_KINDS,
    Action,
    AddIngress,
    CreateIfb,
    DeleteClass,
    DeleteFilter,
    DeleteLink,
    DeleteQdisc,
    Filter,
    InterfacePlan,
    RestoreRoot,
    SetClass,
    SetFilter,
    SetLinkUp,
    SetRootHtb,
    Tree,
    handle_str,
    legacy_redirect,
)

# (pref, protocol) of wagent's ingress redirect filters, today's and the old match-all's.
_REDIRECT_SLOTS = frozenset({(PREF_REDIRECT_V4, ETH_P_IP), (PREF_REDIRECT_V6, ETH_P_IPV6),
                             (PREF_LEGACY, ETH_P_ALL)})


@dataclass(frozen=True)
class Original:
    """The root qdisc an interface had before wagent's first apply (recorded in the state dir)."""

    kind: str
    handle: int

    @property
    def kernel_default(self) -> bool:
        return self.kind in DEFAULT_KINDS and self.handle == 0


def is_wagent_root(q: Qdisc | None) -> bool:
    return q is not None and q.kind == "htb" and q.handle >> 16 == MAJOR


def replaceable(q: Qdisc | None) -> bool:
    """No root qdisc, the kernel's own, or wagent's: nobody else's shaping is lost by replacing.

    The kernel's own root always has handle 0:; a qdisc someone added by hand gets a handle
    (8001: and up when they named none), so a tuned ``fq_codel 8001:`` or an ``mq 100:`` with
    its own children is someone's configuration, not a default."""
    return (q is None or (q.kind in DEFAULT_KINDS and q.handle == 0)
            or is_wagent_root(q))


def reconcile(ip: InterfacePlan, devices: Mapping[str, Device],
              take_over: bool) -> tuple[list[Action], list[str]]:
    """Actions that bring one interface (and its IFB) to the plan, and notes of what was skipped."""
    dev = devices[ip.interface]
    if not dev.exists:
        raise PlanError(f"shaping.interfaces: no interface {ip.interface!r} on this host "
                        "(see `ip link`); fix the policy or create the link first")
    actions: list[Action] = []
    notes: list[str] = []
    ifindex = {d.name: d.index for d in devices.values() if d.exists}
    if ip.egress is not None:
        actions += _tree(ip.egress, dev, take_over, notes, ifindex, owned=False)
    if ip.ingress is not None and ip.redirects:
        actions += _ingress(ip, dev, devices[ip.ifb], take_over, notes, ifindex)
    return actions, notes


def is_wagent_redirect(f: FilterState) -> bool:
    """A redirect of wagent's shape on an ingress qdisc, even if it points at a since re-created
    IFB: a port filter in wagent's prefs, or the old match-all."""
    if f.parent != INGRESS_HANDLE or not f.redirect_ifindex or not f.handle & 0xFFF:
        return False
    if (f.pref, f.protocol) == (PREF_LEGACY, ETH_P_ALL):
        return f.keys == legacy_redirect("").keys
    return (f.pref, f.protocol) in _REDIRECT_SLOTS


def _ingress(ip: InterfacePlan, dev: Device, ifb: Device, take_over: bool, notes: list[str],
             ifindex: Mapping[str, int]) -> list[Action]:
    assert ip.ingress is not None
    ing = dev.ingress()
    ours = [f for f in dev.filters if is_wagent_redirect(f)]
    others = [f for f in dev.filters if f.parent == INGRESS_HANDLE and f.handle & 0xFFF
              and f not in ours]
    front: list[Action] = []
    if ing is not None and (ing.kind != "ingress" or others):
        what = f"{ing.kind} qdisc with {len(others)} filter(s) not wagent's"
        if not take_over:
            notes.append(f"{dev.name}: ingress has a {what}; left alone, pulls on it are not "
                         "capped (set shaping.take_over: true to replace it)")
            return []
        notes.append(f"{dev.name}: replacing the ingress {what} (shaping.take_over is set)")
        front.append(DeleteQdisc(dev.name, TC_H_INGRESS, INGRESS_HANDLE, ing.kind))
        ing, ours = None, []
    actions: list[Action] = []
    if not ifb.exists:
        actions.append(CreateIfb(ip.ifb))
    elif ifb.kind != "ifb":
        raise PlanError(f"{ip.ifb!r} exists and is a {ifb.kind or 'physical'} link, not wagent's "
                        f"IFB for {dev.name}; rename or remove it")
    elif not ifb.up:
        actions.append(SetLinkUp(ip.ifb))
    actions += _tree(ip.ingress, ifb, True, notes, ifindex, owned=True)
    # The redirects go last, so packets never reach an IFB without its tree.
    actions += front
    if ing is None:
        actions.append(AddIngress(dev.name))
    have = {(f.protocol, f.pref, f.handle & 0xFFF): f for f in ours}
    wanted = {(f.protocol, f.pref, f.handle): f for f in ip.redirects}
    for key, flt in wanted.items():
        have_f = have.get(key)
        if have_f is None:
            actions.append(SetFilter(dev.name, flt, create=True))
        elif not flt.matches(have_f, ifindex):
            # Replaced in place under its kernel handle: no moment without the redirect.
            actions.append(SetFilter(dev.name, replace(flt, handle=have_f.handle), create=False))
    # Deletions last: the old match-all (pref 10) is ahead of the port filters and catches the
    # distribution traffic until it goes, so between the two steps all traffic still reaches
    # the IFB's cap; deleting it first would let pulls pass uncapped in between.
    for key, have_f in have.items():
        if key not in wanted:
            # The old match-all's whole pref goes (handle 0): deleting just its node would
            # leave an empty u32 table that every arriving packet still walks.
            legacy = (have_f.pref, have_f.protocol) == (PREF_LEGACY, ETH_P_ALL)
            actions.append(DeleteFilter(dev.name, have_f.parent, have_f.protocol, have_f.pref,
                                        0 if legacy else have_f.handle))
    return actions


def _tree(tree: Tree, dev: Device, take_over: bool, notes: list[str],
          ifindex: Mapping[str, int], owned: bool) -> list[Action]:
    root = dev.root() if dev.exists else None
    actions: list[Action] = []
    fresh = not is_wagent_root(root)
    if fresh:
        if root is not None and not replaceable(root) and not owned:
            if not take_over:
                notes.append(f"{dev.name}: root qdisc {root.kind} {handle_str(root.handle)} is "
                             "neither the kernel's default nor wagent's; left alone, its "
                             "egress is not capped (set shaping.take_over: true to replace it)")
                return []
            notes.append(f"{dev.name}: replacing root qdisc {root.kind} "
                         f"{handle_str(root.handle)} (shaping.take_over is set)")
        actions.append(SetRootHtb(tree.device))
    classes = {} if fresh else {c.classid: c for c in dev.classes}
    filters = {} if fresh else {(f.protocol, f.pref, f.handle & 0xFFF): f for f in dev.filters
                                if f.parent == tree.filters[0].parent and f.handle & 0xFFF}
    for cls in tree.classes:
        have = classes.get(cls.classid)
        if have is not None and have.parent != cls.parent:
            # HTB can't move a class; only a damaged tree gets here.
            actions.append(DeleteClass(tree.device, cls.classid))
            have = None
        if have is None or not cls.matches(have):
            actions.append(SetClass(tree.device, cls, create=have is None))
    wanted: dict[tuple[int, int, int], Filter] = {
        (f.protocol, f.pref, f.handle): f for f in tree.filters}
    for key, flt in wanted.items():
        have_f = filters.get(key)
        if have_f is None:
            actions.append(SetFilter(tree.device, flt, create=True))
        elif not flt.matches(have_f, ifindex):
            actions.append(SetFilter(tree.device, replace(flt, handle=have_f.handle), False))
    for key, have_f in filters.items():
        if key not in wanted:
            actions.append(DeleteFilter(tree.device, have_f.parent, have_f.protocol,
                                        have_f.pref, have_f.handle))
    known = {c.classid for c in tree.classes}
    for have in sorted(classes.values(), key=lambda c: -c.classid):
        if have.classid not in known and have.classid >> 16 == MAJOR:
            actions.append(DeleteClass(tree.device, have.classid))
    return actions


def clear(interface: str, ifb: str, devices: Mapping[str, Device],
          original: Original | None) -> tuple[list[Action], list[str]]:
    """Actions that remove what wagent made on one interface and put back ``original``."""
    dev = devices.get(interface, Device(interface, exists=False))
    box = devices.get(ifb, Device(ifb, exists=False))
    actions: list[Action] = []
    notes: list[str] = []
    if dev.exists:
        ing = dev.ingress()
        # A redirect to wagent's IFB, or of wagent's shape to a device that is gone (it would
        # drop every packet arriving on the interface if left behind).
        ours = any(f.parent == INGRESS_HANDLE and f.redirect_ifindex
                   and (f.redirect_ifindex == box.index if box.exists
                        else is_wagent_redirect(f))
                   for f in dev.filters)
        if ing is not None and ing.kind == "ingress" and ours:
            actions.append(DeleteQdisc(interface, TC_H_INGRESS, INGRESS_HANDLE, "ingress"))
    if box.exists and box.kind == "ifb":
        actions.append(DeleteLink(ifb))
    if not dev.exists:
        notes.append(f"{interface}: no such interface any more; nothing to restore")
        return actions, notes
    root = dev.root()
    if not is_wagent_root(root):
        return actions, notes
    assert root is not None
    if original is None or original.kernel_default:
        actions.append(DeleteQdisc(interface, TC_H_ROOT, root.handle, "htb"))
    elif original.kind in RESTORABLE_KINDS:
        actions.append(RestoreRoot(interface, original.kind, original.handle))
        notes.append(f"{interface}: restored root qdisc {original.kind} "
                     f"{handle_str(original.handle)} with kernel-default parameters")
    else:
        actions.append(DeleteQdisc(interface, TC_H_ROOT, root.handle, "htb"))
        notes.append(f"{interface}: the original root qdisc {original.kind} "
                     f"{handle_str(original.handle)} can't be re-created by wagent; the kernel's "
                     "default is in place now, re-apply your own shaping")
    return actions, notes
