"""The pure half of shaping: policy -> plan -> actions against observed kernel state -> tc lines."""

from __future__ import annotations

import pytest

from agent.policy.model import Shaping, Source
from shaping import state
from shaping.errors import PlanError, ShapingError
from shaping.observed import TC_H_INGRESS, TC_H_ROOT, Device, FilterState, HtbClassState, Qdisc
from shaping.plan import (
    DEFAULT_CLASS,
    DIST_CLASS,
    ETH_P_ALL,
    ETH_P_IP,
    ETH_P_IPV6,
    INGRESS_HANDLE,
    PREF_REDIRECT_V4,
    PREF_REDIRECT_V6,
    ROOT_HANDLE,
    AddIngress,
    CreateIfb,
    DeleteFilter,
    DeleteLink,
    DeleteQdisc,
    RestoreRoot,
    SetClass,
    SetFilter,
    SetLinkUp,
    SetRootHtb,
    Tree,
    build_plan,
    bytes_to_ticks,
    ifb_name,
    legacy_redirect,
    source_ports,
    sport_keys_v4,
    sport_keys_v6,
    with_ceil,
)
from shaping.reconcile import Original, clear, reconcile
from shaping.render import render

MBIT, GBIT = 10**6, 10**9


def shaping(**kw) -> Shaping:
    base = dict(enabled=True, interfaces=("eth0",), link_rate=GBIT, serve_ports=(8080,),
                pull_ports=(443,), rate=10 * MBIT, ceil=500 * MBIT, priority=7)
    return Shaping(**{**base, **kw})


# ---- simulated kernel: what a dump would return after the plan was applied --------------------
def kernel_tree(tree: Tree, index: int, ifindex: dict[str, int] | None = None) -> Device:
    classes = tuple(HtbClassState(c.classid, c.parent, c.rate // 8, c.ceil // 8,
                                  bytes_to_ticks(c.burst, c.rate), bytes_to_ticks(c.cburst, c.ceil),
                                  c.quantum, c.prio) for c in tree.classes)
    tables = {}
    filters = tuple(
        FilterState(f.parent, f.protocol, f.pref,
                    ((0x800 + tables.setdefault(f.pref, len(tables))) << 20) | f.handle,
                    "u32", f.classid, f.keys)
        for f in tree.filters)
    return Device(tree.device, True, index, "ifb" if tree.device.startswith("wg-") else "",
                  True, 1000, (Qdisc("htb", ROOT_HANDLE, TC_H_ROOT, 0x10),), classes, filters)


def applied(plan_shaping: Shaping, legacy: bool = False) -> dict[str, Device]:
    """The kernel after an apply; ``legacy``: by an older wagent (one match-all redirect)."""
    ip = build_plan(plan_shaping).interfaces[0]
    eth = kernel_tree(ip.egress, 2) if ip.egress else Device("eth0", True, 2)
    box = kernel_tree(ip.ingress, 7)
    tables = {}                          # the ingress block numbers its own tables from 800:
    redirects = (legacy_redirect(ip.ifb),) if legacy else ip.redirects
    filters = tuple(
        FilterState(f.parent, f.protocol, f.pref,
                    ((0x800 + tables.setdefault(f.pref, len(tables))) << 20) | f.handle,
                    "u32", 0, f.keys, redirect_ifindex=7)
        for f in redirects)
    eth = Device("eth0", True, 2, "", True, 1000,
                 eth.qdiscs + (Qdisc("ingress", INGRESS_HANDLE, TC_H_INGRESS),), eth.classes,
                 eth.filters + filters)
    return {"eth0": eth, ip.ifb: box}


def fresh(root: Qdisc | None = Qdisc("mq", 0, TC_H_ROOT)) -> dict[str, Device]:
    return {"eth0": Device("eth0", True, 2, "", True, 1000, (root,) if root else ()),
            "wg-eth0": Device("wg-eth0", exists=False)}


# ---- plan ------------------------------------------------------------------------------------
def test_disabled_plans_nothing():
    assert build_plan(shaping(enabled=False)).interfaces == ()


