"""The policy's schedule alone, over N synthetic nodes: when each wave starts and ends.

N nodes (``node-000000``...) are shared among the roles, each gets its slot from
``agent.schedule`` exactly as the daemon computes it, is moved into its role's windows, and pulls
for a fixed time. A pull that reaches the end of its window pauses and resumes at the next
opening (plus its share of the spread, as the daemon does). Per wave: when its nodes start, when
the last one finishes and the most that pull at once; and the most pulls at once over the whole
fleet. Links are not simulated (``agent.fleet.simulate`` does that); neither is backoff.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from agent.policy.model import Policy
from agent.schedule import Spans, offset_fraction, slot_from_fraction, wave_index, windows_for

CONVENTIONAL_SHARES = {"inference": 0.3, "evaluation": 0.1, "training": 0.6}


@dataclass(frozen=True)
class WaveStats:
    role: str
    wave: int | None              # None: the cache role
    nodes: int
    first_start: float | None     # POSIX seconds; None if the role's windows never open
    last_start: float | None
    last_end: float | None
    peak: int                     # most of this wave's nodes pulling at once
    never: int                    # nodes whose windows never open


@dataclass(frozen=True)
class WavePlan:
    published: float
    pull_time: float
    waves: tuple[WaveStats, ...]
    peak: int                     # the origin's most concurrent pulls, all waves together
    peak_at: float | None


def simulate_waves(policy: Policy, counts: dict[str, int], published: float, pull_time: float,
                   model: str, version: str) -> WavePlan:
    """Every node's pull intervals from the schedule, then a sweep line per wave and overall."""
    horizon = (published + policy.waves.cache_lead + policy.waves.spread
               + (len(policy.waves.order) + 1) * policy.waves.gap + 40 * 86400 + pull_time * 4)
    all_starts: list[float] = []
    all_ends: list[float] = []
    stats = []
    serial = 0
    roles = sorted(counts, key=lambda r: (-1 if wave_index(policy, r) is None
                                          else wave_index(policy, r), r))
    for role in roles:
        windows = windows_for(policy, role)
        spans = Spans.build(windows, published, horizon) if windows else None
        seg_starts: list[float] = []
        seg_ends: list[float] = []
        firsts: list[float] = []
        never = 0
        for _ in range(counts[role]):
            node = f"node-{serial:06d}"
            serial += 1
            frac = offset_fraction(node, role, model, version)
            due = slot_from_fraction(published, frac, role, policy)
            segments = _segments(spans, due, frac, policy.waves.spread, pull_time)
            if not segments:
                never += 1
                continue
            firsts.append(segments[0][0])
            for s, e in segments:
                seg_starts.append(s)
                seg_ends.append(e)
        seg_starts.sort()
        seg_ends.sort()
        peak, _ = _peak(seg_starts, seg_ends)
        stats.append(WaveStats(role, wave_index(policy, role), counts[role],
                               min(firsts, default=None), max(firsts, default=None),
                               max(seg_ends, default=None), peak, never))
        all_starts += seg_starts
        all_ends += seg_ends
    all_starts.sort()
    all_ends.sort()
    peak, at = _peak(all_starts, all_ends)
    return WavePlan(published, pull_time, tuple(stats), peak, at)


def _segments(spans: Spans | None, due: float, frac: float, spread: float,
              pull_time: float) -> list[tuple[float, float]]:
    if spans is None:
        return [(due, due + pull_time)]
    span = spans.next_open(due)
    if span is None:
        return []
    start = due if span[0] <= due else span[0] + frac * min(spread, span[1] - span[0])
    out, left = [], pull_time
    while span is not None:
        end = min(span[1], start + left)
        out.append((start, end))
        if end == start + left:
            break
        left -= end - start
        span = spans.next_open(span[1])
        if span is not None:              # a paused pull resumes as pull_allowed_at says
            start = span[0] + frac * min(spread, span[1] - span[0])
    return out


def _peak(starts: list[float], ends: list[float]) -> tuple[int, float | None]:
    """Most intervals open at once; an interval ending at t doesn't overlap one starting at t."""
    best, at = 0, None
    for i, s in enumerate(starts):
        running = i + 1 - bisect.bisect_right(ends, s)
        if running > best:
            best, at = running, s
    return best, at


def share_nodes(total: int, shares: dict[str, float]) -> dict[str, int]:
    """Split ``total`` nodes by weight, largest remainder first, so the counts add up exactly."""
    weight = sum(shares.values())
    raw = {r: total * w / weight for r, w in shares.items()}
    counts = {r: int(v) for r, v in raw.items()}
    by_remainder = sorted(raw, key=lambda r: raw[r] - counts[r], reverse=True)
    for r in by_remainder[: total - sum(counts.values())]:
        counts[r] += 1
    return counts


def parse_shares(text: str) -> dict[str, float]:
    """``inference=0.3,training=0.6`` -> {"inference": 0.3, "training": 0.6}."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or not name.strip() or share < 0:
            raise ValueError(f"--roles item {item!r} should be ROLE=SHARE, e.g. inference=0.3")
        out[name.strip()] = share
    if sum(out.values()) <= 0:
        raise ValueError("--roles: the shares add up to zero")
    return out


def default_shares(policy: Policy) -> dict[str, float]:
    """The conventional 30/10/60 split over the waves the policy has; other roles an equal share."""
    return {r: CONVENTIONAL_SHARES.get(r, 0.1) for r in policy.waves.order}


def known_roles(policy: Policy) -> set[str]:
    """The roles a node can have under the policy, counted as ``agent.identity`` does."""
    known = {r.name for r in policy.roles} | set(policy.waves.order) | {policy.default_role}
    if policy.cache_role is not None:
        known.add(policy.cache_role)
    return known


def unknown_roles(policy: Policy, roles: Iterable[str]) -> list[str]:
    """One message per role the policy doesn't know. A plan for such a role would put its nodes
    after the last wave without a word: almost always a typo, and the plan then answers another
    question than the one asked."""
    known = known_roles(policy)
    out = []
    for role in roles:
        if role in known:
            continue
        close = difflib.get_close_matches(role, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        out.append(f"unknown role {role!r}{hint}; the policy's roles: "
                   f"{', '.join(sorted(known))}")
    return out
