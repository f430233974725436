"""The status snapshot: what the running parts (pull worker, shaper, backoff loop, store) say,
turned into the values of ``agent.status``: the whole :class:`DaemonState` (:func:`snapshot`)
or the tick's cheap :class:`TickSummary` (:func:`tick_summary`). Called from any thread (the control
socket's and the main loop's); it only reads, taking the parts' lock around the shared netlink
socket.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agent import schedule
from agent.parts import Parts
from agent.status import (
    BackoffEvent,
    BackoffInfo,
    ClassCounters,
    DaemonState,
    NodeInfo,
    ShapedInterface,
    ShapingInfo,
    StoreInfo,
    TickSummary,
    WindowInfo,
)
from agent.store import Store
from agent.store.layout import NOT_VERSIONS
from agent.yielding.backoff import BackoffStatus

MAX_EVENTS = 20        # backoff state changes shown in status


def snapshot(parts: Parts | None, base: DaemonState, clock: Callable[[], float],
             monotonic: Callable[[], float]) -> DaemonState:
    """The daemon's state with the running parts' views filled in (any thread). ``clock`` is
    the wall clock status speaks, ``monotonic`` the backoff loop's."""
    if parts is None:
        return base
    p, ident = parts.policy, parts.identity
    index = schedule.wave_index(p, ident.role)
    node = NodeInfo(id=ident.node_id, hostname=ident.hostname, role=ident.role,
                    wave_index=index,
                    wave_delay=0.0 if index is None
                    else p.waves.cache_lead + index * p.waves.gap)
    w = parts.worker.window()
    return replace(
        base, paused=parts.worker.paused, node=node, jobs=parts.scheduler.jobs(),
        errors=base.errors + ((parts.metrics_error,) if parts.metrics_error else ())
        + parts.worker.errors(),
        shaping=shaping_info(parts), backoff=backoff_info(parts, clock() - monotonic()),
        pulls=parts.worker.snapshot(),
        window=WindowInfo(open=w.open, next_open=w.next_open, closes_at=w.closes_at),
        store=store_info(parts.store), mounts=parts.mounts.status(), peers=parts.peers.status())


def tick_summary(parts: Parts | None, base: TickSummary) -> TickSummary:
    """The daemon's summary with the running parts' views filled in: the worker's pulls and
    the backoff loop's state, both held in memory. No netlink dump and no store scan (those
    are :func:`snapshot`'s): the daemon's tick reads this every second."""
    if parts is None:
        return base
    loop = parts.shaping.loop
    backoff = loop.status() if loop is not None else None
    return replace(base, paused=parts.worker.paused, pulls=parts.worker.snapshot(),
                   backoff_state=backoff.state if backoff is not None else "off",
                   backoff_reason=backoff.reason if backoff is not None else "")


def shaping_info(parts: Parts) -> ShapingInfo:
    rt = parts.shaping
    if rt.shaper is None:
        return ShapingInfo(enabled=False)
    try:
        interfaces = shaped_interfaces(*rt.stats())
        error = None
    except Exception as e:
        interfaces, error = (), f"reading the tc counters failed: {e}"
    return ShapingInfo(enabled=True, policy_ceil_bps=parts.policy.shaping.ceil,
                       current_ceil_bps=rt.ceil, interfaces=interfaces,
                       error=rt.error or error, notes=rt.notes)


def backoff_info(parts: Parts, offset: float) -> BackoffInfo:
    """``offset``: wall-clock time minus the loop's monotonic time (status speaks wall-clock)."""
    loop = parts.shaping.loop
    if loop is None:
        return BackoffInfo(enabled=False)
    st = loop.status()
    events: list[BackoffEvent] = []
    prev = None
    for a in st.history:
        if a.state != prev:
            events.append(BackoffEvent(a.at + offset, a.state, a.reason, a.rate_bps))
        prev = a.state
    return BackoffInfo(
        enabled=True, state=st.state, reason=st.reason,
        since=None if st.since is None else st.since + offset,
        rate_bps=st.rate_bps, floor_bps=st.floor_bps, cap_bps=st.cap_bps,
        events=tuple(events[1:][-MAX_EVENTS:]), events_total=st.events,
        readings=readings(st), events_by_signal=st.events_by_signal,
        yielded_s=st.account.yielded_s, idle_bytes=int(st.account.idle_bits / 8),
        pulled_bytes=int(st.account.pulled_bits / 8),
        bursts=st.account.bursts if st.bursts is None else st.bursts.bursts,
        fast_path=st.fast_path, anticipated=st.anticipated,
        cut_s=0.0 if st.bursts is None else st.bursts.held_s(st.bursts_at_ns))


def readings(st: BackoffStatus) -> dict[str, float]:
    """The loop's readings under their names in the document (``backoff.readings``); one not
    taken yet (no pull socket sampled) is left out."""
    values = {"other_bps": st.other_bps, "rdma_bps": st.rdma_bps,
              "training_connections": st.training_connections,
              "nccl_processes": st.nccl_processes, "pull_streams": st.pull_streams,
              "pull_min_rtt_us": st.pull_min_rtt_us, "pull_rtt_us": st.pull_rtt_us,
              "pull_window_bytes": st.pull_window_bytes}
    return {k: float(v) for k, v in values.items() if v is not None}


def store_info(store: Store) -> StoreInfo:
    versions = 0
    for model in store.model_names():
        with contextlib.suppress(OSError):
            versions += sum(1 for n in os.listdir(store.model_dir(model))
                            if not n.startswith(".") and n not in NOT_VERSIONS)
    try:
        vfs = os.statvfs(store.root)
        free: int | None = vfs.f_bavail * vfs.f_frsize
    except OSError:
        free = None
    return StoreInfo(path=str(store.root), used_bytes=store.usage(), versions=versions,
                     free_bytes=free)


def shaped_interfaces(stats: Any, plan: Any) -> tuple[ShapedInterface, ...]:
    """Status values from ``Shaper.stats()`` (flat ClassStats per tc device), grouped by the
    plan's trees (with the live ceil): egress on the interface, ingress on its IFB."""
    by_device: dict[str, list[Any]] = {}
    for c in stats:
        by_device.setdefault(c.device, []).append(c)
    out = []
    for ip in plan.interfaces:
        for direction, tree in (("ingress", ip.ingress), ("egress", ip.egress)):
            if tree is None:
                continue
            configured = {c.name: c for c in tree.classes}
            classes = []
            for c in sorted(by_device.get(tree.device, ()), key=lambda c: c.classid):
                conf = configured.get(c.name)
                ceil = conf.ceil if conf is not None else None
                classes.append(ClassCounters(
                    name=c.name, classid=c.classid, bytes=c.bytes, packets=c.packets,
                    drops=c.drops, overlimits=c.overlimits,
                    rate_bps=conf.rate if conf is not None else None, ceil_bps=ceil,
                    backlog=c.backlog, est_bps=c.rate))
            out.append(ShapedInterface(ip.interface, direction, tree.device, tuple(classes)))
    return tuple(out)
