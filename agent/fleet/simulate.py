"""A version rolled out through a fleet, simulated: when each node has it, and what the origin
serves. Pure: a Topology, a Policy and a Rollout in, a FleetPlan out.

What each node does is what the daemon does:

* **Its slot** comes from ``agent.schedule.slot`` (published + cache lead + wave x gap + its
  own offset), hashed from a node id the plan gives it (``CLUSTER-ROLE-N``), then moved into its
  role's windows as ``agent.schedule.pull_allowed_at`` does; a pull that reaches the end of its
  window pauses and resumes at the next opening.
* **When it learns of the version.** Every node polls ``{source}/{model}/latest`` every
  ``poll_interval``, at a phase hashed from its id and the model (``agent.schedule.next_poll``,
  the function the daemon uses): the plan knows each node's poll times exactly, counted from the
  wall-clock time ``Rollout.published``. Sources are tried in order, the cluster's cache first:
  a cache node serves ``latest`` naming a version only once it holds it completely
  (``agent.announce``), so a node behind a cache learns of the version at its first poll time at
  or after the moment its cache has it. Cache nodes poll the origin (they skip sources marked
  ``cache: true``), as does a node without a cache, and learn of it at their first poll time at
  or after the publication. ``cold``: the caches have never announced a version of this model
  (its first version), so ``latest`` 404s on them and every node learns from the origin. A node
  starts at its slot, or when it learned of the version if that is later. On the emulated fleet
  (tests/bench/fleet.py) this is what decides a cache node's finish: its slot is within
  ``cache_spread`` of the publication, inside its first poll interval. (A daemon's first poll
  after it starts is at once; the plan assumes the daemons ran before the publication.)
* **Its source**: its cache if the cache holds the version when the pull starts, else the
  origin, for the whole pull (the pull's streams stay with the source that answered).
* **Its rate**: max-min fair sharing (what TCP flows sharing bottlenecks tend to) of the
  origin's egress, each cluster's uplink (the origin's traffic into the cluster), each cache
  node's egress, and each node's cap: its link, and the policy's ``pulls.rate`` and
  ``shaping.ceil``. Link rates are multiplied by the topology's ``efficiency`` (headers).

The simulation is a fluid one, event driven: rates are recomputed at every start, finish, pause
and resume. It is exact for that model and fast for 100k nodes over weeks of windows:

* Flows that share every constraint (same source, same cluster, same cap, same role) get the
  same rate: they form a class, whose flows advance along one shared coordinate and finish in
  the order of their thresholds on it (a heap per class).
* The origin's fair share ``lam`` is a water level over units with fixed thresholds: a class in
  a cluster whose uplink doesn't bind runs at its cap if that is below ``lam`` (set A), else at
  ``lam`` (set B, along the integral ``V`` of ``lam``, so a change of ``lam`` costs nothing per
  class); a cluster whose uplink binds (its own level ``L`` under ``lam``) sends exactly its
  uplink, its classes at ``min(cap, L)``. The thresholds (caps; ``L`` per cluster) sit in heaps
  keyed by values that change only on the unit's own events, so a start or a finish costs a few
  heap operations and the classes of one cluster, never a pass over the fleet.
* A window that closes pauses every pull of its role at once (one event, one pass over the
  role's flows); the pulls resume at the next opening in the order of their offsets, as one
  sorted batch, not one heap entry per node.

Not simulated: backoff (training traffic), failures, and what takes well under a second per pull
on a datacenter's round trips: reading the manifest, TCP's slow start, publishing the version
(0.01-0.03 s per pull on the emulated fleet). Nor is how TCP flows that share a queue split it
over seconds: on the emulated fleet a pull that starts while another already fills the origin's
queue measures that queue as its base round trip, gets receive windows about four times larger
and up to 65% of the origin for a while (docs/cache-tier.md, "How much the origin serves").
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from agent import schedule
from agent.fleet import swarm as peers
from agent.fleet.topology import Topology
from agent.policy.model import Policy

INF = math.inf
HORIZON = 400 * 86400.0        # windows are looked up this far ahead of publication
EPS = 1e-12                    # relative slack when comparing a threshold with the water level


@dataclass(frozen=True)
class Rollout:
    size: int                      # bytes of the version (what "one copy" means)
    fetch: int | None = None       # bytes each node fetches; None: all of it (a new model)
    published: float = 0.0         # POSIX seconds
    model: str = "model"           # with version, what the per-node offsets hash
    version: str = "v1"
    cold: bool = False             # no cache has announced a version of this model yet

    @property
    def per_node(self) -> int:
        return self.size if self.fetch is None else self.fetch


@dataclass(frozen=True)
class NodeResult:
    node: str
    cluster: str
    role: str
    slot: float                    # POSIX seconds
    learned: float | None          # when it knew of the version
    start: float | None            # first byte asked; None: its windows never open
    done: float | None
    source: str | None             # "origin" or the cache node's id
    origin_bytes: float


@dataclass(frozen=True)
class WaveResult:
    role: str
    wave: int | None               # None: the cache role
    nodes: int
    first_start: float | None
    p50_done: float | None
    p99_done: float | None
    last_done: float | None
    origin_bytes: float            # what the origin sent to this wave's nodes
    origin_peak_bps: float         # the most the origin sent them at once
    from_cache: int                # nodes whose pull came from a cache
    never: int                     # nodes that never finish (windows never open)


@dataclass(frozen=True)
class ClusterResult:
    name: str
    nodes: int
    origin_bytes: float
    last_done: float | None
    cache_bytes: float = 0.0       # what its cache nodes sent its nodes
    peers: bool = False            # its nodes serve each other (agent.fleet.swarm)


@dataclass(frozen=True)
class FleetPlan:
    published: float
    size: int
    fetch: int
    cold: bool
    waves: tuple[WaveResult, ...]
    clusters: tuple[ClusterResult, ...]
    origin_bytes: float
    origin_peak_bps: float
    origin_peak_at: float | None
    last_done: float | None
    nodes: tuple[NodeResult, ...]

    @property
    def copies(self) -> float:
        """Origin bytes in copies of what each node fetches (the version, or an update's
        changed bytes)."""
        return self.origin_bytes / self.fetch if self.fetch else 0.0


@dataclass(frozen=True)
class _Node:
    id: str
    cluster: int
    role: str
    frac: float
    slot: float                    # relative to publication
    poll: float                    # its poll phase, relative to publication (poll_offset)
    cap: float                     # bytes/s
    home: int                      # the cache (index) it fetches from; -1: none
    cache: int                     # this node's own cache index, -1: not a cache node
    swarm: bool = False            # it and its cluster's nodes serve each other


@dataclass(frozen=True)
class _Cache:
    node: int                      # its node's index
    egress: float                  # what its cluster's flows homed on it share (bytes/s)
    out: float                     # its own egress (bytes/s)
    delay: float = 0.0             # with peers: its last piece to every node (seconds)
    swarm: bool = False            # its cluster's nodes serve each other


def simulate_fleet(topology: Topology, policy: Policy, rollout: Rollout) -> FleetPlan:
    """The rollout of one version through the fleet (see the module's docstring)."""
    nodes, clusters, caches = _nodes(topology, policy, rollout)
    sim = _Sim(topology, policy, rollout, nodes, clusters, caches)
    sim.run()
    return sim.result()


def poll_offset(node_id: str, rollout: Rollout, interval: float) -> float:
    """The node's poll phase (``agent.schedule.poll_phase``, counted from the epoch) counted
    from the publication instead: the simulation's times are seconds after it, and small
    numbers keep the float precision the epoch's would lose."""
    if interval <= 0:
        return 0.0
    return (schedule.poll_phase(node_id, rollout.model, interval) - rollout.published) % interval


def _nodes(topology: Topology, policy: Policy, rollout: Rollout
           ) -> tuple[list[_Node], list[tuple[str, float]], list[_Cache]]:
    """Every node with its slot and cap; clusters as (name, uplink bytes/s); caches. With
    peers, a cluster's nodes share what its cache and they upload (``agent.fleet.swarm``)."""
    eff = topology.efficiency / 8.0                  # bits/s of a link -> goodput bytes/s
    policy_cap = INF
    if policy.pulls.rate:
        policy_cap = policy.pulls.rate / 8.0         # a token bucket on body bytes: goodput
    if policy.shaping.enabled:
        policy_cap = min(policy_cap, policy.shaping.ceil * eff)
    serve_cap = (policy.shaping.ceil * eff if policy.shaping.enabled and policy.shaping.serve_ports
                 else INF)
    cache_role = policy.cache_role
    nodes: list[_Node] = []
    clusters: list[tuple[str, float]] = []
    caches: list[_Cache] = []
    peer_cap = INF
    if policy.peers.enabled:
        peer_cap = min(serve_cap, policy.peers.upload / 8.0)   # a token bucket on payload
    slot_of = schedule.slot_from_fraction
    frac_of = schedule.offset_fraction
    interval = policy.poll_interval

    def add(node_id: str, ci: int, role: str, link: int, home: int, cache: int,
            swarm: bool = False) -> None:
        frac = frac_of(node_id, role, rollout.model, rollout.version)
        cap = min(link * eff, policy_cap) * (peers.GOODPUT if swarm else 1.0)
        nodes.append(_Node(node_id, ci, role, frac, slot_of(0.0, frac, role, policy),
                           poll_offset(node_id, rollout, interval), cap, home, cache, swarm))

    for ci, (name, c) in enumerate(topology.expanded()):
        clusters.append((name, c.link * eff if c.link is not None else INF))
        homes = []
        if c.cache is not None:
            if cache_role is None:
                raise ValueError(f"cluster {name} has cache nodes but the policy has no "
                                 "cache_role")
            for k in range(1, c.cache.nodes + 1):
                homes.append(len(caches))
                out = min(c.cache_egress * eff, serve_cap)
                caches.append(_Cache(len(nodes), out, out))
                add(f"{name}-{cache_role}-{k}", ci, cache_role, c.cache_link, -1, homes[-1])
        swarm = policy.peers.enabled and bool(homes)
        uploads = [0.0] * len(homes)
        count = [0] * len(homes)
        for g in c.nodes:
            if g.role == cache_role:
                raise ValueError(f"cluster {name}: nodes of the cache role {cache_role!r} go "
                                 "under cache:, not nodes:")
            for k in range(1, g.count + 1):
                home = homes[(k - 1) % len(homes)] if homes else -1
                add(f"{name}-{g.role}-{k}", ci, g.role, c.link_of(g), home, -1, swarm)
                if swarm:
                    uploads[home - homes[0]] += min(c.link_of(g) * eff, peer_cap)
                    count[home - homes[0]] += 1
        if swarm:
            piece = min(policy.pulls.piece_size, rollout.per_node)
            for j, k in enumerate(homes):
                ch = caches[k]
                rate = uploads[j] / count[j] if count[j] else ch.out
                caches[k] = _Cache(ch.node, ch.out + uploads[j], ch.out,
                                   peers.pipeline(count[j], piece, ch.out, rate), True)
    return nodes, clusters, caches


# Where an origin class stands in the origin's water level.
OUT, AT_CAP, AT_LAM, SAT = 0, 1, 2, 3


class _Class:
    """Flows that share every constraint, hence a rate. Progress along a coordinate S: a flow
    joining at S0 with R bytes left finishes when S reaches S0 + R. At an own rate u,
    S = u*t - off; at the origin's level (``b``), S = V - off."""

    __slots__ = ("id", "origin", "group", "cap", "role", "heap", "n", "u", "b", "off", "pgen",
                 "pred", "state", "wn", "wr", "wgen")

    def __init__(self, cid: int, origin: bool, group: int, cap: float, role: int) -> None:
        self.id, self.origin, self.group, self.cap, self.role = cid, origin, group, cap, role
        self.heap: list[tuple[float, int, int]] = []      # (threshold, node, flow generation)
        self.n = 0                 # live flows
        self.u = 1.0               # own rate (when not b)
        self.b = False             # progresses at the origin's level lam
        self.off = 0.0
        self.pgen = 0              # generation of its finish prediction
        self.pred: tuple[bool, float] | None = None     # the prediction in the heaps
        # the origin's sums: where it stands, the flows and the per-flow rate counted there
        self.state = OUT
        self.wn = 0
        self.wr = 0.0
        self.wgen = 0              # generation of its entries in the water level's heaps


class _Batch:
    """Starts known in advance, sorted by time: a window's resumes, or the first starts."""

    __slots__ = ("times", "nodes", "pos")

    def __init__(self, items: list[tuple[float, int]]) -> None:
        items.sort()
        self.times = [t for t, _ in items]
        self.nodes = [i for _, i in items]
        self.pos = 0


class _Sim:
    """The event loop and its state: private, filled by ``simulate_fleet`` and read back by
    ``result``. Times are seconds after publication; rates bytes per second."""

    START, PAUSE, BATCH, POKE, FINISH = 0, 1, 2, 3, 4

    def __init__(self, topology: Topology, policy: Policy, rollout: Rollout,
                 nodes: list[_Node], clusters: list[tuple[str, float]],
                 caches: list[_Cache]) -> None:
        self.topology, self.policy, self.rollout = topology, policy, rollout
        self.nodes, self.clusters, self.caches = nodes, clusters, caches
        self.origin_rate = topology.origin.egress * topology.efficiency / 8.0
        self.roles = sorted({n.role for n in nodes},
                            key=lambda r: (-1 if schedule.wave_index(policy, r) is None
                                           else schedule.wave_index(policy, r), r))
        self.role_index = {r: i for i, r in enumerate(self.roles)}
        self.spans: list[schedule.Spans | None] = []
        pub = rollout.published
        for r in self.roles:
            windows = schedule.windows_for(policy, r)
            self.spans.append(schedule.Spans.build(windows, pub, pub + HORIZON) if windows
                              else None)
        count = len(nodes)
        self.nrole = [self.role_index[n.role] for n in nodes]
        self.learned: list[float | None] = [None] * count
        self.start: list[float | None] = [None] * count
        # A first start scheduled from the node's own poll (a model's first version), and the
        # nodes whose cache told them earlier: that start is then no event any more.
        self.due: list[float | None] = [None] * count
        self.superseded: set[int] = set()
        self.done: list[float | None] = [None] * count
        self.source: list[int] = [-2] * count          # -1 origin, k: cache k, -2 not started
        self.obytes = [0.0] * count
        self.left = [float(rollout.per_node)] * count  # bytes still to fetch
        self.fgen = [0] * count
        self.fcls: list[_Class | None] = [None] * count   # the class it flows in now
        self.home_cls: list[_Class | None] = [None] * count  # its class, once its source is
        self.fthr = [0.0] * count
        self.fjoin = [0.0] * count                     # bytes left when the flow joined
        self.cache_done: list[float | None] = [None] * len(caches)
        self.homed: list[list[int]] = [[] for _ in caches]
        # with peers: nodes done with their share before their cache was (they wait for it)
        self.waiting: list[dict[int, None]] = [{} for _ in caches]
        for i, n in enumerate(nodes):
            if n.home >= 0:
                self.homed[n.home].append(i)
        self.classes: list[_Class] = []
        self.by_key: dict[tuple[bool, int, float, int], _Class] = {}
        self.cluster_classes: list[list[_Class]] = [[] for _ in clusters]
        self.cache_classes: list[list[_Class]] = [[] for _ in caches]
        self.role_classes: list[list[_Class]] = [[] for _ in self.roles]
        # the origin's water level: lam = (egress - fixed) / at_lam
        self.lam = INF
        self.V = 0.0
        self.t = 0.0
        self.fixed = 0.0               # bytes/s of the flows not at lam (own caps, bound clusters)
        self.nfixed = 0                # how many such flows
        self.at_lam = 0                # flows at lam
        self.fixed_w = [0.0] * len(self.roles)
        self.at_lam_w = [0] * len(self.roles)
        self.a_heap: list[tuple[float, int, int]] = []   # (-cap, class, wgen): at cap, largest
        self.b_heap: list[tuple[float, int, int]] = []   # (cap, class, wgen): at lam, smallest
        # clusters: uplink, flows, sum of their caps, whether the uplink binds, its level
        self.uplink = [u for _, u in clusters]
        self.cn = [0] * len(clusters)
        self.cdemand = [0.0] * len(clusters)
        self.csat = [False] * len(clusters)
        self.clevel = [INF] * len(clusters)
        self.cgen = [0] * len(clusters)
        self.free_heap: list[tuple[float, int, int]] = []   # (level, cluster, cgen): not bound
        self.sat_heap: list[tuple[float, int, int]] = []    # (-level, cluster, cgen): bound
        self.origin_moved = False
        self.stale_levels: set[int] = set()     # clusters whose level the fast path left
        self.ht: list[tuple[float, int, int]] = []      # (finish time, class, pgen)
        self.hv: list[tuple[float, int, int]] = []      # (finish level V, class, pgen)
        self.events: list[tuple[float, int, int, int]] = []   # (time, seq, kind, arg)
        self.seq = 0
        self.batches: list[_Batch] = []
        self.pauses: set[tuple[int, float]] = set()    # (role, window end) already pending
        self.open_span: list[tuple[float, float] | None] = [None] * len(self.roles)
        self.armed: list[tuple[float, float] | None] = [None] * len(self.roles)  # its pause due
        self.peak = 0.0
        self.peak_at: float | None = None
        self.peak_w = [0.0] * len(self.roles)
        self.dirty: dict[tuple[bool, int], list[_Class]] = {}

    # -- events -------------------------------------------------------------------------------
    def push(self, t: float, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg))

    def push_batch(self, items: list[tuple[float, int]]) -> None:
        if items:
            b = _Batch(items)
            self.batches.append(b)
            self.push(b.times[0], self.BATCH, len(self.batches) - 1)

    def run(self) -> None:
        firsts: list[tuple[float, int]] = []
        for i, n in enumerate(self.nodes):
            if n.home >= 0 and not self.rollout.cold:
                continue          # learns from its cache's `latest` once the cache has it
            start = self.due[i] = self._schedule(i, 0.0)
            if start is not None:
                firsts.append((start, i))
        self.push_batch(firsts)
        events, classes = self.events, self.classes
        ht, hv = self.ht, self.hv
        while True:
            te = events[0][0] if events else INF
            while ht and classes[ht[0][1]].pgen != ht[0][2]:
                heapq.heappop(ht)
            th = ht[0][0] if ht else INF
            while hv and classes[hv[0][1]].pgen != hv[0][2]:
                heapq.heappop(hv)
            tv = INF
            if hv and 0 < self.lam < INF:
                tv = self.t + max(0.0, hv[0][0] - self.V) / self.lam
            tn = min(te, th, tv)
            if tn == INF:
                return
            if tn > self.t:
                if self.at_lam and self.lam < INF:
                    self.V += self.lam * (tn - self.t)
                self.t = tn
            if te < th and te < tv:            # on a tie, flows finish first
                top = events[0]
                # (the next event after the top is the earlier of the heap's entries 1 and 2)
                if top[2] == self.BATCH and (len(events) < 2 or events[1][0] > tn) \
                        and (len(events) < 3 or events[2][0] > tn):
                    b = self.batches[top[3]]
                    pos = b.pos
                    if (pos + 1 == len(b.times) or b.times[pos + 1] > tn) \
                            and self._join_at_lam(b.nodes[pos]):
                        # A lone resume into a class already at the origin's level: the
                        # level moves, nothing else does (most of a window's resumes).
                        b.pos = pos + 1
                        if pos + 1 < len(b.times):
                            heapq.heapreplace(events, (b.times[pos + 1], top[1], self.BATCH,
                                                       top[3]))
                        else:
                            heapq.heappop(events)
                        continue
                # Every start and pause at this instant, then the rates once: a window that
                # opens or closes moves thousands of pulls at the same second.
                while events and events[0][0] == tn:
                    _, _, kind, arg = heapq.heappop(events)
                    if kind == self.BATCH:
                        b = self.batches[arg]
                        times, pos = b.times, b.pos
                        while pos < len(times) and times[pos] == tn:
                            self._begin(b.nodes[pos])
                            pos += 1
                        b.pos = pos
                        if pos < len(times):
                            self.push(times[pos], self.BATCH, arg)
                    elif kind == self.START:
                        self._begin(arg)
                    elif kind == self.POKE:
                        if self.start[arg] is None:       # not started on its own since
                            self._begin(arg)
                    elif kind == self.FINISH:
                        if self.done[arg] is None:
                            self.done[arg] = self.t
                    else:
                        self._pause_role(arg)
            else:
                c = classes[heapq.heappop(ht if tn == th else hv)[1]]
                c.pred = None                 # consumed: the next one is pushed anew
                self._finish(c)
            self._flush()

    def _schedule(self, i: int, known: float) -> float | None:
        """The node learns of the version at its first poll at or after ``known`` (its poll
        times are known: ``agent.schedule.next_poll``): its start is its slot, or then if
        later, in its role's windows; None if they never open."""
        n = self.nodes[i]
        learned = self.learned[i] = schedule.first_poll(known, n.poll, self.policy.poll_interval)
        return self._allowed(n, max(n.slot, learned))

    def _allowed(self, n: _Node, due: float) -> float | None:
        """``schedule.pull_allowed_at``, on the role's precomputed spans."""
        spans = self.spans[self.role_index[n.role]]
        if spans is None:
            return due
        pub = self.rollout.published
        span = spans.next_open(pub + due)
        if span is None:
            return None
        if span[0] <= pub + due:
            return due
        return span[0] - pub + n.frac * min(self.policy.waves.spread, span[1] - span[0])

    def _measure(self) -> None:
        lam = self.lam if self.at_lam else 0.0
        total = self.fixed + lam * self.at_lam
        if total > self.peak * (1 + 1e-12):
            self.peak, self.peak_at = total, self.t
        peak_w, fixed_w, at_lam_w = self.peak_w, self.fixed_w, self.at_lam_w
        for w in range(len(peak_w)):
            r = fixed_w[w] + lam * at_lam_w[w]
            if r > peak_w[w]:
                peak_w[w] = r

    # -- flows --------------------------------------------------------------------------------
    def _begin(self, i: int) -> None:
        """Node i starts, or resumes after a window closed."""
        if self.fcls[i] is not None or self.done[i] is not None:
            return      # a cache its cluster made start early (``_swarm_start``) starts once
        t = self.t
        if i in self.superseded and t == self.due[i]:
            self.superseded.discard(i)   # its own poll's start: its cache told it earlier
            return
        c = self.home_cls[i]
        if c is None:
            n = self.nodes[i]
            self.start[i] = t
            k = n.home
            cached = n.swarm or (k >= 0 and self.cache_done[k] is not None
                                 and self.cache_done[k] <= t)
            self.source[i] = k if cached else -1
            self._swarm_start(i, n, t)
            if n.swarm:
                # The pipeline fills: the first pieces reach the node only after they crossed
                # the cache and a few neighbours (``agent.fleet.swarm.pipeline``), as if it
                # had that long's worth more to fetch.
                self.left[i] += self.caches[k].delay * n.cap
            origin = not cached
            key = (origin, n.cluster if origin else k, n.cap, self.nrole[i])
            c = self.by_key.get(key)
            if c is None:
                c = _Class(len(self.classes), origin, key[1], n.cap, key[3])
                self.classes.append(c)
                self.by_key[key] = c
                (self.cluster_classes if origin else self.cache_classes)[key[1]].append(c)
                self.role_classes[key[3]].append(c)
            self.home_cls[i] = c
        left = self.left[i]
        if left <= 0:
            self._done(i)
            return
        thr = self._progress(c) + left
        self._enqueue(i, c, thr, left)
        self._changed(c)
        if self.spans[c.role] is not None:
            self._arm_pause(c.role)

    def _enqueue(self, i: int, c: _Class, thr: float, left: float) -> None:
        """Node i's flow joins class c, done when the class's progress reaches ``thr``."""
        gen = self.fgen[i] = self.fgen[i] + 1
        self.fcls[i] = c
        self.fthr[i] = thr
        self.fjoin[i] = left
        heapq.heappush(c.heap, (thr, i, gen))
        c.n += 1

    def _arm_pause(self, w: int) -> None:
        """A pull of role w runs now: the closing of its window is an event (once)."""
        spans = self.spans[w]
        assert spans is not None
        now = self.rollout.published + self.t
        span = self.open_span[w]
        if span is None or not span[0] <= now < span[1]:
            span = self.open_span[w] = spans.span_at(now)
        if span is not None:
            end = span[1] - self.rollout.published
            if (w, end) not in self.pauses:
                self.pauses.add((w, end))
                self.push(end, self.PAUSE, w)
            self.armed[w] = span

    def _join_at_lam(self, i: int) -> bool:
        """Node i resumes into its class, which runs at the origin's level in a cluster whose
        uplink doesn't bind, and stays so with one more flow: only the level's sums move (and
        the cluster's own level, recomputed lazily). False, having changed nothing, if any of
        that doesn't hold: then the general path runs."""
        c = self.home_cls[i]
        if c is None or c.state != AT_LAM or c.n != c.wn or self.left[i] <= 0 \
                or self.fcls[i] is not None:
            return False
        g = c.group
        if self.csat[g]:
            return False
        at_lam = self.at_lam + 1
        lam = (self.origin_rate - self.fixed) / at_lam
        if (self.cn[g] + 1) * lam > self.uplink[g] * (1 - EPS):
            return False                     # the uplink might bind: worked out in full
        a_heap, classes = self.a_heap, self.classes
        while a_heap and (classes[a_heap[0][1]].state != AT_CAP
                          or classes[a_heap[0][1]].wgen != a_heap[0][2]):
            heapq.heappop(a_heap)
        if a_heap and -a_heap[0][0] > lam * (1 + EPS):
            return False                     # a capped class comes down to the level
        sat_heap, csat, cgen = self.sat_heap, self.csat, self.cgen
        while sat_heap and (not csat[sat_heap[0][1]] or cgen[sat_heap[0][1]] != sat_heap[0][2]):
            heapq.heappop(sat_heap)
        if sat_heap and -sat_heap[0][0] > lam * (1 + EPS):
            return False                     # a cluster's uplink stops binding
        left = self.left[i]
        thr = self.V - c.off + left
        self._enqueue(i, c, thr, left)
        c.wn += 1
        self.at_lam, self.lam = at_lam, lam
        w = c.role
        self.at_lam_w[w] += 1
        self.cn[g] += 1
        self.cdemand[g] += c.cap
        self.stale_levels.add(g)
        # The origin stays full (fixed + lam * at_lam = egress); only this role's share grew.
        r = self.fixed_w[w] + lam * self.at_lam_w[w]
        if r > self.peak_w[w]:
            self.peak_w[w] = r
        if c.pred is None or thr + c.off < c.pred[1]:
            self._predict(c)
        if self.spans[w] is not None:
            armed = self.armed[w]
            if armed is None or not armed[0] <= self.rollout.published + self.t < armed[1]:
                self._arm_pause(w)
        return True

    def _finish(self, c: _Class) -> None:
        fgen = self.fgen
        while c.heap:
            thr, i, gen = heapq.heappop(c.heap)
            if fgen[i] == gen:
                break
        else:
            return
        finished = [i]
        # flows that joined together with as much to fetch finish together: one event
        while c.heap and c.heap[0][0] == thr:
            _, j, gen = heapq.heappop(c.heap)
            if fgen[j] == gen:
                finished.append(j)
        for i in finished:
            self._end_flow(i, c, 0.0)
        c.n -= len(finished)
        self._changed(c)
        for i in finished:
            self._done(i)

    def _end_flow(self, i: int, c: _Class, left: float) -> None:
        """Flow i leaves class c with ``left`` bytes still to fetch (the caller counts c.n)."""
        if c.origin:
            self.obytes[i] += self.fjoin[i] - left
        self.left[i] = left
        self.fgen[i] += 1
        self.fcls[i] = None

    def _swarm_start(self, i: int, n: _Node, t: float) -> None:
        """With peers: a cache that starts names the version to its cluster (its piece server
        serves it as ``latest`` while pulling it) and tells every node to look now
        (``agent.pull.tell``), and a node that asks its cache for a version the cache hasn't
        seen (the model's first: the node learnt of it from the origin) makes the cache poll
        at once."""
        if n.cache >= 0 and self.caches[n.cache].swarm:
            for j in self.homed[n.cache]:
                known = self.learned[j]
                if self.start[j] is not None or (known is not None and known <= t):
                    continue
                node = self.nodes[j]
                self.learned[j] = t
                start = self._allowed(node, max(node.slot, t))
                due = self.due[j]
                if start is None or (due is not None and start >= due):
                    continue                 # told, but its windows start it no sooner
                if due is not None:
                    self.superseded.add(j)
                self.push(start, self.START, j)
        elif n.swarm:
            ci = self.caches[n.home].node
            known = self.learned[ci]
            if self.start[ci] is None and (known is None or known > t):
                cache = self.nodes[ci]
                self.learned[ci] = t
                start = self._allowed(cache, max(cache.slot, t))
                if start is not None:
                    self.push(start, self.POKE, ci)

    def _done(self, i: int) -> None:
        n = self.nodes[i]
        if n.swarm:
            # No node has a piece before its cache: it is done once the cache's last piece
            # has reached it too (``agent.fleet.swarm.pipeline``).
            k = n.home
            if self.cache_done[k] is None:
                self.waiting[k][i] = None
                return
            due = self.cache_done[k] + self.caches[k].delay
            if due > self.t:
                self.push(due, self.FINISH, i)
                return
        self.done[i] = self.t
        k = n.cache
        if k >= 0:
            self.cache_done[k] = self.t
            for j in self.waiting[k]:
                self.push(self.t + self.caches[k].delay, self.FINISH, j)
            self.waiting[k] = {}
            if not self.rollout.cold and not self.caches[k].swarm:
                for j in self.homed[k]:
                    start = self._schedule(j, self.t)
                    if start is not None:
                        self.push(start, self.START, j)

    def _pause_role(self, w: int) -> None:
        """The role's window closes: every pull of the role pauses, to resume at the next
        opening plus its own share of the spread (``schedule.pull_allowed_at``)."""
        pub, t = self.rollout.published, self.t
        eps = 1e-9 * self.rollout.per_node
        paused: list[int] = []
        finished: list[int] = []
        for c in self.role_classes[w]:
            if not c.n:
                continue
            s = self._progress(c)
            fgen = self.fgen
            for thr, i, gen in c.heap:
                if fgen[i] != gen:
                    continue
                left = thr - s
                if left <= eps:      # done as the window closes (rounding): done now
                    self._end_flow(i, c, 0.0)
                    finished.append(i)
                else:
                    self._end_flow(i, c, left)
                    paused.append(i)
            c.heap = []
            c.n = 0
            self._changed(c)
        for i in finished:
            self._done(i)
        spans = self.spans[w]
        assert spans is not None
        span = spans.next_open(pub + t + 1e-6)
        if span is None or not paused:
            return
        spread = min(self.policy.waves.spread, span[1] - span[0])
        base = span[0] - pub
        nodes = self.nodes
        self.push_batch([(base + nodes[i].frac * spread, i) for i in paused])

    # -- rates --------------------------------------------------------------------------------
    def _progress(self, c: _Class) -> float:
        return (self.V - c.off) if c.b else (c.u * self.t - c.off)

    def _retune(self, c: _Class, b: bool, u: float) -> None:
        """Change a class's mode or own rate, its coordinate continuous. Its finish prediction
        holds while neither changes (at lam it is a level of V, which lam doesn't move)."""
        if b == c.b and (b or u == c.u):
            c.u = u
            return
        s = self._progress(c)
        c.b, c.u = b, u
        c.off = (self.V - s) if b else (u * self.t - s)
        self._predict(c)

    def _predict(self, c: _Class) -> None:
        """When the class's first flow finishes: a time (own rate) or a level of V (at lam).
        A prediction that hasn't changed stays in its heap: most events change few."""
        heap, fgen = c.heap, self.fgen
        while heap and fgen[heap[0][1]] != heap[0][2]:
            heapq.heappop(heap)
        if not heap or c.n == 0:
            c.pgen += 1
            c.pred = None
            return
        at = (heap[0][0] + c.off) if c.b else (heap[0][0] + c.off) / c.u
        if c.pred == (c.b, at):
            return
        c.pgen += 1
        c.pred = (c.b, at)
        heap = self.hv if c.b else self.ht
        heapq.heappush(heap, (at, c.id, c.pgen))
        if len(heap) > 64 + 4 * len(self.classes):
            # Mostly stale predictions by now: keep the live ones, so pops stay cheap.
            live = [e for e in heap if self.classes[e[1]].pgen == e[2]]
            heapq.heapify(live)
            heap[:] = live

    def _changed(self, c: _Class) -> None:
        """A class gained or lost flows: its rates are recomputed once the events of this
        instant are all in (``_flush``)."""
        key = (c.origin, c.group)
        group = self.dirty.get(key)
        if group is None:
            self.dirty[key] = [c]
        elif group[-1] is not c:
            group.append(c)

    def _flush(self) -> None:
        if self.stale_levels:
            # Clusters whose flows joined by the fast path: their levels, before anything
            # compares them with lam.
            for g in self.stale_levels:
                level = self._cluster_level(g)
                if level != self.clevel[g]:
                    self.clevel[g] = level
                    self.cgen[g] += 1
                    if level < INF:
                        heapq.heappush(self.free_heap, (level, g, self.cgen[g]))
            self.stale_levels.clear()
        dirty, self.dirty = self.dirty, {}
        for (origin, g), changed in dirty.items():
            if origin:
                self._origin_cluster(g, changed)
            else:
                self._cache_group(g)
        if self.origin_moved:
            self.origin_moved = False
            self._rebalance()
            self._measure()
        for changed in dirty.values():
            for c in changed:
                self._predict(c)     # its first flow may have changed

    def _cache_group(self, k: int) -> None:
        """The shares of cache k's egress among its classes (no tie to the origin's)."""
        level = _level(self.cache_classes[k], self.caches[k].egress)
        for x in self.cache_classes[k]:
            if x.n:
                self._retune(x, False, min(x.cap, level))

    def _origin_cluster(self, g: int, changed: list[_Class]) -> None:
        """Classes of cluster g that fetch from the origin gained or lost flows: the sums of the
        origin's water level and the cluster's own level follow. The level ``lam`` itself is
        settled once for the instant (``_rebalance``)."""
        self.origin_moved = True
        pending = []
        for c in changed:
            d = c.n - c.wn
            if not d:
                continue
            self.cn[g] += d
            self.cdemand[g] += d * c.cap
            if not c.n:
                self._unplace(c)
            elif c.state == OUT:
                c.wn = c.n                 # counted once, should it change again this instant
                pending.append(c)
            elif c.state == AT_LAM:        # a count, not a threshold: its heap entry holds
                self.at_lam += d
                self.at_lam_w[c.role] += d
                c.wn = c.n
            else:                          # AT_CAP or SAT: fixed rates
                self.fixed += d * c.wr
                self.fixed_w[c.role] += d * c.wr
                self.nfixed += d
                c.wn = c.n
        if not self.cn[g]:
            self.cdemand[g] = 0.0          # no drift carried into the cluster's next flows
        level = self._cluster_level(g)
        if level != self.clevel[g]:
            self.clevel[g] = level
            self.cgen[g] += 1
            if self.csat[g]:
                heapq.heappush(self.sat_heap, (-level, g, self.cgen[g]))
                for x in self.cluster_classes[g]:
                    if x.state == SAT:
                        r = min(x.cap, level)
                        if r != x.wr:
                            self.fixed += x.wn * (r - x.wr)
                            self.fixed_w[x.role] += x.wn * (r - x.wr)
                            x.wr = r
                            self._retune(x, False, r)
            elif level < INF:
                heapq.heappush(self.free_heap, (level, g, self.cgen[g]))
        for c in pending:
            self._place(c, self.lam)

    def _cluster_level(self, g: int) -> float:
        """The fair share of cluster g's uplink among its origin flows, with their caps; INF
        when the caps alone keep under it."""
        up = self.uplink[g]
        if up == INF or self.cdemand[g] <= up * (1 + EPS):
            return INF
        return _level(self.cluster_classes[g], up)

    def _place(self, c: _Class, lam: float) -> None:
        """Count an origin class with flows into the water level: at its cluster's level if the
        uplink binds, at its cap if that is under lam, else at lam."""
        c.wn = c.n
        c.wgen += 1
        w = c.role
        if self.csat[c.group]:
            c.state = SAT
            c.wr = min(c.cap, self.clevel[c.group])
        elif c.cap <= lam:
            c.state = AT_CAP
            c.wr = c.cap
            heapq.heappush(self.a_heap, (-c.cap, c.id, c.wgen))
        else:
            c.state = AT_LAM
            self.at_lam += c.n
            self.at_lam_w[w] += c.n
            heapq.heappush(self.b_heap, (c.cap, c.id, c.wgen))
            self._retune(c, True, c.cap)
            return
        self.fixed += c.n * c.wr
        self.fixed_w[w] += c.n * c.wr
        self.nfixed += c.n
        self._retune(c, False, c.wr)

    def _unplace(self, c: _Class) -> None:
        if c.state == AT_LAM:
            self.at_lam -= c.wn
            self.at_lam_w[c.role] -= c.wn
        elif c.state != OUT:
            self.fixed -= c.wn * c.wr
            self.fixed_w[c.role] -= c.wn * c.wr
            self.nfixed -= c.wn
            if not self.nfixed:            # no drift left behind by the additions
                self.fixed = 0.0
                self.fixed_w = [0.0] * len(self.fixed_w)
        c.state = OUT
        c.wn = 0
        c.wgen += 1

    def _bind(self, g: int, lam: float) -> None:
        """Cluster g's uplink binds (its level fell under lam): its classes run at
        min(cap, level) and the cluster takes exactly its uplink from the origin."""
        self.csat[g] = True
        self.cgen[g] += 1
        heapq.heappush(self.sat_heap, (-self.clevel[g], g, self.cgen[g]))
        for x in self.cluster_classes[g]:
            if x.state != OUT:
                self._unplace(x)
                self._place(x, lam)

    def _unbind(self, g: int, lam: float) -> None:
        self.csat[g] = False
        self.cgen[g] += 1
        heapq.heappush(self.free_heap, (self.clevel[g], g, self.cgen[g]))
        for x in self.cluster_classes[g]:
            if x.state != OUT:
                self._unplace(x)
                self._place(x, lam)

    def _rebalance(self) -> None:
        """The origin's level lam: fixed + lam * at_lam = egress, every unit consistent with it.

        Each unit has a threshold: a class its cap (at lam above it, at its cap under it), a
        cluster its uplink's level (bound under lam). A unit on the wrong side moves; each move
        raises lam towards the fixed point and never past it (every assignment's demand is at
        least the true one at any level), so it ends, after a few moves per changed unit."""
        classes, cap = self.classes, self.origin_rate
        a_heap, b_heap, free_heap, sat_heap = self.a_heap, self.b_heap, self.free_heap, \
            self.sat_heap
        csat, cgen = self.csat, self.cgen
        for _ in range(4 * (len(classes) + len(self.uplink)) + 8):
            while a_heap and (classes[a_heap[0][1]].state != AT_CAP
                              or classes[a_heap[0][1]].wgen != a_heap[0][2]):
                heapq.heappop(a_heap)
            while b_heap and (classes[b_heap[0][1]].state != AT_LAM
                              or classes[b_heap[0][1]].wgen != b_heap[0][2]):
                heapq.heappop(b_heap)
            while free_heap and (csat[free_heap[0][1]] or cgen[free_heap[0][1]] != free_heap[0][2]):
                heapq.heappop(free_heap)
            while sat_heap and (not csat[sat_heap[0][1]]
                                or cgen[sat_heap[0][1]] != sat_heap[0][2]):
                heapq.heappop(sat_heap)
            if self.at_lam:
                lam = (cap - self.fixed) / self.at_lam
            elif self.fixed > cap * (1 + 1e-9):
                # The origin binds and nothing runs at its level yet: the unit with the highest
                # threshold is the first that lam, coming down from infinity, reaches.
                top_a = -a_heap[0][0] if a_heap else -INF
                top_s = -sat_heap[0][0] if sat_heap else -INF
                if top_a >= top_s and a_heap:
                    self._to_lam(classes[a_heap[0][1]])
                elif sat_heap:
                    self._unbind(sat_heap[0][1], -INF)
                else:
                    raise RuntimeError("the origin's fair share did not settle (a wagent bug)")
                continue
            else:
                lam = INF
            if b_heap and b_heap[0][0] < lam * (1 - EPS):
                self._to_cap(classes[b_heap[0][1]])
            elif a_heap and -a_heap[0][0] > lam * (1 + EPS):
                self._to_lam(classes[a_heap[0][1]])
            elif free_heap and free_heap[0][0] < lam * (1 - EPS):
                self._bind(free_heap[0][1], lam)
            elif sat_heap and -sat_heap[0][0] > lam * (1 + EPS):
                self._unbind(sat_heap[0][1], lam)
            else:
                self.lam = lam
                return
        raise RuntimeError("the origin's fair share did not settle (a wagent bug)")

    def _to_lam(self, x: _Class) -> None:
        self._unplace(x)
        self._place(x, -INF)

    def _to_cap(self, x: _Class) -> None:
        self._unplace(x)
        self._place(x, INF)

    # -- the result ---------------------------------------------------------------------------
    def result(self) -> FleetPlan:
        pub = self.rollout.published
        nodes = self.nodes
        ids = [n.id for n in nodes]

        def at(t: float | None) -> float | None:
            return None if t is None else pub + t

        per_node = tuple(
            NodeResult(n.id, self.clusters[n.cluster][0], n.role, pub + n.slot,
                       at(self.learned[i]), at(self.start[i]), at(self.done[i]),
                       None if self.source[i] == -2 else "origin" if self.source[i] < 0
                       else ids[self.caches[self.source[i]].node], self.obytes[i])
            for i, n in enumerate(nodes))
        by_role: dict[str, list[NodeResult]] = {r: [] for r in self.roles}
        for r in per_node:
            by_role[r.role].append(r)
        waves = []
        for w, role in enumerate(self.roles):
            mine = by_role[role]
            done = sorted(r.done for r in mine if r.done is not None)
            starts = [r.start for r in mine if r.start is not None]
            waves.append(WaveResult(
                role, schedule.wave_index(self.policy, role), len(mine),
                min(starts, default=None), _pct(done, 0.5), _pct(done, 0.99),
                done[-1] if done else None, sum(r.origin_bytes for r in mine),
                self.peak_w[w] * 8, sum(1 for r in mine if r.source not in (None, "origin")),
                len(mine) - len(done)))
        clusters = []
        by_cluster: dict[str, list[NodeResult]] = {}
        for r in per_node:
            by_cluster.setdefault(r.cluster, []).append(r)
        # What each cache sent its nodes: a copy each without peers, each piece once with them.
        sent = [0.0] * len(self.caches)
        for i, n in enumerate(nodes):
            if n.home >= 0 and self.source[i] == n.home and not n.swarm:
                sent[n.home] += self.rollout.per_node
        for k, ch in enumerate(self.caches):
            if ch.swarm:
                sent[k] = self.rollout.per_node if self.cache_done[k] is not None else 0.0
        of_cluster: dict[int, list[int]] = {}  # cluster -> its caches
        for k, ch in enumerate(self.caches):
            of_cluster.setdefault(nodes[ch.node].cluster, []).append(k)
        for g, (name, _) in enumerate(self.clusters):
            mine = by_cluster.get(name, [])
            done = [r.done for r in mine if r.done is not None]
            ks = of_cluster.get(g, [])
            clusters.append(ClusterResult(name, len(mine), sum(r.origin_bytes for r in mine),
                                          max(done) if len(done) == len(mine) and done
                                          else None, sum(sent[k] for k in ks),
                                          any(self.caches[k].swarm for k in ks)))
        finished = [r.done for r in per_node if r.done is not None]
        return FleetPlan(pub, self.rollout.size, self.rollout.per_node, self.rollout.cold,
                         tuple(waves), tuple(clusters), sum(self.obytes), self.peak * 8,
                         at(self.peak_at), max(finished) if len(finished) == len(per_node)
                         and finished else None, per_node)


def _level(classes: list[_Class], capacity: float) -> float:
    """The fair share of a link among classes of flows with caps: flows capped below it get
    their cap, the others this level. INF when the link is no constraint."""
    if capacity == INF:
        return INF
    count = 0
    low = INF
    for c in classes:
        if c.n:
            count += c.n
            low = min(low, c.cap)
    if not count:
        return INF
    if low >= capacity / count:           # the common case: every flow wants more than a share
        return capacity / count
    live = sorted((c for c in classes if c.n), key=lambda c: c.cap)
    left = capacity
    for c in live:
        share = left / count
        if c.cap >= share:
            return share
        left -= c.n * c.cap
        count -= c.n
    return INF


def _pct(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not sorted_values:
        return None
    k = max(0, math.ceil(q * len(sorted_values)) - 1)
    return sorted_values[k]
