"""The adapter's parsers and encoder on recorded kernel dumps (no root, no kernel needed).

The dumps come from a real apply (see data/netlink/README.md); they carry TCA_HTB_RATE64/CEIL64
attributes that Debian's pyroute2 0.7.2 can't decode by itself: run this file under
/usr/bin/python3 as well.
"""

from __future__ import annotations

import errno
import struct
from pathlib import Path

from agent.policy.model import Shaping
from shaping.netlink import (
    RTM_NEWQDISC,
    class_message,
    decode,
    parse_class,
    parse_filter,
    parse_qdisc,
    tc_error,
)
from shaping.observed import TC_H_INGRESS, TC_H_ROOT, Device, FilterState, HtbClassState, Qdisc
from shaping.plan import (
    DIST_CLASS,
    ETH_P_ALL,
    ETH_P_IP,
    ETH_P_IPV6,
    INGRESS_HANDLE,
    ROOT_HANDLE,
    DeleteFilter,
    SetFilter,
    build_plan,
    bytes_to_ticks,
    sport_keys_v4,
)
from shaping.reconcile import reconcile

DATA = Path(__file__).parent / "data" / "netlink"
GBIT = 10**9
POLICY = Shaping(enabled=True, interfaces=("veth0",), link_rate=400 * GBIT, rate=GBIT,
                 ceil=100 * GBIT, serve_ports=(8080, 9000), pull_ports=(443,))


def raws(name: str) -> list[bytes]:
    return [bytes.fromhex(line) for line in (DATA / f"{name}.hex").read_text().split()]


def recorded_veth0() -> Device:
    qdiscs = tuple(q for i, q in map(parse_qdisc, raws("qdiscs")) if i == 3)
    classes = tuple(c for _, (c, _st) in map(parse_class, raws("classes_veth0")))
    filters = tuple(f for _, f in (parse_filter(r, ROOT_HANDLE)
                                   for r in raws("filters_veth0_root")) if f)
    filters += tuple(f for _, f in (parse_filter(r, 0xFFFF0000)
                                    for r in raws("filters_veth0_ingress")) if f)
    return Device("veth0", True, 3, "veth", True, 1000, qdiscs, classes, filters)


def test_qdiscs():
    parsed = [parse_qdisc(r) for r in raws("qdiscs")]
    assert (3, Qdisc("htb", ROOT_HANDLE, TC_H_ROOT, 0x10)) in parsed
    assert (3, Qdisc("ingress", 0xFFFF0000, TC_H_INGRESS, 0)) in parsed


