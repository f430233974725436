"""The shaping API the daemon, the backoff loop and ``wagent shaping`` call.

>>> shaper = Shaper(policy.shaping, policy.sources, policy.state_dir)     # doctest: +SKIP
>>> report = shaper.apply()          # reconcile: adopt wagent's tree, change classes in place
>>> shaper.set_ceil(50_000_000)      # the backoff controller's move: one netlink call per tree
>>> shaper.stats()                   # per class bytes, packets, drops, overlimits, backlog, rate
>>> shaper.counters()                # {"eth0": LinkCounters(rx_dist, tx_dist, rx_seen)}: a tick
>>> shaper.clear()                   # remove wagent's trees, IFBs; put back the original roots

Plans are pure (``shaping.plan``, ``shaping.reconcile``); this module only wires them to the
netlink adapter and the state file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from agent.policy.model import Shaping, Source
from shaping import state
from shaping.bpf import DETECTOR_NAME, DETECTOR_PREF
from shaping.errors import ShapingError
from shaping.netlink import Netlink
from shaping.observed import ClassStats, Device, LinkCounters, Qdisc
from shaping.plan import (
    DIST_CLASS,
    ETH_P_IP,
    ETH_P_IPV6,
    INGRESS_HANDLE,
    Action,
    TcPlan,
    Tree,
    build_plan,
    handle_str,
    ifb_name,
    ticks_to_bytes,
    with_ceil,
)
from shaping.reconcile import Original, clear, is_wagent_root, reconcile
from shaping.render import render

log = logging.getLogger(__name__)
SHOW_VERSION = 1
_NAMES = {0x1: "root", 0x10: "default", DIST_CLASS & 0xFFFF: "distribution"}


@dataclass(frozen=True)
class ApplyReport:
    actions: tuple[Action, ...] = ()
    notes: tuple[str, ...] = ()
    dry_run: bool = False
    adopted: tuple[str, ...] = ()        # interfaces whose existing wagent tree was taken on

    @property
    def changed(self) -> bool:
        return bool(self.actions)

    @property
    def commands(self) -> list[str]:
        return [render(a) for a in self.actions]


@dataclass
class _Live:
    ceil: int | None = None
    indexes: dict[str, int] = field(default_factory=dict)


class Shaper:
    def __init__(self, shaping: Shaping, sources: Sequence[Source], state_dir: str,
                 netlink: Callable[[], Netlink] = Netlink) -> None:
        self._shaping = shaping
        self._plan = build_plan(shaping, sources)
        self._state_dir = state_dir
        self._netlink = netlink
        self._live = _Live()
        self._nl: Netlink | None = None

    @property
    def ceil(self) -> int:
        """The distribution classes' ceil now: the last set_ceil(), else the policy's."""
        return self._live.ceil if self._live.ceil is not None else self._policy_ceil

    @property
    def _policy_ceil(self) -> int:
        return max(self._shaping.ceil, self._shaping.rate)

    def plan(self) -> TcPlan:
        """The policy's plan, with the ceil the backoff controller last set."""
        if self._live.ceil is None:
            return self._plan
        return replace(self._plan, interfaces=tuple(
            replace(ip, egress=_with_ceil(ip.egress, self._live.ceil),
                    ingress=_with_ceil(ip.ingress, self._live.ceil))
            for ip in self._plan.interfaces))

    def apply(self, dry_run: bool = False, ceil: int | None = None,
              quiet: bool = False) -> ApplyReport:
        """Bring the kernel to the plan; interfaces wagent shaped and the policy no longer names
        are cleared. Safe to repeat: an unchanged plan sends nothing.

        ``ceil`` is the distribution ceil to install instead of the policy's (a reload while
        backed off keeps the backoff's ceil, so the cap never opens in between). ``quiet``
        leaves the notes to the caller to log (a periodic re-apply logs them once)."""
        if ceil is not None:
            self._live.ceil = ceil
        plan = self.plan()
        records = state.load(self._state_dir)
        actions: list[Action] = []
        notes: list[str] = []
        adopted: list[str] = []
        with self._netlink() as nl:
            links = nl.links()
            missing = [ip.interface for ip in plan.interfaces if ip.interface not in links]
            if missing and len(missing) == len(plan.interfaces):
                raise ShapingError(f"shaping.interfaces: no interface {missing[0]!r} on this "
                                   "host (see `ip link`); fix the policy or create the link")
            for ip in plan.interfaces:
                if ip.interface in missing:
                    # A fleet-wide policy may name interfaces only some nodes have.
                    notes.append(f"{ip.interface}: no such interface on this host; skipped")
                    continue
                devices = {n: nl.device(n, links) for n in (ip.interface, ip.ifb) if n}
                steps, why = reconcile(ip, devices, plan.take_over)
                notes += why
                root = devices[ip.interface].root()
                if ip.interface not in records and is_wagent_root(root):
                    # Ours from before a crash or a lost state dir: taken on, never stacked.
                    adopted.append(ip.interface)
                    log.info("%s: adopted wagent's existing tree (handle 5747:)", ip.interface)
                if (steps or ip.interface in adopted) and ip.interface not in records:
                    original = (None if root is None or is_wagent_root(root)
                                else Original(root.kind, root.handle))
                    records[ip.interface] = state.Record(ip.interface, original, ip.ifb)
                    if not dry_run:
                        state.save(self._state_dir, records)
                if not dry_run:
                    nl.execute(steps)
                actions += steps
            named = {ip.interface for ip in plan.interfaces}
            for name in sorted(set(records) - named):
                steps, why = self._clear_one(nl, links, records[name], dry_run)
                notes += why + [f"{name}: no longer in shaping.interfaces; wagent's tree removed"]
                actions += steps
                if not dry_run:
                    del records[name]
                    state.save(self._state_dir, records)
        if not quiet:
            for note in notes:
                log.warning("%s", note)
        self._live.indexes.clear()
        notes += [f"{name}: adopted wagent's existing tree (handle 5747:)" for name in adopted]
        return ApplyReport(tuple(actions), tuple(notes), dry_run, tuple(adopted))

    def detector_links(self) -> list[str]:
        """The interfaces whose ingress the burst detector watches: those with an ingress tree
        (the redirect filters before it are what tell distribution from the rest)."""
        return [ip.interface for ip in self._plan.interfaces if ip.ingress is not None]

    def attach_detector(self, fd: int, only_missing: bool = False) -> list[str]:
        """The burst detector (``shaping.bpf``, program ``fd``) on every ingress tree's
        interface, replacing any there; ``only_missing``: only where it is gone (an interface
        re-created, the ingress qdisc removed by hand). Returns the interfaces it went on."""
        nl = self._persistent()
        links = nl.links()
        done = []
        for name in self.detector_links():
            if name not in links:
                continue
            if only_missing and nl.has_filter(links[name][0], INGRESS_HANDLE, DETECTOR_PREF):
                continue
            nl.attach_detector(name, fd, DETECTOR_NAME, DETECTOR_PREF)
            done.append(name)
        return done

    def detach_detector(self) -> None:
        nl = self._persistent()
        links = nl.links()
        for name in self.detector_links():
            if name in links:
                nl.detach_detector(name, DETECTOR_PREF)

    def set_ceil(self, bits_per_s: int) -> None:
        """Move every distribution class's ceil now: one netlink request (and ack) per tree,
        resending all of the class's parameters (the kernel resets any left out). Never past
        what this shaper's policy allows: a backoff tick decided under the previous policy
        can land just after a reload's apply, and put the old cap back until the next tick
        (seen in CI: a reload from 40 to 20 Mbit/s, and tc read 40 right after it)."""
        bits_per_s = min(bits_per_s, self._policy_ceil)
        trees = self._plan.trees()
        if not trees:
            self._live.ceil = bits_per_s
            return
        nl = self._persistent()
        for tree in trees:
            cls = with_ceil(tree.distribution(), bits_per_s)
            index = self._live.indexes.get(tree.device)
            if index is not None:
                try:
                    nl.set_class(index, cls)
                    continue
                except ShapingError:
                    pass                 # the link may have been re-created: look it up again
            index = self._live.indexes[tree.device] = nl.index(tree.device)
            nl.set_class(index, cls)
        self._live.ceil = bits_per_s

    def stats(self) -> list[ClassStats]:
        """Counters of every class of wagent's trees (distribution, default, root)."""
        out = []
        nl = self._persistent()
        links = nl.links()
        for tree in self._plan.trees():
            if tree.device not in links:
                continue
            for cls, st in nl.class_stats(links[tree.device][0]):
                if cls.classid >> 16 == DIST_CLASS >> 16:
                    out.append(ClassStats(tree.device, handle_str(cls.classid),
                                          _NAMES.get(cls.classid & 0xFFFF, "?"), **st))
        return out

    def counters(self) -> dict[str, LinkCounters]:
        """What the link detector needs each tick, per interface: the ingress hook's counters
        (all arrivals, distribution arrivals) and the egress distribution class's bytes. Cheap:
        one or two dumps per interface on cached link indexes, decoded by hand."""
        out: dict[str, LinkCounters] = {}
        nl = self._persistent()
        for ip in self._plan.interfaces:
            rx_seen = rx_dist = None
            if ip.ingress is not None:
                got = self._on_link(nl, ip.interface, nl.ingress_counters)
                if got is not None:
                    rx_seen, rx_dist = got
            tx_dist = 0
            if ip.egress is not None:
                tx_dist = sum(_arrived(st) for cls, st in self._on_link(
                    nl, ip.interface, nl.class_stats) or () if cls.classid == DIST_CLASS)
            if rx_seen is None and ip.egress is None:
                continue                 # nothing of ours to tell apart on this interface
            out[ip.interface] = LinkCounters(rx_dist or 0, tx_dist, rx_seen)
        return out

    def _on_link(self, nl: Netlink, name: str, read: Callable[[int], object]) -> object:
        """``read(index)`` of a link, by its cached index; looked up again once if the link
        was re-created (its old index is gone); None when it doesn't exist."""
        index = self._live.indexes.get(name)
        if index is not None:
            try:
                return read(index)
            except ShapingError:
                pass
        try:
            index = self._live.indexes[name] = nl.index(name)
        except ShapingError:
            return None
        return read(index)

    def show(self) -> dict:
        """wagent's trees as the kernel has them (JSON-able, versioned)."""
        records = state.load(self._state_dir)
        out: dict = {"version": SHOW_VERSION, "interfaces": []}
        with self._netlink() as nl:
            links = nl.links()
            names = self._known(nl, links, records)
            for name in names:
                dev = nl.device(name, links)
                rec = records.get(name)
                ifb = rec.ifb if rec and rec.ifb else ifb_name(name)
                box = nl.device(ifb, links)
                root = dev.root()
                entry = {
                    "interface": name,
                    "exists": dev.exists,
                    "root": _qdisc(root),
                    "wagent": is_wagent_root(root),
                    "original": ({"kind": rec.original.kind,
                                  "handle": handle_str(rec.original.handle)}
                                 if rec and rec.original else None),
                    "egress": _tree(dev, nl) if is_wagent_root(root) else None,
                    "ifb": ifb if box.exists else None,
                    "redirect": any(f.parent == INGRESS_HANDLE and box.exists
                                    and f.redirect_ifindex == box.index for f in dev.filters),
                    "ingress": _tree(box, nl) if is_wagent_root(box.root()) else None,
                }
                out["interfaces"].append(entry)
        return out

    def clear(self) -> list[str]:
        """Remove everything wagent made; put back each interface's original root qdisc.
        Returns notes (also logged)."""
        records = state.load(self._state_dir)
        notes: list[str] = []
        self.close()
        with self._netlink() as nl:
            links = nl.links()
            for name in self._known(nl, links, records):
                rec = records.get(name) or state.Record(name, None, ifb_name(name))
                _steps, why = self._clear_one(nl, links, rec, dry_run=False)
                notes += why
                if name in records:
                    del records[name]
                    state.save(self._state_dir, records)
        for note in notes:
            log.warning("%s", note)
        return notes

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None
        self._live.indexes.clear()

    # ---------------------------------------------------------------------------------------
    def _persistent(self) -> Netlink:
        if self._nl is None:
            self._nl = self._netlink()
        return self._nl

    def _known(self, nl: Netlink, links: dict, records: dict[str, state.Record]) -> list[str]:
        """Interfaces wagent has business with: the policy's, the recorded ones, and any link
        carrying a tree with wagent's handle (found after the state was lost)."""
        names = {ip.interface for ip in self._plan.interfaces} | set(records)
        nl_roots = nl.wagent_roots()
        for name, (_index, kind, _up, _txqlen) in links.items():
            if kind == "ifb" and name.startswith("wg-"):
                continue
            if name not in names and _index in nl_roots:
                names.add(name)
        return sorted(names)

    def _clear_one(self, nl: Netlink, links: dict, rec: state.Record,
                   dry_run: bool) -> tuple[list[Action], list[str]]:
        ifb = rec.ifb or ifb_name(rec.interface)
        devices = {n: nl.device(n, links) for n in (rec.interface, ifb)}
        steps, notes = clear(rec.interface, ifb, devices, rec.original)
        if not dry_run:
            nl.execute(steps)
        return steps, notes