def test_tree_shape_and_parameters():
    ip = build_plan(shaping()).interfaces[0]
    assert ip.ifb == "wg-eth0" and ip.egress.device == "eth0" and ip.ingress.device == "wg-eth0"
    root, default, dist = ip.egress.classes
    assert (root.rate, root.ceil) == (GBIT, GBIT)
    assert (default.rate, default.ceil, default.prio) == (GBIT - 10 * MBIT, GBIT, 0)
    assert (dist.rate, dist.ceil, dist.prio) == (10 * MBIT, 500 * MBIT, 7)
    assert ip.egress.ports == (8080,) and ip.ingress.ports == (443,)
    # one IPv4 and one IPv6 filter per port, both to the distribution class
    assert {(f.protocol, f.classid) for f in ip.ingress.filters} == {(0x0800, DIST_CLASS),
                                                                    (0x86DD, DIST_CLASS)}
    # the ingress redirects: only TCP from the pulled ports, IPv4 and IPv6, never match-all
    assert [(f.protocol, f.pref, f.handle, f.keys, f.redirect) for f in ip.redirects] == [
        (ETH_P_IP, PREF_REDIRECT_V4, 1, sport_keys_v4(443), "wg-eth0"),
        (ETH_P_IPV6, PREF_REDIRECT_V6, 1, sport_keys_v6(443), "wg-eth0")]
    assert sport_keys_v6(443)[-1].off == 40              # fixed offset: no extension headers
    two = build_plan(shaping(pull_ports=(443, 8443))).interfaces[0].redirects
    assert [(f.protocol, f.handle) for f in two] == [(ETH_P_IP, 1), (ETH_P_IPV6, 1),
                                                     (ETH_P_IP, 2), (ETH_P_IPV6, 2)]


def test_no_serve_ports_no_egress_tree_and_pull_ports_from_sources():
    s = shaping(serve_ports=(), pull_ports=())
    ip = build_plan(s, [Source("https://cache.example"), Source("http://o:8081",
                                                                proxy="http://127.0.0.1:65001"),
                        Source("http://plain.example/")]).interfaces[0]
    assert ip.egress is None
    assert ip.ingress.ports == (80, 443, 8081, 65001)
    assert source_ports([]) == ()
    assert build_plan(shaping(serve_ports=(), pull_ports=())).interfaces[0].ingress is None


