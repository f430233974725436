"""agent.fleet.simulate against closed forms and against a brute-force reference: every event,
the max-min fair rates of every flow recomputed from scratch by progressive filling."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import pytest

from agent import schedule
from agent.fleet import swarm
from agent.fleet.simulate import Rollout, simulate_fleet
from agent.fleet.topology import parse_topology
from agent.policy import parse_policy

PUB = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()      # a Wednesday, noon
MB = 10**6


ROLES = "{cache: {}, inference: {}, evaluation: {}, training: {}}"


def policy(extra: str = "", gap: str = "30s", spread: str = "10s", lead: str = "5s",
           poll: str = "1s", roles: str = ROLES) -> object:
    return parse_policy(f"""
version: 1
roles: {roles}
waves: {{order: [inference, evaluation, training], gap: {gap}, spread: {spread},
         cache_lead: {lead}}}
poll_interval: {poll}
{extra}
""")


def fleet(text: str) -> object:
    return parse_topology("version: 1\nefficiency: 1.0\n" + text)


# -- closed forms -------------------------------------------------------------------------------
def test_nodes_sharing_the_origin_finish_together_at_n_copies_over_its_egress():
    topo = fleet("""
origin: {egress: 800mbit}
clusters:
  a: {node_link: 10gbit, nodes: {inference: 4}}
""")
    # spread 0: every node starts at the same instant, published + cache_lead
    pol = policy(spread="0s", lead="0s", poll="0s")
    plan = simulate_fleet(topo, pol, Rollout(size=100 * MB, published=PUB))
    dones = [n.done - PUB for n in plan.nodes]
    assert dones == pytest.approx([4 * 100 * MB / 100e6] * 4)   # 800 Mbit/s = 100 MB/s
    assert plan.origin_bytes == pytest.approx(400 * MB)
    assert plan.copies == pytest.approx(4.0)
    assert plan.origin_peak_bps == pytest.approx(800e6)
    (w,) = plan.waves
    assert (w.role, w.nodes, w.from_cache, w.never) == ("inference", 4, 0, 0)


def test_a_cluster_link_and_a_node_cap_bound_their_flows_and_the_rest_share_the_origin():
    topo = fleet("""
origin: {egress: 1gbit}
clusters:
  slow: {link: 200mbit, node_link: 10gbit, nodes: {inference: 2}}
  capped: {node_link: 100mbit, nodes: {inference: 1}}
  fast: {node_link: 10gbit, nodes: {inference: 2}}
""")
    pol = policy(spread="0s", lead="0s", poll="0s")
    plan = simulate_fleet(topo, pol, Rollout(size=100 * MB, published=PUB))
    done = {n.node: n.done - PUB for n in plan.nodes}
    # slow: 100 Mbit/s each; capped: 100 Mbit/s; fast: (1000 - 300) / 2 = 350 Mbit/s each
    assert done["fast-inference-1"] == pytest.approx(800 / 350)
    # after fast finishes, nothing else is origin-bound: slow and capped keep 100 Mbit/s
    assert done["slow-inference-1"] == pytest.approx(8.0)
    assert done["capped-inference-1"] == pytest.approx(8.0)


def test_behind_a_cache_the_origin_sends_one_copy_per_cluster_and_nodes_wait_for_it():
    topo = fleet("""
origin: {egress: 400mbit}
clusters:
  a: {count: 2, node_link: 1gbit, nodes: {inference: 2, evaluation: 1, training: 3},
      cache: {nodes: 1, egress: 1gbit}}
""")
    plan = simulate_fleet(topo, policy(), Rollout(size=200 * MB, published=PUB))
    assert [c.origin_bytes for c in plan.clusters] == pytest.approx([200 * MB, 200 * MB])
    caches = {n.node: n for n in plan.nodes if n.role == "cache"}
    assert set(caches) == {"a-1-cache-1", "a-2-cache-1"}
    for n in plan.nodes:
        if n.role == "cache":
            assert n.source == "origin" and n.origin_bytes == pytest.approx(200 * MB)
            continue
        cache = caches[n.cluster + "-cache-1"]
        assert n.source == cache.node and n.origin_bytes == 0
        # learned at its first poll time (1 s interval, its own phase) once the cache had it
        assert n.learned == pytest.approx(schedule.next_poll(cache.done, n.node, "model", 1.0),
                                          abs=1e-6)
        assert cache.done <= n.learned < cache.done + 1.0
        assert n.start == pytest.approx(max(n.slot, n.learned), abs=1e-6)
    cache_wave = plan.waves[0]
    assert cache_wave.role == "cache" and cache_wave.origin_bytes == pytest.approx(400 * MB)
    assert all(w.from_cache == w.nodes for w in plan.waves[1:])


def test_a_cache_node_starts_at_its_slot_or_at_its_first_poll_after_publication():
    # The daemon on a cache node learns of a version at its first poll of the origin's
    # `latest`, at the phase its id sets; its slot is within cache_spread of publication.
    topo = fleet("""
