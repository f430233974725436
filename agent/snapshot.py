"""The status snapshot: what the running parts (pull worker, shaper, backoff loop, store) say,
turned into the values of ``agent.status``. Called from any thread (the control socket's
and the main loop's); it only reads, taking the parts' lock around the shared netlink socket.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agent import schedule
from agent.status import (
    BackoffEvent,
    BackoffInfo,
    ClassCounters,
    DaemonState,
    NodeInfo,
    ShapedInterface,
    ShapingInfo,
    StoreInfo,
    WindowInfo,
)
from agent.store import Store
from agent.store.layout import NOT_VERSIONS

if TYPE_CHECKING:
    from agent.application import Parts

MAX_EVENTS = 20        # backoff state changes shown in status


def snapshot(parts: Parts | None, base: DaemonState, clock: Callable[[], float]) -> DaemonState:
    """The daemon's state with the running parts' views filled in (any thread)."""
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
        base, paused=parts.worker.paused, node=node,
        errors=base.errors + tuple(e for e in (parts.metrics_error, parts.worker.step_error)
                                   if e),
        shaping=shaping_info(parts), backoff=backoff_info(parts, clock),
        pulls=parts.worker.snapshot(),
        window=WindowInfo(open=w.open, next_open=w.next_open, closes_at=w.closes_at),
        store=store_info(parts.store))


def shaping_info(parts: Parts) -> ShapingInfo:
    sh = parts.policy.shaping
    if parts.shaper is None:
        return ShapingInfo(enabled=False)
    try:
        with parts.lock:   # one netlink socket; the backoff thread uses it too
            interfaces = shaped_interfaces(parts.shaper.stats(), parts.shaper.plan(),
                                           parts.ceil_bps)
        error = None
    except Exception as e:
        interfaces, error = (), f"reading the tc counters failed: {e}"
    error = parts.shaping_error or error
    return ShapingInfo(enabled=True, cap_bps=sh.ceil, current_ceil_bps=parts.ceil_bps,
                       interfaces=interfaces, error=error, notes=parts.shaping_notes)


def backoff_info(parts: Parts, clock: Callable[[], float]) -> BackoffInfo:
    loop = parts.backoff
    if loop is None:
        return BackoffInfo(enabled=False)
    st = loop.status()
    # The loop's clock is monotonic; status speaks wall-clock time.
    offset = clock() - time.monotonic()
    events: list[BackoffEvent] = []
    prev = None
    for a in list(loop.history):
        if a.state != prev:
            events.append(BackoffEvent(a.at + offset, a.state, a.reason, a.rate_bps))
        prev = a.state
    readings = {k: float(st[k]) for k in ("other_bps", "rdma_bps", "training_connections",
                                          "nccl_processes", "pull_streams", "pull_min_rtt_us",
                                          "pull_rtt_us", "pull_window_bytes")
                if st.get(k) is not None}
    return BackoffInfo(
        enabled=True, state=st["state"], reason=st["reason"],
        since=None if st["since"] is None else st["since"] + offset,
        rate_bps=st["rate_bps"], floor_bps=st["floor_bps"], cap_bps=st["cap_bps"],
        events=tuple(events[1:][-MAX_EVENTS:]), events_total=st["events"],
        readings=readings, events_by_signal=st.get("events_by_signal", {}))


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


def shaped_interfaces(stats: Any, plan: Any, ceil_bps: int | None
                      ) -> tuple[ShapedInterface, ...]:
    """Status values from ``Shaper.stats()`` (flat ClassStats per tc device), grouped by the
    plan's trees: egress on the interface, ingress on its IFB."""
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
                if c.name == "distribution" and ceil_bps is not None:
                    ceil = ceil_bps
                classes.append(ClassCounters(
                    name=c.name, classid=c.classid, bytes=c.bytes, packets=c.packets,
                    drops=c.drops, overlimits=c.overlimits,
                    rate_bps=conf.rate if conf is not None else None, ceil_bps=ceil,
                    backlog=c.backlog, est_bps=c.rate))
            out.append(ShapedInterface(ip.interface, direction, tree.device, tuple(classes)))
    return tuple(out)