@pytest.mark.parametrize("link", [2000, 40 * MBIT, GBIT, 100 * GBIT])
def test_by_default_training_can_take_all_but_a_sliver_of_an_upload_at_any_link_rate(link):
    # HTB lends the link to the default class (prio 0) before the distribution class; all that
    # an upload keeps from training is its guaranteed rate: 0.2% of the link by default (a
    # fixed 10 Mbit/s was 25% of a 40 Mbit/s link), and a slow link's share still makes a class.
    s = Shaping(enabled=True, interfaces=("eth0",), link_rate=link, serve_ports=(8080,))
    root, default, dist = build_plan(s).interfaces[0].egress.classes
    assert dist.rate == max(8, link // 500) and (default.prio, dist.prio) == (0, 7)
    assert default.rate + dist.rate == root.rate == link


@pytest.mark.parametrize("rate", [MBIT, 50 * MBIT, 25 * GBIT, 100 * GBIT, 400 * GBIT])
def test_burst_and_quantum_sane_across_rates(rate):
    link = rate * 2
    ip = build_plan(shaping(link_rate=link, rate=rate // 10, ceil=rate)).interfaces[0]
    for c in ip.egress.classes:
        assert 1600 <= c.quantum <= 200000
        assert c.burst >= 3200 and c.cburst >= 3200
        # at least ~5 ms at the rate, and the kernel's u32 tick field doesn't overflow
        assert c.cburst * 8 >= c.ceil * 0.005
        assert 0 < bytes_to_ticks(c.cburst, c.ceil) < 2**32
        assert 0 < bytes_to_ticks(c.burst, c.rate) < 2**32


def test_ifb_names_fit_and_differ():
    assert ifb_name("eth0") == "wg-eth0"
    long_a, long_b = ifb_name("enp129s0f1np1"), ifb_name("enp129s0f0np0")
    assert len(long_a) <= 15 and len(long_b) <= 15 and long_a != long_b
    assert long_a == ifb_name("enp129s0f1np1")          # stable: adopted after a restart
    assert not long_a.startswith("ifb")


def test_two_interfaces_never_share_an_ifb():
    cut = ifb_name("enp129s0f1np1")                     # "wg-enp129-" + 5 hex digits
    twin = cut.removeprefix("wg-")                      # a 12-character name of its own
    assert ifb_name(twin) == cut
    with pytest.raises(PlanError, match="would share"):
        build_plan(shaping(interfaces=("enp129s0f1np1", twin)))
    with pytest.raises(PlanError, match="would share"):
        build_plan(shaping(interfaces=("eth0", "wg-eth0")))
    # egress only: no IFB, nothing shared
    assert build_plan(shaping(interfaces=("eth0", "wg-eth0"), pull_ports=())).interfaces


@pytest.mark.parametrize("kw, word", [
    (dict(rate=GBIT), "below shaping.link_rate"),
    (dict(link_rate=0), "shaping.link_rate"),
    (dict(ceil=3), "shaping.ceil"),
    (dict(priority=9), "priority"),
    (dict(serve_ports=(0,)), "serve_ports"),
    (dict(pull_ports=(70000,)), "pull_ports"),
    (dict(interfaces=("a-very-long-interface-name",)), "interface name"),
])
def test_bad_policy_values_say_what_and_how(kw, word):
    with pytest.raises(PlanError, match=word):
        build_plan(shaping(**kw))


def test_with_ceil_keeps_rate_at_most_ceil():
    dist = build_plan(shaping()).interfaces[0].egress.distribution()
    low = with_ceil(dist, 5 * MBIT)
    assert (low.rate, low.ceil) == (5 * MBIT, 5 * MBIT) and low.prio == dist.prio
    high = with_ceil(dist, 40 * GBIT)
    assert (high.rate, high.ceil) == (dist.rate, 40 * GBIT)
    with pytest.raises(PlanError):
        with_ceil(dist, 0)


# ---- reconcile -------------------------------------------------------------------------------
def test_fresh_interface_builds_both_trees_redirect_last():
    ip = build_plan(shaping()).interfaces[0]
    actions, notes = reconcile(ip, fresh(), take_over=False)
    assert notes == []
    assert actions[0] == SetRootHtb("eth0")
    kinds = [type(a).__name__ for a in actions]
    assert kinds.count("SetRootHtb") == 2 and kinds.count("SetClass") == 6
    assert kinds.count("SetFilter") == 6                 # 2 egress, 2 ingress, 2 redirects
    assert CreateIfb("wg-eth0") in actions
    assert actions.index(CreateIfb("wg-eth0")) < actions.index(SetRootHtb("wg-eth0"))
    assert actions[-3:] == [AddIngress("eth0")] + [SetFilter("eth0", f, create=True)
                                                   for f in ip.redirects]
    assert all(a.create for a in actions if isinstance(a, SetClass))


def test_same_plan_twice_changes_nothing():
    ip = build_plan(shaping()).interfaces[0]
    assert reconcile(ip, applied(shaping()), take_over=False) == ([], [])


def test_changed_ceil_changes_classes_in_place_only():
    new = shaping(ceil=200 * MBIT)
    ip = build_plan(new).interfaces[0]
    actions, _ = reconcile(ip, applied(shaping()), take_over=False)
    assert [type(a) for a in actions] == [SetClass, SetClass]
    assert {a.device for a in actions} == {"eth0", "wg-eth0"}
    assert all(not a.create and a.cls.classid == DIST_CLASS and a.cls.ceil == 200 * MBIT
               for a in actions)


def test_changed_ports_replace_filters_by_kernel_handle_and_drop_extra():
    old = applied(shaping(serve_ports=(8080, 8443)))
    ip = build_plan(shaping(serve_ports=(9000,))).interfaces[0]
    actions, _ = reconcile(ip, old, take_over=False)
    replaced = [a for a in actions if isinstance(a, SetFilter)]
    dropped = [a for a in actions if isinstance(a, DeleteFilter)]
    assert len(replaced) == 2 and not any(a.create for a in replaced)
    assert {a.filter.handle >> 20 for a in replaced} == {0x800, 0x801}
    assert len(dropped) == 2 and all(a.handle & 0xFFF == 2 for a in dropped)
    assert not any(isinstance(a, (SetRootHtb, DeleteQdisc, SetClass)) for a in actions)


def test_old_match_all_redirect_is_swapped_for_port_filters_add_first():
    ip = build_plan(shaping()).interfaces[0]
    old = applied(shaping(), legacy=True)
    actions, notes = reconcile(ip, old, take_over=False)
    assert notes == []
    # the port filters go in while the match-all (pref 10, ahead of them) still sends every
    # packet to the cap; only then the match-all goes: no moment a pull bypasses the IFB
    assert actions == [SetFilter("eth0", f, create=True) for f in ip.redirects] + [
        DeleteFilter("eth0", INGRESS_HANDLE, ETH_P_ALL, 10, 0)]
    # the whole pref 10 goes, not just its node: no empty u32 table left on the packet path
    assert render(actions[-1]) == "tc filter del dev eth0 parent ffff: protocol all pref 10 u32"
    # and once done, the same plan changes nothing
    assert reconcile(ip, applied(shaping()), take_over=False) == ([], [])


def test_changed_pull_ports_replace_redirects_in_place_and_drop_extra():
    old = applied(shaping(pull_ports=(443, 8443)))
    ip = build_plan(shaping(pull_ports=(9000,))).interfaces[0]
    actions, _ = reconcile(ip, old, take_over=False)
    on_eth = [a for a in actions if a.device == "eth0"]
    assert [type(a) for a in on_eth] == [SetFilter, SetFilter, DeleteFilter, DeleteFilter]
    assert not any(a.create for a in on_eth[:2])
    assert all(a.handle & 0xFFF == 2 and a.parent == INGRESS_HANDLE for a in on_eth[2:])
    assert on_eth[0].filter.keys == sport_keys_v4(9000)


def test_foreign_root_left_alone_unless_take_over():
    ip = build_plan(shaping(pull_ports=())).interfaces[0]
    devices = fresh(Qdisc("tbf", 0x10000, TC_H_ROOT))
    actions, notes = reconcile(ip, devices, take_over=False)
    assert actions == [] and "tbf 1:" in notes[0] and "take_over" in notes[0]
    actions, notes = reconcile(ip, devices, take_over=True)
    assert actions[0] == SetRootHtb("eth0") and "replacing" in notes[0]


def test_kernel_default_roots_are_replaced_without_take_over():
    ip = build_plan(shaping(pull_ports=())).interfaces[0]
    for kind in ("noqueue", "pfifo_fast", "fq_codel", "mq"):
        actions, notes = reconcile(ip, fresh(Qdisc(kind, 0, TC_H_ROOT)), take_over=False)
        assert actions[0] == SetRootHtb("eth0") and notes == []


def test_foreign_ingress_left_alone():
    ip = build_plan(shaping(serve_ports=())).interfaces[0]
    devices = fresh()
    devices["eth0"] = Device("eth0", True, 2, "", True, 1000,
                             (Qdisc("clsact", 0xFFFF0000, TC_H_INGRESS),))
    actions, notes = reconcile(ip, devices, take_over=False)
    assert actions == [] and "clsact" in notes[0]
    actions, _ = reconcile(ip, devices, take_over=True)
    assert DeleteQdisc("eth0", TC_H_INGRESS, INGRESS_HANDLE, "clsact") in actions


def test_ifb_down_is_brought_up_and_a_clash_is_an_error():
    ip = build_plan(shaping(serve_ports=())).interfaces[0]
    devices = applied(shaping(serve_ports=()))
    box = devices["wg-eth0"]
    devices["wg-eth0"] = Device(box.name, True, box.index, "ifb", False, 1000, box.qdiscs,
                                box.classes, box.filters)
    assert reconcile(ip, devices, False)[0] == [SetLinkUp("wg-eth0")]
    devices["wg-eth0"] = Device("wg-eth0", True, 7, "veth")
    with pytest.raises(PlanError, match="not wagent's IFB"):
        reconcile(ip, devices, False)


def test_missing_interface_is_an_error_naming_it():
    ip = build_plan(shaping()).interfaces[0]
    with pytest.raises(PlanError, match="'eth0'"):
        reconcile(ip, {"eth0": Device("eth0", exists=False),
                       "wg-eth0": Device("wg-eth0", exists=False)}, False)


def test_redirect_to_a_recreated_ifb_is_replaced():
    ip = build_plan(shaping(serve_ports=())).interfaces[0]
    devices = applied(shaping(serve_ports=()))
    devices["wg-eth0"] = Device("wg-eth0", exists=False)
    actions, _ = reconcile(ip, devices, False)
    assert actions[0] == CreateIfb("wg-eth0")
    assert all(isinstance(a, SetFilter) and not a.create for a in actions[-2:])
    assert [a.filter.handle for a in actions[-2:]] == [0x80000001, 0x80100001]


# ---- clear -----------------------------------------------------------------------------------
def test_clear_restores_the_kernel_default():
    actions, notes = clear("eth0", "wg-eth0", applied(shaping()), Original("mq", 0))
    assert actions == [DeleteQdisc("eth0", TC_H_INGRESS, INGRESS_HANDLE, "ingress"),
                       DeleteLink("wg-eth0"),
                       DeleteQdisc("eth0", TC_H_ROOT, ROOT_HANDLE, "htb")]
    assert notes == []


def test_clear_recreates_a_simple_taken_over_root_and_warns_on_others():
    actions, notes = clear("eth0", "wg-eth0", applied(shaping()), Original("fq_codel", 0x80010000))
    assert actions[-1] == RestoreRoot("eth0", "fq_codel", 0x80010000)
    # a hand-made mq (handle 100:, its own children) comes back as mq 100: with default children
    actions, notes = clear("eth0", "wg-eth0", applied(shaping()), Original("mq", 0x1000000))
    assert actions[-1] == RestoreRoot("eth0", "mq", 0x1000000)
    actions, notes = clear("eth0", "wg-eth0", applied(shaping()), Original("hfsc", 0x10000))
    assert actions[-1] == DeleteQdisc("eth0", TC_H_ROOT, ROOT_HANDLE, "htb")
    assert "hfsc" in notes[0]


def test_clear_removes_a_redirect_to_a_vanished_ifb():
    devices = applied(shaping())
    del devices["wg-eth0"]
    actions, _ = clear("eth0", "wg-eth0", devices, None)
    assert actions[0] == DeleteQdisc("eth0", TC_H_INGRESS, INGRESS_HANDLE, "ingress")
    assert DeleteLink("wg-eth0") not in actions


def test_clear_removes_an_old_match_all_redirect_to_a_vanished_ifb():
    devices = applied(shaping(), legacy=True)
    del devices["wg-eth0"]
    actions, _ = clear("eth0", "wg-eth0", devices, None)
    assert actions[0] == DeleteQdisc("eth0", TC_H_INGRESS, INGRESS_HANDLE, "ingress")


def test_clear_leaves_what_is_not_wagents():
    devices = fresh(Qdisc("tbf", 0x10000, TC_H_ROOT))
    assert clear("eth0", "wg-eth0", devices, None) == ([], [])


# ---- render ----------------------------------------------------------------------------------
def test_dry_run_lines_are_tc_commands():
    ip = build_plan(shaping(link_rate=100 * GBIT, ceil=100 * GBIT)).interfaces[0]
    lines = [render(a) for a in reconcile(ip, fresh(), False)[0]]
    assert lines[0] == "tc qdisc replace dev eth0 root handle 5747: htb default 10"
    assert any(line.startswith("tc class add dev eth0 parent 5747:1 classid 5747:20 htb rate "
                               "10000000bit ceil 100000000000bit") for line in lines)
    assert "ip link add wg-eth0 txqueuelen 1000 type ifb && ip link set wg-eth0 up" in lines
    assert lines[-2] == ("tc filter add dev eth0 parent ffff: protocol ip pref 20 handle ::1 u32 "
                         "match u32 0x05000000 0x0f000000 at 0 match u32 0x00000000 0x00001fff "
                         "at 4 match u32 0x00060000 0x00ff0000 at 8 match u32 0x01bb0000 "
                         "0xffff0000 at 20 action mirred egress redirect dev wg-eth0")
    assert lines[-1] == ("tc filter add dev eth0 parent ffff: protocol ipv6 pref 21 handle ::1 "
                         "u32 match u32 0x00000600 0x0000ff00 at 4 match u32 0x01bb0000 "
                         "0xffff0000 at 40 action mirred egress redirect dev wg-eth0")
    assert not any("protocol all" in line for line in lines)
    v4 = next(line for line in lines if "protocol ip " in line and "dev eth0" in line)
    assert "match u32 0x1f900000 0xffff0000 at 20 flowid 5747:20" in v4
    assert render(DeleteFilter("eth0", ROOT_HANDLE, 0x86DD, 11, 0x80100002)) == (
        "tc filter del dev eth0 parent 5747: protocol ipv6 pref 11 handle 801::2 u32")
    assert DEFAULT_CLASS & 0xFFFF == 0x10


# ---- state -----------------------------------------------------------------------------------
def test_state_round_trip_and_bad_file(tmp_path):
    records = {"eth0": state.Record("eth0", Original("mq", 0), "wg-eth0"),
               "eth1": state.Record("eth1", None, "")}
    state.save(str(tmp_path), records)
    assert state.load(str(tmp_path)) == records
    assert state.load(str(tmp_path / "none")) == {}
    (tmp_path / "shaping.json").write_text("{not json")
    with pytest.raises(ShapingError, match="shaping.json"):
        state.load(str(tmp_path))


def test_only_the_kernels_own_roots_and_wagents_are_replaceable():
    from shaping.observed import Qdisc
    from shaping.reconcile import replaceable

    root = 0xFFFFFFFF
    assert replaceable(None)
    for kind in ("pfifo_fast", "fq_codel", "mq", "noqueue"):
        assert replaceable(Qdisc(kind, 0, root))          # attached by the kernel: handle 0:
    assert replaceable(Qdisc("htb", 0x5747 << 16, root))  # wagent's own
    assert not replaceable(Qdisc("fq_codel", 0x8001 << 16, root))  # someone's tuned fq_codel
    assert not replaceable(Qdisc("mq", 0x100 << 16, root))
    assert not replaceable(Qdisc("htb", 1 << 16, root))