origin: {egress: 100mbit}
clusters:
  a: {node_link: 1gbit, nodes: {inference: 1}, cache: {}}
""")
    for poll in ("0s", "2s", "20s"):
        pol = policy(spread="4s", lead="10s", poll=poll)
        plan = simulate_fleet(topo, pol, Rollout(size=50 * MB, published=PUB))
        cache = next(n for n in plan.nodes if n.role == "cache")
        p = pol.poll_interval
        polls = schedule.next_poll(PUB, cache.node, "model", p)
        assert cache.learned == pytest.approx(polls, abs=1e-6)
        assert cache.start == pytest.approx(max(cache.slot, polls), abs=1e-6)
        assert cache.done - cache.start == pytest.approx(4.0)      # 50 MB at 12.5 MB/s


def test_each_node_learns_at_its_own_poll_time_whenever_the_version_is_published():
    topo = fleet("""
origin: {egress: 10gbit}
clusters:
  a: {node_link: 10gbit, nodes: {inference: 20}}
""")
    pol = policy(spread="0s", lead="0s", poll="60s")
    for published in (PUB, PUB + 17.25, PUB + 59.999):
        plan = simulate_fleet(topo, pol, Rollout(size=MB, published=published, model="llama"))
        for n in plan.nodes:
            phase = schedule.poll_phase(n.node, "llama", 60.0)
            assert published <= n.learned < published + 60.0
            k = (n.learned - phase) / 60.0
            assert k == pytest.approx(round(k), abs=1e-7), n.node     # on the node's phase
            assert n.start == pytest.approx(n.learned, abs=1e-6)      # slot at publication
        assert len({round(n.learned, 3) for n in plan.nodes}) == 20
    # a publication exactly on a node's poll time: it sees the version at that poll
    first = plan.nodes[0]
    on = schedule.next_poll(PUB, first.node, "llama", 60.0)
    plan = simulate_fleet(topo, pol, Rollout(size=MB, published=on, model="llama"))
    assert plan.nodes[0].learned == pytest.approx(on, abs=1e-6)


def test_cold_caches_nodes_whose_slot_comes_first_fetch_from_the_origin():
    topo = fleet("""
origin: {egress: 100mbit}
clusters:
  a: {node_link: 1gbit, nodes: {inference: 1, training: 1}, cache: {}}
""")
    # The cache needs 8 s alone; wave 0 (inference) starts at +2..3 s, training at +60..61 s.
    pol = policy(gap="58s", spread="1s", lead="2s")
    plan = simulate_fleet(topo, pol, Rollout(size=100 * MB, published=PUB, cold=True))
    by_role = {n.role: n for n in plan.nodes}
    assert by_role["inference"].source == "origin"
    assert by_role["training"].source == "a-cache-1"
    assert plan.clusters[0].origin_bytes == pytest.approx(200 * MB)
    # and the same version with the cache's `latest` to learn from: one copy
    warm = simulate_fleet(topo, pol, Rollout(size=100 * MB, published=PUB))
    assert warm.clusters[0].origin_bytes == pytest.approx(100 * MB)


PEERS = "peers: {enabled: true, hosts: [10.0.0.1]}\npulls: {piece_size: 1MB}"


def test_with_peers_a_cluster_learns_when_its_cache_starts_and_is_done_past_its_cache():
    topo = fleet("""
origin: {egress: 400mbit}
clusters:
  a: {node_link: 40mbit, nodes: {inference: 8}, cache: {nodes: 1}}