def _arrived(st: dict[str, int]) -> int:
    """Bytes that reached an HTB class: sent, queued, and dropped (drops counted in packets of
    the class's mean size, an estimate: a dropped GSO packet is counted once)."""
    mean_packet = st["bytes"] // st["packets"] if st["packets"] else 1500
    return st["bytes"] + st["backlog"] + st["drops"] * mean_packet


def _with_ceil(tree: Tree | None, ceil: int) -> Tree | None:
    if tree is None:
        return None
    return replace(tree, classes=tuple(with_ceil(c, ceil) if c.classid == DIST_CLASS else c
                                       for c in tree.classes))


def _qdisc(q: Qdisc | None) -> dict | None:
    if q is None:
        return None
    return {"kind": q.kind, "handle": handle_str(q.handle)}


def _tree(dev: Device, nl: Netlink) -> dict:
    stats = {c.classid: st for c, st in nl.class_stats(dev.index)}
    classes = []
    for c in sorted(dev.classes, key=lambda c: c.classid):
        st = stats.get(c.classid, {})
        classes.append({
            "classid": handle_str(c.classid), "name": _NAMES.get(c.classid & 0xFFFF, "?"),
            "parent": handle_str(c.parent), "rate": c.rate * 8, "ceil": c.ceil * 8,
            "burst": ticks_to_bytes(c.buffer, c.rate), "cburst": ticks_to_bytes(c.cbuffer, c.ceil),
            "quantum": c.quantum, "prio": c.prio, "stats": st})
    ports: dict[str, list[int]] = {"ip": [], "ipv6": []}
    root = dev.root()
    for f in dev.filters:
        if root is None or f.parent != root.handle:
            continue
        family = {ETH_P_IP: "ip", ETH_P_IPV6: "ipv6"}.get(f.protocol)
        at = 20 if family == "ip" else 40
        for k in f.keys:
            if family and k.off == at and k.mask == 0xFFFF0000:
                ports[family].append(k.val >> 16)
    return {"device": dev.name, "classes": classes,
            "ports": {k: sorted(v) for k, v in ports.items()}}
