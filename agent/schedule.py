"""When may this node pull which version: the staggered waves and the role windows. Pure.

Times are POSIX seconds (``float``); windows read their cron fields on the policy's ``timezone``
(UTC by default), daylight-saving changes included. A node's slot for a version is::

    slot = published + cache_lead + wave_index * gap + offset,  offset = frac * spread

where ``frac`` in [0, 1) comes from sha256(node_id|role|model|version): the same after a restart,
different for another version, uniform over the fleet, and no coordinator involved. The cache
role has no wave: its nodes start at ``published + frac * cache_spread`` (at most a minute, and
within ``cache_lead`` when that is set), so with ``waves.cache_lead`` the caches are full before
wave 0 begins. A role that no wave names goes after the last wave.

A node learns of a new version when it polls ``{source}/{model}/latest``, which it does at the
wall-clock times ``phase + k * poll_interval`` (``next_poll``), its ``phase`` hashed from its id
and the model (``poll_phase``): known to anyone who knows the id, the plan included. A node that
learns of a version after its slot starts at once. Role windows then decide when pulls may run:
a start (or a pull that paused) outside the windows waits for the next opening, plus the node's
own ``frac`` of the spread (capped at the window's length) so that a thousand nodes don't all
start on the same second when the night window opens.

>>> from agent.policy.model import Policy
>>> slot(0.0, "node-a", "training", "llama", "v2", Policy()) // 60      # wave 2: 2 * 30 min + ...
65.0
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Iterable
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo

from agent.cron import CronSpec, parse_cron
from agent.policy.model import Policy, Window

CACHE_SPREAD = 60.0            # cache nodes start within a minute of publication
POLL_SLACK = 1e-6              # s: a time this close to a poll time is that poll time


def offset_fraction(node_id: str, role: str, model: str, version: str) -> float:
    """A number in [0, 1) fixed by the node, its role and the version; uniform over nodes."""
    digest = hashlib.sha256(f"{node_id}|{role}|{model}|{version}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def poll_fraction(node_id: str, model: str) -> float:
    """A number in [0, 1) fixed by the node and the model (not the version: it is needed before
    a version is known); uniform over nodes, independent of ``offset_fraction``."""
    digest = hashlib.sha256(f"poll|{node_id}|{model}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def poll_phase(node_id: str, model: str, interval: float) -> float:
    """Where in every ``interval`` (counted from the epoch) this node polls the model's
    ``latest``. A fixed phase, rather than one set by when the daemon started: anyone who knows
    the node's id (``wagent plan``, an operator) knows when it polls, and a fleet restarted at
    once (a package upgrade) spreads its polls over the interval after the first one instead
    of hitting the origin together at every interval."""
    return max(interval, 0.0) * poll_fraction(node_id, model)


def first_poll(after: float, phase: float, interval: float) -> float:
    """The first of the times ``phase + k * interval`` at or after ``after``: ``after`` itself
    when it is one (within ``POLL_SLACK``: wall-clock seconds are floats), or when ``interval``
    is 0 (every moment is a poll time)."""
    if interval <= 0:
        return after
    k = math.ceil((after - phase - POLL_SLACK) / interval)
    return max(after, phase + k * interval)


def next_poll(after: float, node_id: str, model: str, interval: float) -> float:
    """This node's first poll of the model's ``latest`` at or after ``after``."""
    return first_poll(after, poll_phase(node_id, model, interval), interval)


def poll_after(polled: float, node_id: str, model: str, interval: float) -> float:
    """This node's next poll of the model's ``latest`` once it polled at ``polled``: the first
    poll time strictly after it (``polled`` itself if ``interval`` is 0)."""
    at = next_poll(polled, node_id, model, interval)
    return at + interval if at <= polled else at


def wave_order(policy: Policy) -> tuple[str, ...]:
    """The waves that can hold a node: the roles of ``waves.order`` the policy defines, and the
    default role (a node no pattern matches). A minimal policy, with no roles, doesn't wait for
    the inference and evaluation waves of the default order: it has no such nodes."""
    return tuple(r for r in policy.waves.order
                 if policy.role(r) is not None or r == policy.default_role)


def wave_index(policy: Policy, role: str) -> int | None:
    """The role's wave (0 first); None for the cache role; after the last wave if unlisted."""
    if policy.cache_role is not None and role == policy.cache_role:
        return None
    order = wave_order(policy)
    return order.index(role) if role in order else len(order)


def cache_spread(policy: Policy) -> float:
    """The window over which cache nodes start: small, and inside ``cache_lead`` if set."""
    spread = min(policy.waves.spread, CACHE_SPREAD)
    if policy.waves.cache_lead > 0:
        spread = min(spread, policy.waves.cache_lead / 2)
    return spread


def slot_from_fraction(published_at: float, frac: float, role: str, policy: Policy) -> float:
    """The slot for a node whose ``offset_fraction`` is ``frac`` (the plan simulates with it)."""
    index = wave_index(policy, role)
    if index is None:
        return published_at + frac * cache_spread(policy)
    w = policy.waves
    return published_at + w.cache_lead + index * w.gap + frac * w.spread