""")
    pol = policy(PEERS, spread="0s", lead="0s")
    plan = simulate_fleet(topo, pol, Rollout(size=40 * MB, published=PUB))
    (cluster,) = plan.clusters
    assert cluster.peers and cluster.origin_bytes == pytest.approx(40 * MB)
    assert cluster.cache_bytes == pytest.approx(40 * MB)       # each piece once
    cache = next(n for n in plan.nodes if n.role == "cache")
    delay = swarm.pipeline(8, MB, 5e6, 5e6)
    for n in plan.nodes:
        if n.role == "cache":
            continue
        assert n.source == cache.node and n.origin_bytes == 0
        # it learns as the cache starts (the cache tells its cluster, and its piece server
        # names the version it pulls as `latest`), not at its next poll, nor once it is done
        assert n.learned == pytest.approx(cache.start, abs=1e-6)
        assert n.learned < cache.done
        # its own download (GOODPUT of its link) after the pipeline fills, and never before
        # the cache's last piece has reached it
        alone = n.start + delay + 40 * MB / (5e6 * swarm.GOODPUT)
        assert n.done == pytest.approx(max(alone, cache.done + delay), rel=1e-6)
    # told: a poll every 5 minutes (the default) makes no node wait
    rare = simulate_fleet(topo, policy(PEERS, spread="0s", lead="0s", poll="5m"),
                          Rollout(size=40 * MB, published=PUB))
    rare_cache = next(n for n in rare.nodes if n.role == "cache")
    assert rare.last_done - rare_cache.start == pytest.approx(plan.last_done - cache.start,
                                                              abs=1e-6)
    # without peers the cache sends every node its copy, one after the other in effect
    tree = simulate_fleet(topo, policy(spread="0s", lead="0s"),
                          Rollout(size=40 * MB, published=PUB))
    assert tree.clusters[0].cache_bytes == pytest.approx(8 * 40 * MB)
    assert tree.last_done - PUB > 3 * (plan.last_done - PUB)


def test_with_peers_the_model_s_first_version_costs_the_origin_one_copy_too():
    topo = fleet("""
origin: {egress: 400mbit}
clusters:
  a: {node_link: 40mbit, nodes: {inference: 6}, cache: {nodes: 1}}
""")
    pol = policy(PEERS, spread="0s", lead="30s")     # the cache's lead far beyond its pull
    plan = simulate_fleet(topo, pol, Rollout(size=40 * MB, published=PUB, cold=True))
    assert plan.clusters[0].origin_bytes == pytest.approx(40 * MB)
    cache = next(n for n in plan.nodes if n.role == "cache")
    assert all(n.source == cache.node for n in plan.nodes if n.role != "cache")
    # A cache whose own first poll comes after its cluster's first start: that node's asking
    # for the version makes it start at once.
    late = policy(PEERS, spread="0s", lead="0s", poll="30s")
    plan = simulate_fleet(topo, late, Rollout(size=40 * MB, published=PUB, cold=True))
    cache = next(n for n in plan.nodes if n.role == "cache")
    first = min(n.start for n in plan.nodes if n.role != "cache")
    assert first < cache.learned - 1 or cache.start == pytest.approx(first, abs=1e-6)
    assert cache.start <= first + 1e-6 and plan.clusters[0].origin_bytes == pytest.approx(40 * MB)
    # ...and tells the others, whose own polls would have come up to 30 s later
    assert max(n.start for n in plan.nodes if n.role != "cache") == pytest.approx(cache.start,
                                                                                  abs=1e-6)


def test_with_peers_a_small_upload_share_slows_the_cluster():
    topo = fleet("""
origin: {egress: 400mbit}
clusters:
  a: {node_link: 40mbit, nodes: {inference: 8}, cache: {nodes: 1}}
""")
    fast = simulate_fleet(topo, policy(PEERS, spread="0s", lead="0s"),
                          Rollout(size=40 * MB, published=PUB))
    slow = simulate_fleet(topo, policy(PEERS.replace("hosts", "upload: 10%, hosts")
                                       + "\nshaping: {link_rate: 40mbit}",
                                       spread="0s", lead="0s"),
                          Rollout(size=40 * MB, published=PUB))
    # 8 nodes share the cache's 5 MB/s and their own 0.5 MB/s each: 1.125 MB/s a node
    assert slow.last_done - PUB > 2 * (fast.last_done - PUB)


def test_an_update_fetches_only_what_changed():
    topo = fleet("""
origin: {egress: 1gbit}
clusters:
  a: {count: 3, node_link: 1gbit, nodes: {inference: 5}, cache: {}}
