"""The status model: the daemon's state in, a versioned JSON document and a human summary out.

Everything here is pure. The daemon assembles a :class:`DaemonState` from its parts (policy,
shaper, backoff loop, pull worker, store) and :func:`to_json` turns it into the document that
``wagent status --json`` prints and monitoring parses. That document is an API: its fields are
documented in ``docs/status.md``, ``"schema"`` is bumped on any incompatible change, and the
client renders the human text (:func:`to_text`) from the document, never from daemon internals,
so the two can't disagree. The metrics (``agent.metrics``) read the same ``DaemonState``.

>>> doc = to_json(DaemonState(pid=1, started_at=0.0, version="0.1.0"), now=10.0)
>>> doc["schema"], doc["health"], exit_code(doc)
(1, 'healthy', 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.units import format_duration, format_rate, format_size

SCHEMA = 1

# Exit codes of `wagent status`, stable (design.md, LSB status convention).
EXIT_HEALTHY = 0
EXIT_DEGRADED = 1
EXIT_NOT_RUNNING = 3

# Pull states, in the order a version goes through them.
PULL_STATES = ("idle", "waiting_slot", "waiting_window", "queued", "paused", "pulling", "done",
               "failed")

# Every kind ``daemon.error_counts`` may hold (docs/status.md). The document carries only the
# kinds seen; the metrics export all of them from the start, because a counter that appears on
# its first error has no 0 before it and rate()/increase() miss that first error.
ERROR_KINDS = ("backoff_apply", "metrics", "pull", "reload", "shaping_repairs", "status")


@dataclass(frozen=True)
class NodeInfo:
    id: str = ""
    hostname: str = ""
    role: str = ""
    wave_index: int | None = None       # position in policy.waves.order; None: cache or no wave
    wave_delay: float = 0.0             # wave index x wave gap, seconds after publication


@dataclass(frozen=True)
class PolicyInfo:
    path: str = ""
    sha256: str = ""
    loaded_at: float | None = None
    last_error: str | None = None       # "file:line: message" lines of the last refused reload
    last_error_at: float | None = None
    reloads: int = 0                    # successful reloads since start


@dataclass(frozen=True)
class ClassCounters:
    name: str                           # "distribution" or "default"
    classid: str = ""
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    overlimits: int = 0
    rate_bps: int | None = None         # configured guaranteed rate
    ceil_bps: int | None = None         # configured ceil (the distribution class's is the live cap)
    backlog: int = 0                    # bytes queued now
    est_bps: int = 0                    # the kernel's rate estimate (0: no estimator)


@dataclass(frozen=True)
class ShapedInterface:
    name: str
    direction: str                      # "ingress" (via device) or "egress"
    device: str = ""                    # where the HTB tree lives (the IFB for ingress)
    classes: tuple[ClassCounters, ...] = ()


@dataclass(frozen=True)
class ShapingInfo:
    enabled: bool = False
    # the policy's shaping.ceil (its JSON key is "cap_bps", named so before schema 1 was fixed)
    policy_ceil_bps: int | None = None
    current_ceil_bps: int | None = None  # what the backoff controller set last
    interfaces: tuple[ShapedInterface, ...] = ()
    error: str | None = None
    notes: tuple[str, ...] = ()         # what the last apply said (adopted a tree, left an
                                        # interface alone because of someone else's qdisc, ...)


@dataclass(frozen=True)
class BackoffEvent:
    at: float
    state: str
    reason: str
    rate_bps: int | None = None


@dataclass(frozen=True)
class BackoffInfo:
    enabled: bool = False
    state: str = "off"                  # "off", "full", "backed_off", "ramping"
    reason: str = ""
    since: float | None = None
    rate_bps: int | None = None         # target rate now (None: uncapped)
    floor_bps: int | None = None
    cap_bps: int | None = None
    events: tuple[BackoffEvent, ...] = ()   # most recent last, bounded
    events_total: int = 0               # times training traffic made it back off, since start
    readings: Mapping[str, float] = field(default_factory=dict)
    # the same backoffs, by the kind of signal that caused them (training_port, link, rdma,
    # nccl; one backoff may count for several)
    events_by_signal: Mapping[str, int] = field(default_factory=dict)
    # yielding's account (agent.yielding.account): how long the slow path held distribution
    # under its cap; while training was on the node, the link capacity other traffic left free
    # and what the pull carried of it; the bursts seen (the fast path's detector's count when
    # it is on, else rises over the threshold from one tick to the next)
    yielded_s: float = 0.0
    idle_bytes: int = 0
    pulled_bytes: int = 0
    bursts: int = 0
    # the fast path (agent.yielding.bursts): "on: eth0" or "off: why"; how long its cuts held
    # the pull's readers
    fast_path: str = "off"
    cut_s: float = 0.0
    anticipated: int = 0                # periodic bursts the readers stopped for before they came

    @property
    def idle_used(self) -> float | None:
        return self.pulled_bytes / self.idle_bytes if self.idle_bytes > 0 else None


@dataclass(frozen=True)
class PullProgress:
    """How far a pull is: what ``agent.pull.engine.pull_version`` hands its progress callback
    (about twice a second, and once per landed file), the figures a model's status shows
    (:meth:`PullInfo.progressed`) and what ``wagent pull`` draws. The callback runs on the
    pull's threads, one call at a time; it must be quick (a stream waits), and an exception
    from it is logged and ends the progress reports, not the pull."""

    model: str
    version: str
    event: str                 # "start", "progress", "file" (one file landed), "done"
    bytes_total: int           # the version's distinct bytes
    bytes_done: int            # already present, resumed, copied or fetched and verified so far
    bytes_fetched: int         # received from the network in this pull
    bytes_reused: int          # copied from local blobs in this pull
    rate: float                # bytes/s received, over the last few seconds
    streams: int               # streams with a request in flight
    files_done: int
    files_total: int
    elapsed: float
    file: str | None = None    # for "file": its path
    bytes_in_flight: int = 0   # received, in pieces not verified yet (not in bytes_done)
    streams_chosen: int = 0    # the streams the pull runs now (agent.pull.stream_count)
    streams_why: str = ""      # ...and why that many
    # bytes received by kind of source: "peer", "cache", "origin" (agent.peers)
    bytes_by_source: Mapping[str, int] = field(default_factory=dict)

    @property
    def eta(self) -> float | None:
        left = self.bytes_total - self.bytes_done
        return left / self.rate if self.rate > 0 else (0.0 if left == 0 else None)


@dataclass(frozen=True)
class PullInfo:
    model: str
    version: str | None = None          # None: "latest" not resolved yet
    state: str = "idle"                 # one of PULL_STATES
    bytes_done: int = 0
    bytes_total: int | None = None
    rate_bps: float = 0.0               # recent goodput, bits/s (0 unless pulling)
    streams: int = 0                    # connections in use now (0 unless pulling)
    streams_chosen: int = 0             # streams the pull runs now (0 unless pulling)
    streams_why: str = ""               # why that many
    bytes_by_source: Mapping[str, int] = field(default_factory=dict)   # as PullProgress's
    slot_at: float | None = None        # this node's wave slot for this version
    starts_at: float | None = None      # when it may start: slot, or later if learned late or
                                        # outside the role's windows; None: no window opens
    started_at: float | None = None
    finished_at: float | None = None
    local_version: str | None = None    # newest version complete in the store
    error: str | None = None
    stalled: str | None = None          # the worker made no progress for longer than it may
    on_ready: str | None = None         # the last on_ready hook's outcome ("exit 0 after 0.4 s")

    def progressed(self, p: PullProgress) -> PullInfo:
        """The model's status once its pull reported ``p``: the one place a pull's figures
        become status (rates here are bits/s, as ``tc`` and the policy speak)."""
        return replace(self, bytes_done=p.bytes_done, bytes_total=p.bytes_total,
                       rate_bps=p.rate * 8, streams=p.streams,
                       streams_chosen=p.streams_chosen, streams_why=p.streams_why,
                       bytes_by_source=dict(p.bytes_by_source))


@dataclass(frozen=True)
class WindowInfo:
    open: bool = True
    next_open: float | None = None      # None: open now, or no windows at all
    closes_at: float | None = None


@dataclass(frozen=True)
class StoreInfo:
    path: str = ""
    used_bytes: int = 0
    versions: int = 0
    free_bytes: int | None = None


@dataclass(frozen=True)
class DaemonState:
    pid: int
    started_at: float
    version: str
    paused: bool = False
    workers: Mapping[str, bool] = field(default_factory=dict)   # thread name -> alive
    jobs: Mapping[str, float | None] = field(default_factory=dict)  # scheduler job -> next run
    node: NodeInfo = field(default_factory=NodeInfo)
    policy: PolicyInfo = field(default_factory=PolicyInfo)
    shaping: ShapingInfo = field(default_factory=ShapingInfo)
    backoff: BackoffInfo = field(default_factory=BackoffInfo)
    pulls: tuple[PullInfo, ...] = ()
    window: WindowInfo = field(default_factory=WindowInfo)
    store: StoreInfo = field(default_factory=StoreInfo)
    errors: tuple[str, ...] = ()        # other recent errors, newest last
    error_counts: Mapping[str, int] = field(default_factory=dict)  # kind -> count since start
    # lazy mounts (agent.mount.service.Mounts.status: the document's "mounts" as it is)
    mounts: Mapping[str, Any] = field(default_factory=lambda: dict(NO_MOUNTS))
    # serving peers (agent.peers.service.PeerService.status: the document's "peers" as it is)
    peers: Mapping[str, Any] = field(default_factory=lambda: dict(NO_PEERS))


NO_PEERS: Mapping[str, Any] = {"enabled": False, "serving": False, "port": None, "peers": 0,
                               "in_swarm": False, "served_bytes": 0, "served_requests": 0,
                               "served_waited": 0, "refused": 0, "busy": 0, "error": None}
NO_MOUNTS: Mapping[str, Any] = {"serving": False, "mounts": [], "reads": 0, "read_errors": 0,
                                "bytes_read": 0, "waiting": 0, "wanted": 0, "errors": []}


@dataclass(frozen=True)
class TickSummary:
    """What the daemon's tick reads every second: whether the worker threads live (the
    watchdog) and what :func:`one_line` tells systemd. Only what the parts hold in memory: the
    whole :class:`DaemonState` costs netlink dumps and a store scan, paid when someone asks
    (``wagent status``, the metrics job), not every second."""

    workers: Mapping[str, bool] = field(default_factory=dict)   # thread name -> alive
    paused: bool = False
    pulls: tuple[PullInfo, ...] = ()
    backoff_state: str = "off"          # as BackoffInfo.state
    backoff_reason: str = ""
    reload_refused: bool = False        # the last reload was refused (PolicyInfo.last_error)


def problems(state: DaemonState) -> list[str]:
    """What makes the daemon degraded, in words for the person reading ``wagent status``."""
    out = [f"worker thread {name!r} is not running"
           for name, alive in sorted(state.workers.items()) if not alive]
    if state.policy.last_error:
        out.append("the last reload was refused; the previous policy is still in force")
    if state.shaping.error:
        out.append(f"shaping: {state.shaping.error}")
    out += [f"pull {p.model}: {p.error}" for p in state.pulls if p.state == "failed" and p.error]
    out += [f"pull {p.model}: {p.stalled}" for p in state.pulls if p.stalled]
    if state.peers.get("error"):
        out.append(str(state.peers["error"]))
    out += list(state.errors)
    return out


def eta(p: PullInfo) -> float | None:
    if p.state != "pulling" or not p.bytes_total or p.rate_bps <= 0:
        return None
    return max(0, p.bytes_total - p.bytes_done) * 8 / p.rate_bps


def to_json(state: DaemonState, now: float) -> dict[str, Any]:
    """The versioned status document; every field is described in docs/status.md."""
    issues = problems(state)
    s = state
    return {
        "schema": SCHEMA,
        "running": True,            # as `wagent status --json` says false when none answers
        "generated_at": now,
        "health": "degraded" if issues else "healthy",
        "problems": issues,
        "daemon": {
            "pid": s.pid, "version": s.version, "started_at": s.started_at,
            "uptime_s": max(0.0, now - s.started_at), "paused": s.paused,
            "workers": dict(sorted(s.workers.items())),
            "jobs": [{"id": k, "next_run_at": v} for k, v in sorted(s.jobs.items())],
            "error_counts": dict(sorted(s.error_counts.items())),
        },
        "node": {
            "id": s.node.id, "hostname": s.node.hostname, "role": s.node.role,
            "wave": s.node.wave_index, "wave_delay_s": s.node.wave_delay,
        },
        "policy": {
            "path": s.policy.path, "sha256": s.policy.sha256, "loaded_at": s.policy.loaded_at,
            "last_error": s.policy.last_error, "last_error_at": s.policy.last_error_at,
            "reloads": s.policy.reloads,
        },
        "shaping": {
            "enabled": s.shaping.enabled, "cap_bps": s.shaping.policy_ceil_bps,
            "current_ceil_bps": s.shaping.current_ceil_bps, "error": s.shaping.error,
            "notes": list(s.shaping.notes),
            "interfaces": [
                {"name": i.name, "direction": i.direction, "device": i.device,
                 "classes": [
                     {"name": c.name, "classid": c.classid, "bytes": c.bytes,
                      "packets": c.packets, "drops": c.drops, "overlimits": c.overlimits,
                      "rate_bps": c.rate_bps, "ceil_bps": c.ceil_bps, "backlog": c.backlog,
                      "est_bps": c.est_bps}
                     for c in i.classes]}
                for i in s.shaping.interfaces],
        },
        "backoff": {
            "enabled": s.backoff.enabled, "state": s.backoff.state, "reason": s.backoff.reason,
            "since": s.backoff.since, "rate_bps": s.backoff.rate_bps,
            "floor_bps": s.backoff.floor_bps, "cap_bps": s.backoff.cap_bps,
            "events": [{"at": e.at, "state": e.state, "reason": e.reason, "rate_bps": e.rate_bps}
                       for e in s.backoff.events],
            "events_total": s.backoff.events_total,
            "events_by_signal": dict(sorted(s.backoff.events_by_signal.items())),
            "readings": dict(sorted(s.backoff.readings.items())),
            "yielded_s": s.backoff.yielded_s, "bursts": s.backoff.bursts,
            "idle_bytes": s.backoff.idle_bytes, "pulled_bytes": s.backoff.pulled_bytes,
            "idle_used": s.backoff.idle_used,
            "fast_path": s.backoff.fast_path, "cut_s": s.backoff.cut_s,
            "anticipated": s.backoff.anticipated,
        },
        "pulls": [
            {"model": p.model, "version": p.version, "state": p.state,
             "bytes_done": p.bytes_done, "bytes_total": p.bytes_total,
             "percent": _percent(p), "rate_bps": p.rate_bps, "eta_s": eta(p),
             "streams": p.streams, "streams_chosen": p.streams_chosen,
             "streams_why": p.streams_why, "bytes_by_source": dict(p.bytes_by_source),
             "slot_at": p.slot_at, "starts_at": p.starts_at,
             "started_at": p.started_at,
             "finished_at": p.finished_at, "local_version": p.local_version, "error": p.error,
             "stalled": p.stalled, "on_ready": p.on_ready}
            for p in s.pulls],
        "window": {"open": s.window.open, "next_open": s.window.next_open,
                   "closes_at": s.window.closes_at},
        "store": {"path": s.store.path, "used_bytes": s.store.used_bytes,
                  "versions": s.store.versions, "free_bytes": s.store.free_bytes},
        "mounts": dict(s.mounts),
        "peers": dict(s.peers),
    }


def exit_code(doc: Mapping[str, Any]) -> int:
    return EXIT_HEALTHY if doc.get("health") == "healthy" else EXIT_DEGRADED


def _percent(p: PullInfo) -> float | None:
    if not p.bytes_total:
        return None
    return round(100.0 * min(p.bytes_done, p.bytes_total) / p.bytes_total, 1)


def one_line(s: TickSummary) -> str:
    """The systemd STATUS= line, e.g. ``pulling llama3-70b v3 41% at 480 Mbit/s; backed off:
    NCCL traffic``."""
    parts: list[str] = []
    if s.paused:
        parts.append("paused")
    active = [p for p in s.pulls if p.state == "pulling"]
    for p in active:
        percent = _percent(p)
        pct = f" {percent:.0f}%" if percent is not None else ""
        parts.append(f"pulling {p.model} {p.version}{pct} at {format_rate(p.rate_bps)}")
    if not active:
        waiting = [p for p in s.pulls if p.state in ("waiting_slot", "waiting_window")]
        if waiting:
            p = waiting[0]
            what = "slot" if p.state == "waiting_slot" else "window"
            parts.append(f"waiting for {what}: {p.model} {p.version}")
        else:
            parts.append("idle")
    if s.backoff_state == "backed_off":
        parts.append(f"backed off: {s.backoff_reason}" if s.backoff_reason else "backed off")
    elif s.backoff_state == "ramping":
        parts.append("ramping up")
    if s.reload_refused:
        parts.append("reload refused (see wagent status)")
    return "; ".join(parts)


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    delta = ts - now
    return f"in {format_duration(delta)}" if delta >= 0 else f"{format_duration(-delta)} ago"


def _rate(bps: float | None) -> str:
    return "uncapped" if bps is None else format_rate(bps)


def to_text(doc: Mapping[str, Any]) -> str:
    """The human summary of ``wagent status``, rendered from the JSON document."""
    now = doc["generated_at"]
    d, n, pol, sh, b = doc["daemon"], doc["node"], doc["policy"], doc["shaping"], doc["backoff"]
    wave = "-" if n["wave"] is None else f"{n['wave']} (+{format_duration(n['wave_delay_s'])})"
    lines = [
        f"wagent {d['version']} (pid {d['pid']}): {doc['health']}"
        + (", PAUSED" if d["paused"] else "") + f", up {format_duration(d['uptime_s'])}",
        f"node:     {n['id']} ({n['hostname']}), role {n['role']}, wave {wave}",
        f"policy:   {pol['path']} sha256 {pol['sha256'][:12]}, "
        f"loaded {_when(pol['loaded_at'], now)}",
    ]
    if pol["last_error"]:
        lines.append(f"  reload refused {_when(pol['last_error_at'], now)}; still running the "
                     "previous policy:")
        lines += [f"    {line}" for line in pol["last_error"].splitlines()]
    if sh["enabled"]:
        lines.append(f"shaping:  ceil {_rate(sh['cap_bps'])}, now {_rate(sh['current_ceil_bps'])}")
        for i in sh["interfaces"]:
            lines.append(f"  {i['name']} {i['direction']} on {i['device']}:")
            for c in i["classes"]:
                lines.append(f"    {c['name']:<13} {format_size(c['bytes']):>10} "
                             f"{c['packets']} pkts, {c['drops']} drops, "
                             f"{c['overlimits']} overlimits")
        lines += [f"  note: {note}" for note in sh["notes"]]
        if sh["error"]:
            lines.append(f"  error: {sh['error']}")
    else:
        lines.append("shaping:  off")
    if b["enabled"]:
        reason = f" ({b['reason']})" if b["reason"] else ""
        lines.append(f"backoff:  {b['state']}{reason} since {_when(b['since'], now)}, "
                     f"rate {_rate(b['rate_bps'])}, {len(b['events'])} recent events")
        used = f", {100 * b['idle_used']:.0f}% of the idle capacity used while training" \
            if b["idle_used"] is not None else ""
        lines.append(f"  fast path {b['fast_path']}; {b['bursts']} bursts ({b['anticipated']} "
                     f"anticipated), held {format_duration(b['cut_s'])}{used}")
    else:
        lines.append("backoff:  off")
    lines.append("pulls:" if doc["pulls"] else "pulls:    none configured")
    for p in doc["pulls"]:
        line = f"  {p['model']} {p['version'] or '(latest unresolved)'}: {p['state']}"
        if p["state"] == "pulling":
            total = format_size(p["bytes_total"]) if p["bytes_total"] else "?"
            pct = f" ({p['percent']:.0f}%)" if p["percent"] is not None else ""
            eta_txt = format_duration(p["eta_s"]) if p["eta_s"] is not None else "?"
            line += (f" {format_size(p['bytes_done'])} of {total}{pct} at "
                     f"{format_rate(p['rate_bps'])}, {p['streams']} streams, ETA {eta_txt}")
            if p.get("streams_why"):
                line += f"\n    streams: {p['streams_chosen']}: {p['streams_why']}"
            if p.get("bytes_by_source"):
                line += "\n    from: " + ", ".join(
                    f"{k} {format_size(v)}" for k, v in sorted(p["bytes_by_source"].items()))
        elif p["state"] in ("waiting_slot", "waiting_window"):
            line += f", slot {_when(p['slot_at'], now)}, starts {_when(p['starts_at'], now)}"
        if p["local_version"]:
            line += f"; in store: {p['local_version']}"
        if p["error"]:
            line += f"; error: {p['error']}"
        if p.get("stalled"):                # absent from an older daemon's document
            line += f"; STALLED: {p['stalled']}"
        if p.get("on_ready"):
            line += f"; on_ready: {p['on_ready']}"
        lines.append(line)
    w = doc["window"]
    if w["open"]:
        closes = f", closes {_when(w['closes_at'], now)}" if w["closes_at"] else ""
        lines.append(f"window:   open{closes}")
    else:
        lines.append(f"window:   closed, next opens {_when(w['next_open'], now)}")
    st = doc["store"]
    free = f", {format_size(st['free_bytes'])} free" if st["free_bytes"] is not None else ""
    lines.append(f"store:    {st['path']}: {format_size(st['used_bytes'])} in "
                 f"{st['versions']} versions{free}")
    mounts = doc.get("mounts") or NO_MOUNTS
    for m in mounts["mounts"]:
        share = m["bytes_verified"] / m["bytes_total"] if m["bytes_total"] else 1.0
        done = "complete" if m["complete"] else f"{100 * share:.0f}% verified"
        if m.get("from") == "store":
            how = " (bound from the store)"
        else:
            how = "" if mounts["serving"] else " (no FUSE server: readers wait)"
        lines.append(f"mount:    {m['model']}@{m['version']} at {', '.join(m['dirs'])}: {done}"
                     + how)
    if mounts["waiting"]:
        lines.append(f"mounts:   {mounts['waiting']} reads waiting for their pieces")
    for e in mounts["errors"][-1:]:
        lines.append(f"mounts:   last read error: {e['error']}")
    peers = doc.get("peers") or NO_PEERS
    if peers["enabled"]:
        where = (f"serving on port {peers['port']}" if peers["serving"]
                 else f"not serving: {peers['error']}")
        swarm = (f"{peers['peers']} in the swarm" if peers["in_swarm"]
                 else "not in the swarm (fetches from no peer)")
        lines.append(f"peers:    {where}, {swarm}; sent {format_size(peers['served_bytes'])} "
                     f"in {peers['served_requests']} requests")
    if doc["problems"]:
        lines.append("problems:")
        lines += [f"  - {p}" for p in doc["problems"]]
    return "\n".join(lines)


def not_running_text(socket_path: str, reason: str) -> str:
    return (f"wagent is not running (no daemon answers on {socket_path}: {reason}).\n"
            "Start it with `systemctl start wagent`.")
