"""A version rolled out through a fleet, simulated: when each node has it, and what the origin
serves. Pure: a Topology, a Policy and a Rollout in, a FleetPlan out.

What each node does is what the daemon does:

* **Its slot** comes from ``agent.schedule.slot`` (published + cache lead + wave x gap + its
  own offset), hashed from a node id the plan gives it (``CLUSTER-ROLE-N``), then moved into its
  role's windows as ``agent.schedule.pull_allowed_at`` does; a pull that reaches the end of its
  window pauses and resumes at the next opening.
* **When it learns of the version.** Every node polls ``{source}/{model}/latest`` every
  ``poll_interval`` (its phase in the interval from a hash of its id). Sources are tried in
  order, the cluster's cache first: a cache node serves ``latest`` naming a version only once it
  holds it completely (``agent.announce``), so a node behind a cache learns of the version at its
  first poll after its cache has it, and starts at ``max(slot, learned)``. Cache nodes poll the
  origin (they skip sources marked ``cache: true``). A node without a cache learns from the
  origin. ``cold``: the caches have never announced a version of this model (its first
  version), so ``latest`` 404s on them and every node learns from the origin, as before caches
  served ``latest``.
* **Its source**: its cache if the cache holds the version when the pull starts, else the
  origin, for the whole pull (the pull's streams stay with the source that answered).
* **Its rate**: max-min fair sharing (what TCP flows sharing bottlenecks tend to) of the
  origin's egress, each cluster's uplink (the origin's traffic into the cluster), each cache
  node's egress, and each node's cap: its link, and the policy's ``pulls.rate`` and
  ``shaping.ceil``. Link rates are multiplied by the topology's ``efficiency`` (headers).

The simulation is a fluid one, event driven: rates are recomputed at every start, finish, pause
and resume. It is exact for that model and fast for 100k nodes, because flows that share every
constraint (same source, same cluster, same cap) get the same rate: they form a class, whose
flows advance along one shared coordinate, and finish in the order of their thresholds on it.
The origin's fair share ``lam`` is kept by a water level over the classes: classes limited
below it by their own cap or cluster link (set A) progress at their own rate, the others (set B)
at ``lam``, along the integral ``V`` of ``lam``, so a change of ``lam`` costs nothing per class.
Not simulated: backoff (training traffic), TCP slow start, per-request latency, failures.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass

from agent import schedule
from agent.fleet.topology import Topology
from agent.policy.model import Policy

INF = math.inf
HORIZON = 400 * 86400.0        # windows are looked up this far ahead of publication


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
    phase: float                   # poll phase, seconds into the interval
    cap: float                     # bytes/s
    home: int                      # the cache (index) it fetches from; -1: none
    cache: int                     # this node's own cache index, -1: not a cache node


def simulate_fleet(topology: Topology, policy: Policy, rollout: Rollout) -> FleetPlan:
    """The rollout of one version through the fleet (see the module's docstring)."""
    nodes, clusters, caches = _nodes(topology, policy, rollout)
    sim = _Sim(topology, policy, rollout, nodes, clusters, caches)
    sim.run()
    return sim.result()


def _nodes(topology: Topology, policy: Policy, rollout: Rollout
           ) -> tuple[list[_Node], list[tuple[str, float]], list[tuple[int, float]]]:
    """Every node with its slot and cap; clusters as (name, uplink bytes/s); caches as
    (their node's index, egress bytes/s)."""
    eff = topology.efficiency / 8.0                  # bits/s of a link -> goodput bytes/s
    policy_cap = INF
    if policy.pulls.rate:
        policy_cap = policy.pulls.rate / 8.0         # a token bucket on body bytes: goodput
    if policy.shaping.enabled:
        policy_cap = min(policy_cap, policy.shaping.ceil * eff)
    serve_cap = (policy.shaping.ceil * eff if policy.shaping.enabled and policy.shaping.serve_ports
                 else INF)
    poll = policy.poll_interval
    cache_role = policy.cache_role
    nodes: list[_Node] = []
    clusters: list[tuple[str, float]] = []
    caches: list[tuple[int, float]] = []

    def add(node_id: str, ci: int, role: str, link: int, home: int, cache: int) -> None:
        frac = schedule.offset_fraction(node_id, role, rollout.model, rollout.version)
        slot = schedule.slot_from_fraction(0.0, frac, role, policy)
        nodes.append(_Node(node_id, ci, role, frac, slot, _phase(node_id) * poll,
                           min(link * eff, policy_cap), home, cache))

    for ci, (name, c) in enumerate(topology.expanded()):
        clusters.append((name, c.link * eff if c.link is not None else INF))
        homes = []
        if c.cache is not None:
            if cache_role is None:
                raise ValueError(f"cluster {name} has cache nodes but the policy has no "
                                 "cache_role")
            for k in range(1, c.cache.nodes + 1):
                homes.append(len(caches))
                caches.append((len(nodes), min(c.cache_egress * eff, serve_cap)))
                add(f"{name}-{cache_role}-{k}", ci, cache_role, c.cache_link, -1, homes[-1])
        for g in c.nodes:
            if g.role == cache_role:
                raise ValueError(f"cluster {name}: nodes of the cache role {cache_role!r} go "
                                 "under cache:, not nodes:")
            for k in range(1, g.count + 1):
                home = homes[(k - 1) % len(homes)] if homes else -1
                add(f"{name}-{g.role}-{k}", ci, g.role, c.link_of(g), home, -1)
    return nodes, clusters, caches


def _phase(node_id: str) -> float:
    """Where in the poll interval this node polls: the daemons start at unrelated times."""
    digest = hashlib.sha256(f"{node_id}|poll".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class _Class:
    """Flows that share every constraint, hence a rate. Progress along a coordinate S: a flow
    joining at S0 with R bytes left finishes when S reaches S0 + R. In own mode S = u*t - off;
    in mode B (held at the origin's level) S = V - off."""

    __slots__ = ("id", "origin", "group", "cap", "role", "heap", "n", "u", "b", "off", "pgen",
                 "pred", "wgen", "wn", "wu", "in_wf")

    def __init__(self, cid: int, origin: bool, group: int, cap: float, role: int) -> None:
        self.id, self.origin, self.group, self.cap, self.role = cid, origin, group, cap, role
        self.heap: list[tuple[float, int, int]] = []      # (threshold, node, flow generation)
        self.n = 0
        self.u = 1.0               # own rate limit (cap, cluster or cache share)
        self.b = False             # in set B: progresses at the origin's level lam
        self.off = 0.0
        self.pgen = 0              # generation of its finish prediction
        self.pred: tuple[bool, float] | None = None     # the prediction in the heaps
        self.wgen = 0              # generation of its entry in the origin's water level
        self.wn, self.wu, self.in_wf = 0, 0.0, False


class _Sim:
    """The event loop and its state: private, filled by ``simulate_fleet`` and read back by
    ``result``. Times are seconds after publication; rates bytes per second."""

    def __init__(self, topology: Topology, policy: Policy, rollout: Rollout,
                 nodes: list[_Node], clusters: list[tuple[str, float]],
                 caches: list[tuple[int, float]]) -> None:
        self.topology, self.policy, self.rollout = topology, policy, rollout
        self.nodes, self.clusters, self.caches = nodes, clusters, caches
        self.origin_rate = topology.origin.egress * topology.efficiency / 8.0
        self.roles = sorted({n.role for n in nodes},
                            key=lambda r: (-1 if schedule.wave_index(policy, r) is None
                                           else schedule.wave_index(policy, r), r))
        self.role_index = {r: i for i, r in enumerate(self.roles)}
        self.spans: dict[str, schedule.Spans | None] = {}
        pub = rollout.published
        for r in self.roles:
            windows = schedule.windows_for(policy, r)
            self.spans[r] = (schedule.Spans.build(windows, pub, pub + HORIZON) if windows
                             else None)
        count = len(nodes)
        self.learned: list[float | None] = [None] * count
        self.start: list[float | None] = [None] * count
        self.done: list[float | None] = [None] * count
        self.source: list[int] = [-2] * count          # -1 origin, k: cache k, -2 not started
        self.obytes = [0.0] * count
        self.left = [float(rollout.per_node)] * count  # bytes still to fetch
        self.fgen = [0] * count
        self.fcls: list[_Class | None] = [None] * count
        self.fthr = [0.0] * count
        self.fjoin = [0.0] * count                     # bytes left when the flow joined
        self.cache_done: list[float | None] = [None] * len(caches)
        self.homed: list[list[int]] = [[] for _ in caches]
        for i, n in enumerate(nodes):
            if n.home >= 0:
                self.homed[n.home].append(i)
        self.classes: list[_Class] = []
        self.by_key: dict[tuple[bool, int, float, int], _Class] = {}
        self.cluster_classes: list[list[_Class]] = [[] for _ in clusters]
        self.cache_classes: list[list[_Class]] = [[] for _ in caches]
        # the origin's water level
        self.lam = INF
        self.V = 0.0
        self.t = 0.0
        self.sa = 0.0                                  # sum n*u over set A
        self.nb = 0                                    # flows in set B
        self.sa_w = [0.0] * len(self.roles)
        self.nb_w = [0] * len(self.roles)
        self.a_heap: list[tuple[float, int, int]] = []  # (-u, class, wgen): A's largest u
        self.b_heap: list[tuple[float, int, int]] = []  # (u, class, wgen): B's smallest u
        self.ht: list[tuple[float, int, int]] = []      # (finish time, class, pgen)
        self.hv: list[tuple[float, int, int]] = []      # (finish level V, class, pgen)
        self.events: list[tuple[float, int, int, int, int]] = []  # time seq kind node gen
        self.seq = 0
        self.peak = 0.0
        self.peak_at: float | None = None
        self.peak_w = [0.0] * len(self.roles)
        self.measure = False           # the origin's rates changed since last measured
        # classes changed at the current instant, by group; None: recompute at once
        self.dirty: dict[tuple[bool, int], list[_Class]] | None = None

    # -- events -------------------------------------------------------------------------------
    START, PAUSE = 0, 1

    def push(self, t: float, kind: int, node: int, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, node, gen))

    def run(self) -> None:
        poll = self.policy.poll_interval
        for i, n in enumerate(self.nodes):
            if n.home >= 0 and not self.rollout.cold:
                continue          # learns from its cache's `latest` once the cache has it
            self._schedule(i, self._next_poll(n, 0.0) if poll > 0 else 0.0)
        # The starts known up front, sorted once: cheaper than a heap of 100k entries. Events
        # made on the way (starts after a cache fills, pauses, resumes) go to the heap.
        initial, self.events = sorted(self.events), []
        at = 0
        while True:
            te = self.events[0][0] if self.events else INF
            if at < len(initial) and initial[at][0] <= te:
                te = initial[at][0]
            ht, hv = self.ht, self.hv
            classes = self.classes
            while ht and classes[ht[0][1]].pgen != ht[0][2]:
                heapq.heappop(ht)
            th = ht[0][0] if ht else INF
            while hv and classes[hv[0][1]].pgen != hv[0][2]:
                heapq.heappop(hv)
            tv = INF
            if hv and self.lam < INF and self.lam > 0:
                tv = self.t + max(0.0, hv[0][0] - self.V) / self.lam
            tn = min(te, th, tv)
            if tn == INF:
                return
            self._advance(max(tn, self.t))
            self.dirty = {}
            if tn == te and te < th and te < tv:    # on a tie, flows finish first
                # Every start and pause at this instant, then the rates once: a window that
                # closes pauses thousands of pulls at the same second.
                while True:
                    if at < len(initial) and initial[at][0] == tn:
                        _, _, kind, node, gen = initial[at]
                        at += 1
                    elif self.events and self.events[0][0] == tn:
                        _, _, kind, node, gen = heapq.heappop(self.events)
                    else:
                        break
                    if kind == self.START:
                        self._begin(node)
                    else:
                        self._pause(node, gen)
            else:
                c = classes[heapq.heappop(ht if tn == th else hv)[1]]
                c.pred = None                 # consumed: the next one is pushed anew
                self._finish(c)
            dirty, self.dirty = self.dirty, None
            self._flush(dirty)
            if self.measure:
                self._measure()

    def _next_poll(self, n: _Node, t: float) -> float:
        """The node's first poll at or after ``t``."""
        poll = self.policy.poll_interval
        if poll <= 0:
            return t
        k = math.ceil((t - n.phase) / poll)
        return n.phase + max(k, 0) * poll

    def _schedule(self, i: int, learned: float) -> None:
        n = self.nodes[i]
        self.learned[i] = learned
        start = self._allowed(n, max(n.slot, learned))
        if start is not None:
            self.push(start, self.START, i)

    def _allowed(self, n: _Node, due: float) -> float | None:
        """``schedule.pull_allowed_at``, on the role's precomputed spans."""
        spans = self.spans[n.role]
        if spans is None:
            return due
        pub = self.rollout.published
        span = spans.next_open(pub + due)
        if span is None:
            return None
        if span[0] <= pub + due:
            return due
        return span[0] - pub + n.frac * min(self.policy.waves.spread, span[1] - span[0])

    def _advance(self, t: float) -> None:
        dt = t - self.t
        if dt > 0 and self.nb and self.lam < INF:
            self.V += self.lam * dt
        self.t = t

    def _measure(self) -> None:
        self.measure = False
        lam = self.lam if self.nb else 0.0
        total = self.sa + lam * self.nb
        if total > self.peak * (1 + 1e-12):
            self.peak, self.peak_at = total, self.t
        for w in range(len(self.roles)):
            r = self.sa_w[w] + lam * self.nb_w[w]
            if r > self.peak_w[w]:
                self.peak_w[w] = r

    # -- flows --------------------------------------------------------------------------------
    def _begin(self, i: int) -> None:
        """Node i starts, or resumes after a window closed."""
        n = self.nodes[i]
        t = self.t
        if self.start[i] is None:
            self.start[i] = t
            k = n.home
            self.source[i] = k if k >= 0 and self.cache_done[k] is not None \
                and self.cache_done[k] <= t else -1
        if self.left[i] <= 0:
            self._done(i)
            return
        src = self.source[i]
        origin = src < 0
        group = n.cluster if origin else src
        key = (origin, group, n.cap, self.role_index[n.role])
        c = self.by_key.get(key)
        if c is None:
            c = _Class(len(self.classes), origin, group, n.cap, key[3])
            self.classes.append(c)
            self.by_key[key] = c
            (self.cluster_classes if origin else self.cache_classes)[group].append(c)
        s = self._progress(c)
        self.fgen[i] += 1
        self.fcls[i] = c
        self.fthr[i] = s + self.left[i]
        self.fjoin[i] = self.left[i]
        heapq.heappush(c.heap, (self.fthr[i], i, self.fgen[i]))
        c.n += 1
        self._changed(c)
        spans = self.spans[n.role]
        if spans is not None:
            span = spans.span_at(self.rollout.published + t)
            if span is not None:
                self.push(span[1] - self.rollout.published, self.PAUSE, i, self.fgen[i])

    def _finish(self, c: _Class) -> None:
        while c.heap:
            thr, i, gen = heapq.heappop(c.heap)
            if self.fgen[i] == gen:
                break
        else:
            return
        finished = [i]
        # flows that joined together with as much to fetch finish together: one event
        while c.heap and c.heap[0][0] == thr:
            _, j, gen = heapq.heappop(c.heap)
            if self.fgen[j] == gen:
                finished.append(j)
        for i in finished:
            self.fgen[i] += 1
            c.n -= 1
            if c.origin:
                self.obytes[i] += self.fjoin[i]
            self.left[i] = 0.0
            self.fcls[i] = None
        self._changed(c)
        for i in finished:
            self._done(i)

    def _done(self, i: int) -> None:
        self.done[i] = self.t
        k = self.nodes[i].cache
        if k >= 0:
            self.cache_done[k] = self.t
            if not self.rollout.cold:
                for j in self.homed[k]:
                    self._schedule(j, self._next_poll(self.nodes[j], self.t))

    def _pause(self, i: int, gen: int) -> None:
        if self.fgen[i] != gen:
            return                                     # finished before its window closed
        c = self.fcls[i]
        assert c is not None
        left = max(0.0, self.fthr[i] - self._progress(c))
        if left <= 1e-9 * self.rollout.per_node:
            return          # done as the window closes: rounding, its finish is due now
        if c.origin:
            self.obytes[i] += self.fjoin[i] - left
        self.left[i] = left
        self.fgen[i] += 1
        self.fcls[i] = None
        c.n -= 1
        self._changed(c)
        n = self.nodes[i]
        spans = self.spans[n.role]
        assert spans is not None
        end = self.rollout.published + self.t
        span = spans.next_open(end + 1e-6)
        if span is not None:       # resumes as schedule.pull_allowed_at says
            resume = span[0] + n.frac * min(self.policy.waves.spread, span[1] - span[0])
            self.push(resume - self.rollout.published, self.START, i)

    # -- rates --------------------------------------------------------------------------------
    def _progress(self, c: _Class) -> float:
        return (self.V - c.off) if c.b else (c.u * self.t - c.off)

    def _retune(self, c: _Class, b: bool, u: float) -> None:
        """Change a class's mode or own rate, its coordinate continuous. Its finish prediction
        holds while neither changes (in B it is a level of V, which lam doesn't move)."""
        if b == c.b and (b or u == c.u):
            c.u = u
            return
        s = self._progress(c)
        c.b, c.u = b, u
        c.off = (self.V - s) if b else (u * self.t - s)
        self._predict(c)

    def _predict(self, c: _Class) -> None:
        """When the class's first flow finishes: a time (own rate) or a level of V (in B).
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
        """A class gained or lost a flow: noted, and its rates recomputed once the events of
        this instant are all in (``_flush``)."""
        if self.dirty is not None:
            self.dirty.setdefault((c.origin, c.group), []).append(c)
        else:
            self._flush({(c.origin, c.group): [c]})

    def _flush(self, dirty: dict[tuple[bool, int], list[_Class]]) -> None:
        for classes in dirty.values():
            self._regroup(classes[0])
            for c in classes[1:]:
                self._predict(c)

    def _regroup(self, c: _Class) -> None:
        """A class's group (its cluster's origin classes, or a cache's): its shares, then the
        origin's level."""
        if not c.origin:
            level = _level(self.cache_classes[c.group], self.caches[c.group][1])
            for x in self.cache_classes[c.group]:
                if x.n:
                    self._retune(x, False, min(x.cap, level))
            self._predict(c)
            return
        level = _level(self.cluster_classes[c.group], self.clusters[c.group][1])
        moved = False
        for x in self.cluster_classes[c.group]:
            u = min(x.cap, level)
            if x.in_wf and x.n == x.wn and u == x.wu:
                continue
            moved = moved or x.in_wf or x.n > 0
            self._wf_remove(x)
            if x.n:
                self._wf_add(x, u)
        if moved:
            self._rebalance()
            self.measure = True
        self._predict(c)            # its first flow may have changed

    def _wf_remove(self, x: _Class) -> None:
        if not x.in_wf:
            return
        if x.b:
            self.nb -= x.wn
            self.nb_w[x.role] -= x.wn
        else:
            self.sa -= x.wn * x.wu
            self.sa_w[x.role] -= x.wn * x.wu
        x.in_wf = False
        x.wgen += 1

    def _wf_add(self, x: _Class, u: float) -> None:
        x.in_wf, x.wn, x.wu = True, x.n, u
        x.wgen += 1
        if u <= self.lam:
            self._retune(x, False, u)
            self.sa += x.n * u
            self.sa_w[x.role] += x.n * u
            heapq.heappush(self.a_heap, (-u, x.id, x.wgen))
        else:
            self._retune(x, True, u)
            self.nb += x.n
            self.nb_w[x.role] += x.n
            heapq.heappush(self.b_heap, (u, x.id, x.wgen))

    def _rebalance(self) -> None:
        """The origin's level lam: sum over origin classes of n * min(u, lam) = egress.

        Classes move between A (own rate u <= lam) and B (rate lam) until both sides agree;
        each move is O(log classes) and a change of one class moves few."""
        classes, a_heap, b_heap, cap = self.classes, self.a_heap, self.b_heap, self.origin_rate
        for _ in range(4 * len(classes) + 8):
            while a_heap and (not classes[a_heap[0][1]].in_wf or classes[a_heap[0][1]].b
                              or classes[a_heap[0][1]].wgen != a_heap[0][2]):
                heapq.heappop(a_heap)
            while b_heap and (not classes[b_heap[0][1]].in_wf or not classes[b_heap[0][1]].b
                              or classes[b_heap[0][1]].wgen != b_heap[0][2]):
                heapq.heappop(b_heap)
            if self.nb == 0:
                if self.sa <= cap * (1 + 1e-9) or not a_heap:
                    self.lam = INF
                    return
                self._move(classes[a_heap[0][1]], to_b=True)
                continue
            lam = (cap - self.sa) / self.nb
            if b_heap and b_heap[0][0] < lam * (1 - 1e-12):
                self._move(classes[b_heap[0][1]], to_b=False)
                continue
            if a_heap and -a_heap[0][0] > lam * (1 + 1e-12):
                self._move(classes[a_heap[0][1]], to_b=True)
                continue
            self.lam = lam
            return
        raise RuntimeError("the origin's fair share did not settle (a wagent bug)")

    def _move(self, x: _Class, to_b: bool) -> None:
        u = x.wu
        if to_b:
            self.sa -= x.wn * u
            self.sa_w[x.role] -= x.wn * u
            self.nb += x.wn
            self.nb_w[x.role] += x.wn
        else:
            self.nb -= x.wn
            self.nb_w[x.role] -= x.wn
            self.sa += x.wn * u
            self.sa_w[x.role] += x.wn * u
        x.wgen += 1
        heapq.heappush(self.b_heap if to_b else self.a_heap,
                       (u, x.id, x.wgen) if to_b else (-u, x.id, x.wgen))
        # The coordinate of a class in B follows V, whose rate lam is only settled once the
        # moves are done; lam only changes the future, so converting now is exact.
        self._retune(x, to_b, u)

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
                       else ids[self.caches[self.source[i]][0]], self.obytes[i])
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
        for name, _ in self.clusters:
            mine = by_cluster.get(name, [])
            done = [r.done for r in mine if r.done is not None]
            clusters.append(ClusterResult(name, len(mine), sum(r.origin_bytes for r in mine),
                                          max(done) if len(done) == len(mine) and done
                                          else None))
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