""")
    plan = simulate_fleet(topo, policy(), Rollout(size=1000 * MB, fetch=30 * MB,
                                                  published=PUB))
    assert plan.fetch == 30 * MB and plan.size == 1000 * MB
    assert plan.origin_bytes == pytest.approx(3 * 30 * MB)
    assert plan.copies == pytest.approx(3.0)          # one per cluster


def test_slots_are_the_daemons():
    topo = fleet("""
origin: {egress: 10gbit}
clusters:
  dc: {node_link: 10gbit, nodes: {inference: 3, training: 2}, cache: {nodes: 2}}
""")
    pol = policy()
    plan = simulate_fleet(topo, pol, Rollout(size=MB, published=PUB, model="m", version="v9"))
    for n in plan.nodes:
        assert n.slot == pytest.approx(schedule.slot(PUB, n.node, n.role, "m", "v9", pol))
    # nodes spread evenly over the cluster's two caches
    sources = sorted(n.source for n in plan.nodes if n.role != "cache")
    assert sources == ["dc-cache-1"] * 3 + ["dc-cache-2"] * 2


def test_a_pull_pauses_when_its_window_closes_and_resumes_at_the_next():
    topo = fleet("""
origin: {egress: 8mbit}
clusters:
  a: {node_link: 1gbit, nodes: {training: 1}}
""")
    pol = policy(roles='{inference: {}, evaluation: {}, training: {windows: '
                       '[{cron: "0 22 * * *", duration: 1h}]}}',
                 gap="0s", spread="0s", lead="0s", poll="0s")
    # 1 MB/s: 7200 MB take two hours, so the pull runs 22:00-23:00 two nights in a row
    plan = simulate_fleet(topo, pol, Rollout(size=7200 * MB, published=PUB))
    (n,) = plan.nodes
    assert n.start == datetime(2026, 12, 2, 22, 0, tzinfo=UTC).timestamp()
    assert n.done == pytest.approx(datetime(2026, 12, 3, 23, 0, tzinfo=UTC).timestamp())


def test_a_role_whose_window_opens_beyond_the_horizon_never_finishes():
    topo = fleet("""
origin: {egress: 1gbit}
clusters:
  a: {node_link: 1gbit, nodes: {inference: 2, training: 1}}