def test_classes_with_64_bit_rates():
    by_id = {c.classid: c for _, (c, _st) in map(parse_class, raws("classes_veth0"))}
    dist = by_id[DIST_CLASS]
    assert (dist.rate, dist.ceil, dist.prio) == (GBIT // 8, 100 * GBIT // 8, 7)
    assert by_id[ROOT_HANDLE | 1].ceil == 400 * GBIT // 8
    assert by_id[ROOT_HANDLE | 1].parent == ROOT_HANDLE


def test_filters_ports_and_redirect():
    root = [f for _, f in (parse_filter(r, ROOT_HANDLE) for r in raws("filters_veth0_root")) if f]
    knodes = [f for f in root if f.handle & 0xFFF]
    assert {(f.protocol, f.handle & 0xFFF) for f in knodes} == {
        (ETH_P_IP, 1), (ETH_P_IP, 2), (ETH_P_IPV6, 1), (ETH_P_IPV6, 2)}
    assert next(f for f in knodes if f.protocol == ETH_P_IP and f.handle & 0xFFF == 1).keys \
        == sport_keys_v4(8080)
    ingress = [f for _, f in (parse_filter(r, 0xFFFF0000)
                              for r in raws("filters_veth0_ingress")) if f and f.handle & 0xFFF]
    assert [(f.protocol, f.redirect_ifindex) for f in ingress] == [(ETH_P_ALL, 4)]


def test_recorded_state_reconciles_to_nothing():
    ip = build_plan(POLICY).interfaces[0]
    egress_only = type(ip)(ip.interface, ip.egress, None)
    assert reconcile(egress_only, {"veth0": recorded_veth0()}, False) == ([], [])


def test_recorded_old_match_all_redirect_becomes_port_filters():
    """The recorded dump is from a wagent that redirected all ingress to the IFB (ifindex 4)."""
    ip = build_plan(POLICY).interfaces[0]
    tree = ip.ingress
    classes = tuple(HtbClassState(c.classid, c.parent, c.rate // 8, c.ceil // 8,
                                  bytes_to_ticks(c.burst, c.rate),
                                  bytes_to_ticks(c.cburst, c.ceil), c.quantum, c.prio)
                    for c in tree.classes)
    filters = tuple(FilterState(f.parent, f.protocol, f.pref, 0x80000000 | (f.pref - 10) << 20
                                | f.handle, "u32", f.classid, f.keys) for f in tree.filters)
    box = Device(ip.ifb, True, 4, "ifb", True, 1000,
                 (Qdisc("htb", ROOT_HANDLE, TC_H_ROOT, 0x10),), classes, filters)
    actions, notes = reconcile(ip, {"veth0": recorded_veth0(), ip.ifb: box}, False)
    assert notes == []
    assert actions == [SetFilter("veth0", f, create=True) for f in ip.redirects] + [
        DeleteFilter("veth0", INGRESS_HANDLE, ETH_P_ALL, 10, 0)]


def test_class_message_round_trip_above_2_to_the_32_bytes_per_second():
    dist = build_plan(POLICY).interfaces[0].egress.distribution()
    msg = class_message(3, dist, create=True)
    msg["header"]["type"] = 40
    msg.encode()
    index, (cls, _stats) = parse_class(bytes(msg.data))
    assert index == 3 and dist.matches(cls)
    assert decode(bytes(msg.data)).get_attr("TCA_RATE") is not None


def test_error_words():
    e = tc_error(errno.EPERM, "", "htb on eth0", "htb", RTM_NEWQDISC)
    assert "CAP_NET_ADMIN" in str(e) and "AmbientCapabilities" in str(e)
    e = tc_error(errno.ENOENT, "Specified qdisc kind is unknown", "htb on eth0", "htb",
                  RTM_NEWQDISC)
    assert "modprobe sch_htb" in str(e)


def test_ingress_counters_decoded_by_hand():
    from shaping.netlink import ingress_bytes, mirred_bytes

    # Recorded with `tc -s` beside them: the ingress qdisc had counted 12656567 bytes, the
    # IPv4 redirect's mirred 57079, the IPv6 one's 0 (see data/netlink/README.md).
    seen = [b for b in (ingress_bytes(m, 2) for m in raws("qdiscs_ingress_counters"))
            if b is not None]
    assert seen == [12656567]
    assert sum(mirred_bytes(m, 2) for m in raws("filters_ingress_counters")) == 57079
    assert [ingress_bytes(m, 3) for m in raws("qdiscs_ingress_counters")] == [None] * 4
    assert all(mirred_bytes(m, 3) == 0 for m in raws("filters_ingress_counters"))


def test_class_counters_decoded_by_hand_match_pyroute2():
    """parse_class reads a class by hand (the backoff tick and `wagent status` run it); the
    recorded classes, counters and all, read the same through pyroute2's decoder (live
    counters: tests/integration/test_shaping.py)."""
    for raw in raws("classes_veth0"):
        msg = decode(raw)
        _, parsed = parse_class(raw)
        assert parsed is not None
        cls, st = parsed
        opts = msg.get_attr("TCA_OPTIONS")
        parms = struct.unpack_from("=BBHhHIBBHhHIIIIII", opts.get_attr("TCA_HTB_PARMS"))
        assert cls.rate == (opts.get_attr("TCA_HTB_RATE64") or parms[5])
        assert cls.ceil == (opts.get_attr("TCA_HTB_CEIL64") or parms[11])
        assert (cls.classid, cls.leaf, cls.quantum, cls.prio) == (msg["handle"], msg["info"],
                                                                  parms[14], parms[16])
        stats = msg.get_attr("TCA_STATS2")
        basic = stats.get_attr("TCA_STATS_BASIC")
        queue = stats.get_attr("TCA_STATS_QUEUE")
        assert (st["bytes"], st["packets"]) == struct.unpack_from("=QI", basic)
        _qlen, backlog, drops, _req, overlimits = struct.unpack_from("=IIIII", queue)
        assert (st["backlog"], st["drops"], st["overlimits"]) == (backlog, drops, overlimits)


def test_a_qdisc_dump_of_a_crowded_namespace_decodes_only_the_ingress_it_reads():
    """Linux answers a qdisc dump with every qdisc of the namespace, whatever link it names (a
    stock multiqueue NIC: an mq root and a child per queue). The counters read every tick take
    the ingress qdisc of their link and pass over the rest by their headers."""
    import itertools
    import socket
    import struct

    from shaping.netlink import NLMSG_DONE, RTM_GETQDISC, TC_H_INGRESS, Netlink

    def answer(seq: int, copies: int, name: str = "qdiscs_ingress_counters") -> bytes:
        # The recorded dump, its messages repeated as a crowded namespace's would be, then
        # DONE, all under the request's sequence number.
        msgs = raws(name)
        crowd = [m for m in msgs if struct.unpack_from("=i", m, 20)[0] != 2] * copies
        out = b""
        for m in crowd + msgs + [struct.pack("=IHHII", 20, NLMSG_DONE, 2, 0, 0) + bytes(4)]:
            m = m[:8] + struct.pack("=I", seq) + m[12:]
            out += m + bytes(-len(m) % 4)
        return out

    with Netlink() as nl:
        kernel, nl._sock = nl._sock, None
        kernel.close()
        nl._sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        with peer:
            nl._seq = itertools.count(7)
            peer.send(answer(7, 100))
            assert nl._ingress_seen(2)[0] == 12656567
            peer.send(answer(8, 100))
            assert nl._dump(RTM_GETQDISC, 2, 0, only=(3, TC_H_INGRESS)) == []
            peer.send(answer(9, 0))
            everything = nl._dump(RTM_GETQDISC, 2, 0)
            assert [m[16:] for m in everything] == [m[16:] for m in
                                                    raws("qdiscs_ingress_counters")]
            # A tick's read: the ingress filters' mirred bytes, then the qdiscs' dump.
            peer.send(answer(10, 0, "filters_ingress_counters"))
            peer.send(answer(11, 100))
            assert nl.ingress_counters(2) == (12656567, 57079)


def test_a_ceil_set_past_the_shapers_policy_stays_at_the_policys():
    """A backoff tick decided under the previous policy may set its ceil just after a reload
    applied a lower one: the shaper of the new policy holds its own bound."""
    from shaping.shaper import Shaper

    class Recorder:
        def __init__(self) -> None:
            self.ceils: list[int] = []

        def set_class(self, index: int, cls) -> None:
            self.ceils.append(cls.ceil)

        def index(self, name: str) -> int:
            return 3

    nl = Recorder()
    policy = Shaping(enabled=True, interfaces=("veth0",), link_rate=GBIT, ceil=20 * 10**6,
                     serve_ports=(8080,))
    shaper = Shaper(policy, (), "/nonexistent", netlink=lambda: nl)
    shaper.set_ceil(40 * 10**6)
    assert shaper.ceil == 20 * 10**6 and set(nl.ceils) == {20 * 10**6}
    shaper.set_ceil(5 * 10**6)
    assert shaper.ceil == 5 * 10**6 and nl.ceils[-1] == 5 * 10**6