def slot(published_at: float, node_id: str, role: str, model: str, version: str,
         policy: Policy) -> float:
    """When this node's turn for ``model``/``version`` comes, before windows are applied."""
    frac = offset_fraction(node_id, role, model, version)
    return slot_from_fraction(published_at, frac, role, policy)


def windows_for(policy: Policy, role: str) -> tuple[Window, ...]:
    r = policy.role(role)
    return r.windows if r is not None else ()


def is_open(windows: Iterable[Window], now: float) -> bool:
    """Whether pulls may run at ``now``: no windows, or inside one of them."""
    windows = tuple(windows)
    if not windows:
        return True
    for w in windows:
        m = _spec(w.cron).next_match(_dt(now - w.duration), inclusive=True, tz=_zone(w.tz))
        if m is not None and m.timestamp() <= now < m.timestamp() + w.duration:
            return True
    return False


def next_opening(windows: Iterable[Window], now: float) -> float | None:
    """``now`` if open, else when the next window opens; None if none ever will."""
    windows = tuple(windows)
    if is_open(windows, now):
        return now
    nexts = [m.timestamp() for w in windows
             if (m := _spec(w.cron).next_match(_dt(now), tz=_zone(w.tz))) is not None]
    return min(nexts, default=None)


def open_until(windows: Iterable[Window], now: float, horizon: float = 400 * 86400.0) -> float:
    """When the window open at ``now`` closes (overlapping windows joined); ``now`` if closed.

    With no windows, or windows that chain beyond ``horizon``, ``now + horizon``.
    """
    windows = tuple(windows)
    if not windows:
        return now + horizon
    longest = max(w.duration for w in windows)
    end, step = now, max(longest * 2, 86400.0)
    while end < now + horizon:
        spans = Spans.build(windows, end, end + step)
        span = spans.span_at(end)
        if span is None:
            return end
        if span[1] < end + step:
            return span[1]
        end = span[1] if span[1] > end else end + step
    return now + horizon


def pull_allowed_at(windows: Iterable[Window], now: float, frac: float = 0.0,
                    spread: float = 0.0) -> float | None:
    """When a pull that wants to run at ``now`` may run.

    ``now`` inside a window; else the next opening plus ``frac * min(spread, window length)``,
    spreading a fleet that all waited for the same opening. None if no window ever opens.
    """
    windows = tuple(windows)
    opening = next_opening(windows, now)
    if opening is None or opening == now:
        return opening
    length = open_until(windows, opening) - opening
    return opening + frac * min(spread, length)


def start_at(published_at: float, learned_at: float, node_id: str, role: str, model: str,
             version: str, policy: Policy) -> float | None:
    """When this node starts pulling the version: its slot, at once if learned after it, then
    moved into the role's windows. None if the role's windows never open."""
    frac = offset_fraction(node_id, role, model, version)
    due = max(slot_from_fraction(published_at, frac, role, policy), learned_at)
    return pull_allowed_at(windows_for(policy, role), due, frac, policy.waves.spread)


class Spans:
    """The open spans of a set of windows within a time range, merged: fast repeated lookups
    (``wagent plan`` asks for 100k nodes), exact only inside the range it was built for."""

    def __init__(self, spans: list[tuple[float, float]], start: float, end: float) -> None:
        self.spans = spans
        self.starts = [s for s, _ in spans]
        self.start, self.end = start, end

    @classmethod
    def build(cls, windows: Iterable[Window], start: float, end: float) -> Spans:
        raw: list[tuple[float, float]] = []
        for w in windows:
            spec, zone = _spec(w.cron), _zone(w.tz)
            m = spec.next_match(_dt(start - w.duration), inclusive=True, tz=zone)
            while m is not None and m.timestamp() < end:
                t = m.timestamp()
                if t + w.duration > start:
                    raw.append((t, t + w.duration))
                m = spec.next_match(m, tz=zone)
        raw.sort()
        merged: list[tuple[float, float]] = []
        for s, e in raw:
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        return cls(merged, start, end)

    def span_at(self, t: float) -> tuple[float, float] | None:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.spans[i][0] <= t < self.spans[i][1]:
            return self.spans[i]
        return None

    def next_open(self, t: float) -> tuple[float, float] | None:
        """The span containing ``t``, else the next one; None if none in range."""
        span = self.span_at(t)
        if span is not None:
            return span
        i = bisect.bisect_right(self.starts, t)
        return self.spans[i] if i < len(self.spans) else None


@functools.lru_cache(maxsize=256)
def _spec(text: str) -> CronSpec:
    return parse_cron(text)


@functools.lru_cache(maxsize=64)
def _zone(name: str) -> tzinfo:
    """The policy's time zone (validated when it loaded)."""
    return UTC if name == "UTC" else ZoneInfo(name)


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)