""")
    # 29 February 2028 is more than 400 days after the publication
    pol = policy(roles='{inference: {}, evaluation: {}, training: {windows: '
                       '[{cron: "0 0 29 feb *", duration: 1h}]}}')
    plan = simulate_fleet(topo, pol, Rollout(size=MB, published=PUB))
    training = next(w for w in plan.waves if w.role == "training")
    assert training.never == 1 and training.last_done is None
    assert plan.last_done is None


def test_caches_need_a_cache_role_and_cache_nodes_go_under_cache():
    topo = fleet("origin: {egress: 1gbit}\nclusters: {a: {node_link: 1gbit, nodes: "
                 "{inference: 1}, cache: {}}}")
    with pytest.raises(ValueError, match="no cache_role"):
        simulate_fleet(topo, parse_policy("version: 1\ncache_role: null\n"),
                       Rollout(size=MB))
    topo = fleet("origin: {egress: 1gbit}\nclusters: {a: {node_link: 1gbit, nodes: "
                 "{cache: 1}}}")
    with pytest.raises(ValueError, match="under cache:"):
        simulate_fleet(topo, policy(), Rollout(size=MB))


# -- against a brute-force reference ------------------------------------------------------------
def reference(topo, pol, rollout):
    """The same model, computed the slow way: all rates from scratch at every event."""
    eff = topo.efficiency / 8
    cap_policy = math.inf
    if pol.pulls.rate:
        cap_policy = pol.pulls.rate / 8
    if pol.shaping.enabled:
        cap_policy = min(cap_policy, pol.shaping.ceil * eff)
    nodes, resources = [], {"origin": topo.origin.egress * eff}
    for name, c in topo.expanded():
        resources[("link", name)] = c.link * eff if c.link else math.inf
        homes = []
        if c.cache:
            for k in range(1, c.cache.nodes + 1):
                nid = f"{name}-{pol.cache_role}-{k}"
                homes.append(nid)
                resources[("cache", nid)] = c.cache_egress * eff
                nodes.append(dict(id=nid, cluster=name, role=pol.cache_role,
                                  cap=min(c.cache_link * eff, cap_policy), home=None))
        for g in c.nodes:
            for k in range(1, g.count + 1):
                nodes.append(dict(id=f"{name}-{g.role}-{k}", cluster=name, role=g.role,
                                  cap=min(c.link_of(g) * eff, cap_policy),
                                  home=homes[(k - 1) % len(homes)] if homes else None))
    by_id = {n["id"]: n for n in nodes}
    poll = pol.poll_interval
    events = []   # (time, kind, id)
    t = 0.0
    for n in nodes:
        frac = schedule.offset_fraction(n["id"], n["role"], rollout.model, rollout.version)
        n.update(frac=frac, slot=schedule.slot_from_fraction(0, frac, n["role"], pol),
                 left=float(rollout.per_node), start=None, done=None, source=None, obytes=0.0,
                 active=False, end=math.inf)

    def plan_start(n, known):
        # the node's first poll at or after `known`, on the wall clock
        learned = schedule.next_poll(PUB + known, n["id"], rollout.model, poll) - PUB
        due = max(n["slot"], learned)
        s = schedule.pull_allowed_at(schedule.windows_for(pol, n["role"]), PUB + due,
                                     n["frac"], pol.waves.spread)
        if s is not None:
            events.append((s - PUB, "start", n["id"]))

    for n in nodes:
        if n["home"] is None or rollout.cold:
            plan_start(n, 0.0)
    done_caches = {}
    while True:
        active = [n for n in nodes if n["active"]]
        rates = maxmin(active, resources)
        t_fin = min((t + n["left"] / rates[n["id"]] for n in active if rates[n["id"]] > 0),
                    default=math.inf)
        t_end = min((n["end"] for n in active), default=math.inf)
        t_ev = min((e[0] for e in events), default=math.inf)
        t_next = min(t_fin, t_end, t_ev)
        if t_next == math.inf:
            break
        for n in active:
            moved = rates[n["id"]] * (t_next - t)
            n["left"] -= moved
            if n["source"] == "origin":
                n["obytes"] += moved
        t = t_next
        for n in active:
            if n["left"] <= 1e-6 * rollout.per_node:
                n.update(active=False, done=t, left=0.0)
                if n["role"] == pol.cache_role:
                    done_caches[n["id"]] = t
                    if not rollout.cold:
                        for m in nodes:
                            if m["home"] == n["id"]:
                                plan_start(m, t)
            elif n["end"] <= t + 1e-9:          # its window closed: pause until the next
                n.update(active=False, end=math.inf)
                s = schedule.pull_allowed_at(schedule.windows_for(pol, n["role"]),
                                             PUB + t + 1e-6, n["frac"], pol.waves.spread)
                if s is not None:
                    events.append((s - PUB, "start", n["id"]))
        for e in [e for e in events if e[0] <= t + 1e-9]:
            events.remove(e)
            n = by_id[e[2]]
            if n["start"] is None:
                n["start"] = t
                h = n["home"]
                n["source"] = h if h and h in done_caches and done_caches[h] <= t else "origin"
            windows = schedule.windows_for(pol, n["role"])
            n["end"] = (schedule.open_until(windows, PUB + t) - PUB) if windows else math.inf
            n["active"] = True
            if n["left"] <= 0:
                n.update(active=False, done=t)
    return by_id


def maxmin(flows, resources):
    """Progressive filling: raise every unfrozen flow's rate together until a cap or a
    resource stops it."""
    def uses(n):
        out = [("link", n["cluster"])] if n["source"] == "origin" else []
        return out + (["origin"] if n["source"] == "origin" else [("cache", n["source"])])

    rate = {n["id"]: 0.0 for n in flows}
    left = dict(resources)
    live = {n["id"]: n for n in flows}
    while live:
        counts = {}
        for n in live.values():
            for r in uses(n):
                counts[r] = counts.get(r, 0) + 1
        step = min([n["cap"] - rate[i] for i, n in live.items()]
                   + [left[r] / k for r, k in counts.items()])
        for i in live:
            rate[i] += step
        for r, k in counts.items():
            left[r] -= step * k
        for i, n in list(live.items()):
            if rate[i] >= n["cap"] * (1 - 1e-12) or any(
                    resources[r] < math.inf and left[r] <= 1e-9 * resources[r]
                    for r in uses(n)):
                del live[i]
    return rate


@pytest.mark.parametrize("seed", range(24))
def test_random_fleets_agree_with_the_reference(seed):
    rnd = random.Random(seed)
    clusters = []
    for c in range(rnd.randint(1, 3)):
        roles = {r: rnd.randint(0, 3) for r in ("inference", "evaluation", "training")}
        roles["inference"] += 1
        cache = (f", cache: {{nodes: {rnd.randint(1, 2)}, egress: {rnd.choice([200, 500, 2000])}"
                 "mbit}" if rnd.random() < 0.6 else "")
        link = f"link: {rnd.choice([100, 300, 1000])}mbit, " if rnd.random() < 0.6 else ""
        nodes = ", ".join(f"{r}: {k}" for r, k in roles.items())
        clusters.append(f"  c{c}: {{{link}node_link: {rnd.choice([50, 200, 1000])}mbit, "
                        f"nodes: {{{nodes}}}{cache}}}")
    topo = fleet(f"origin: {{egress: {rnd.choice([200, 400, 1000])}mbit}}\nclusters:\n"
                 + "\n".join(clusters))
    extra, roles = "", ROLES
    if seed % 3 == 0:   # training pulls only in a short window, so pulls pause and resume
        roles = '{cache: {}, inference: {}, evaluation: {}, training: {windows: ' \
                '[{cron: "* * * * *", duration: 20s}]}}'
    if seed % 4 == 1:
        extra = "pulls: {rate: 300mbit}"
    pol = policy(extra=extra, roles=roles, gap=f"{rnd.randint(2, 20)}s",
                 spread=f"{rnd.randint(0, 10)}s",
                 lead=f"{rnd.randint(0, 8)}s", poll=f"{rnd.choice([0, 1, 3])}s")
    rollout = Rollout(size=rnd.choice([20, 50, 100]) * MB, published=PUB,
                      cold=rnd.random() < 0.4, version=f"v{seed}")
    plan = simulate_fleet(topo, pol, rollout)
    ref = reference(topo, pol, rollout)
    for n in plan.nodes:
        r = ref[n.node]
        assert n.source == r["source"], n.node
        assert (n.done is None) == (r["done"] is None), n.node
        if n.done is not None:
            assert n.done - PUB == pytest.approx(r["done"], rel=1e-6, abs=1e-6), n.node
        assert n.origin_bytes == pytest.approx(r["obytes"], rel=1e-6, abs=1.0), n.node
    assert plan.origin_bytes == pytest.approx(sum(r["obytes"] for r in ref.values()),
                                              rel=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_many_pulls_resuming_in_windows_agree_with_the_reference(seed):
    # Many pulls of one role share the origin and pause every hour: most resumes join a class
    # already at the origin's level (the simulation's shortcut), some clusters' links bind.
    rnd = random.Random(1000 + seed)
    clusters = "\n".join(
        f"  c{c}: {{link: {rnd.choice([60, 150, 10000])}mbit, node_link: "
        f"{rnd.choice([20, 100, 1000])}mbit, nodes: {{inference: {rnd.randint(1, 3)}, "
        f"training: {rnd.randint(8, 14)}}}{', cache: {}' if c == 0 else ''}}}"
        for c in range(3))
    topo = fleet(f"origin: {{egress: {rnd.choice([100, 200])}mbit}}\nclusters:\n" + clusters)
    roles = '{cache: {}, inference: {}, evaluation: {}, training: {windows: ' \
            '[{cron: "0 * * * *", duration: 25m}]}}'
    pol = policy(roles=roles, gap="3m", spread="20m", lead="2m",
                 poll=rnd.choice(["0s", "2m"]))
    rollout = Rollout(size=rnd.choice([2000, 4000]) * MB, published=PUB, cold=seed % 2 == 0,
                      version=f"w{seed}")
    plan = simulate_fleet(topo, pol, rollout)
    ref = reference(topo, pol, rollout)
    for n in plan.nodes:
        r = ref[n.node]
        assert n.source == r["source"], n.node
        assert n.done is not None and r["done"] is not None, n.node
        assert n.done - PUB == pytest.approx(r["done"], rel=1e-6, abs=1e-6), n.node
        assert n.origin_bytes == pytest.approx(r["obytes"], rel=1e-6, abs=1.0), n.node
    assert plan.origin_peak_bps > 0
