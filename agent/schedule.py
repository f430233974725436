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
import calendar
import functools
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, tzinfo
from zoneinfo import ZoneInfo

from agent.cron import CronSpec, month_days, parse_cron
from agent.policy.model import Policy, Window

CACHE_SPREAD = 60.0            # cache nodes start within a minute of publication
POLL_SLACK = 1e-6              # s: a time this close to a poll time is that poll time
# A slot at or after this (year 9000) never comes: datetime ends at year 9999, so windows can't
# be read there, and a version published for then is one a publisher staged for "never".
NEVER = 221845392000.0     # 9000-01-01T00:00:00Z


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
        if not _fires(w.cron):
            continue            # next_match would search 28 years to say so, every call
        spec, zone = _spec(w.cron), _zone(w.tz)
        m = spec.next_match(_dt(now - w.duration), inclusive=True, tz=zone)
        if m is not None and m.timestamp() + w.duration <= now:
            # The match exactly one duration ago closes now; one starting now opens now
            # (`* * * * *` 1m at 12:01:00 is open, as its spans join up).
            m = spec.next_match(m, tz=zone)
        if m is not None and m.timestamp() <= now < m.timestamp() + w.duration:
            return True
    return False


def next_opening(windows: Iterable[Window], now: float) -> float | None:
    """``now`` if open, else when the next window opens; None if none ever will."""
    windows = tuple(windows)
    if is_open(windows, now):
        return now
    nexts = [m.timestamp() for w in windows if _fires(w.cron)
             and (m := _spec(w.cron).next_match(_dt(now), tz=_zone(w.tz))) is not None]
    return min(nexts, default=None)


def open_until(windows: Iterable[Window], now: float, horizon: float = 400 * 86400.0) -> float:
    """When the window open at ``now`` closes (overlapping windows joined); ``now`` if closed.

    With no windows, or windows that chain beyond ``horizon``, ``now + horizon``. Costs a few
    runs of windows, not one step per cron match: see ``_chain_end``.
    """
    windows = tuple(windows)
    if not windows:
        return now + horizon
    return _chain_end(windows, now, now + horizon)


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
    moved into the role's windows. None if the role's windows never open, or if the slot lies
    past ``NEVER`` (a publisher's far-future ``published``: no calendar holds its windows)."""
    frac = offset_fraction(node_id, role, model, version)
    due = max(slot_from_fraction(published_at, frac, role, policy), learned_at)
    if not due < NEVER:                       # NaN included
        return None
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


# -- the chain of joined windows, run by run ---------------------------------------------------
#
# open_until used to build the spans of every match for a day at a time and walk them: with
# "* * * * *" for 1m (1,440 matches a day, joined for 400 days) that was 576,000 cron steps, 2.7 s
# of CPU on every status call. A window's matches are one day's pattern (the minute and hour
# fields) repeated on its matching days (the day and month fields), read on a wall clock that
# keeps one UTC offset between daylight-saving changes. So a window's run of joined spans is
# found by jumps: to the first gap inside a day longer than the window, else across the
# matching days of a month at once, else to the next offset change. The union of windows is
# walked run by run; when every window repeats daily or weekly and the chain has covered a whole
# period, it covers every period up to the next offset change, which is jumped to.

DAY = 86400
WEEK = 7 * DAY
_EPOCH_DAY = date(1970, 1, 1).toordinal()
# s: how far past an offset change matches can still sit on the old offset (the skipped hour of
# a spring change maps its matches there), besides the windows' own length
DST_SLACK = 7200.0
_SAMPLE = 6 * 3600             # s: zones change offset at most once in this long


@dataclass(frozen=True)
class _Shape:
    """One window's matches on its wall clock: ``secs`` after midnight on each matching day."""

    spec: CronSpec
    duration: float
    secs: tuple[int, ...]
    breaks: tuple[int, ...]    # indexes i: the day's next match is more than ``duration`` later
    days_apart: int            # matching days at most this many days apart join up (no breaks)
    period: int | None         # DAY or WEEK when the matching days repeat so; else None
    endless: bool              # a run, once begun, never ends (on one offset)


@functools.lru_cache(maxsize=256)
def _shape(text: str, duration: float) -> _Shape:
    spec = _spec(text)
    secs = spec.day_seconds()
    breaks = tuple(i for i in range(len(secs) - 1) if secs[i + 1] - secs[i] > duration)
    apart = math.floor((duration - secs[0] + secs[-1]) / DAY)
    period, gap = _shape_period(spec), None
    if period == DAY:
        gap = 1
    elif period == WEEK:                    # the longest run of days without a match, + 1
        ds = sorted(spec.weekdays)
        gap = max(b - a for a, b in zip(ds, ds[1:] + [ds[0] + 7], strict=True))
    endless = not breaks and gap is not None and gap <= apart
    return _Shape(spec, duration, secs, breaks, apart, period, endless)


@functools.lru_cache(maxsize=256)
def _every_day(spec: CronSpec) -> bool:
    return _shape_period(spec) == DAY


def _shape_period(spec: CronSpec) -> int | None:
    """DAY if every day matches, WEEK if only the weekday field decides, else None."""
    if spec.months != frozenset(range(1, 13)):
        return None
    full_days, full_week = spec.days == frozenset(range(1, 32)), len(spec.weekdays) == 7
    if not (spec.days_star or spec.weekdays_star):     # cron's "either day field" rule
        return DAY if full_days or full_week else None
    if full_days:
        return DAY if full_week else WEEK
    return None


def _day_date(day: int) -> date:
    return date.fromordinal(_EPOCH_DAY + day)


def _is_day(spec: CronSpec, day: int) -> bool:
    if _every_day(spec):
        return True
    d = _day_date(day)
    return d.day in month_days(spec, d.year, d.month)


def _next_day(spec: CronSpec, day: int, last: int) -> int | None:
    """The first matching day in [day, last] (days since the epoch), month by month."""
    if _every_day(spec):
        return day if day <= last else None
    while day <= last:
        d = _day_date(day)
        days = month_days(spec, d.year, d.month)
        i = bisect.bisect_left(days, d.day)
        if i < len(days):
            found = day + days[i] - d.day
            return found if found <= last else None
        day += calendar.monthrange(d.year, d.month)[1] - d.day + 1
    return None


def _prev_day(spec: CronSpec, day: int, first: int) -> int | None:
    """The last matching day in [first, day]."""
    if _every_day(spec):
        return day if day >= first else None
    while day >= first:
        d = _day_date(day)
        days = month_days(spec, d.year, d.month)
        i = bisect.bisect_right(days, d.day) - 1
        if i >= 0:
            found = day - (d.day - days[i])
            return found if found >= first else None
        day -= d.day
    return None


def _prev_match(shape: _Shape, x: float, lo: float) -> int | None:
    """The last match at or before wall time ``x``, if it is at or after ``lo``."""
    day = math.floor(x / DAY)
    if _is_day(shape.spec, day):
        i = bisect.bisect_right(shape.secs, x - day * DAY) - 1
        if i >= 0:
            m = day * DAY + shape.secs[i]
            return m if m >= lo else None
    found = _prev_day(shape.spec, day - 1, math.floor(lo / DAY))
    if found is None:
        return None
    m = found * DAY + shape.secs[-1]
    return m if m >= lo else None


def _run_last(shape: _Shape, m: int, stop: float) -> int:
    """The last match before ``stop`` of the run of joined spans that holds match ``m``."""
    secs = shape.secs
    day = m // DAY
    last: int | None = None
    if not shape.endless:
        i = bisect.bisect_left(secs, m - day * DAY)
        j = bisect.bisect_left(shape.breaks, i)
        if j < len(shape.breaks):
            last = day * DAY + secs[shape.breaks[j]]
        elif shape.days_apart < 1:
            last = day * DAY + secs[-1]
        elif shape.breaks:          # over midnight, to the next matching day's first gap
            nd = _next_day(shape.spec, day + 1, day + shape.days_apart)
            last = (nd * DAY + secs[shape.breaks[0]]) if nd is not None else day * DAY + secs[-1]
        else:                       # whole days joined: month by month, to the first hole
            stop_day = math.floor(stop / DAY)
            while day <= stop_day:
                d = _day_date(day)
                days = month_days(shape.spec, d.year, d.month)
                if days[-1] - days[0] == len(days) - 1:      # a block of days: to its end
                    i = len(days) - 1
                else:
                    i = bisect.bisect_left(days, d.day)
                    while i + 1 < len(days) and days[i + 1] - days[i] <= shape.days_apart:
                        i += 1
                day += days[i] - d.day
                nd = None if i + 1 < len(days) else \
                    _next_day(shape.spec, day + 1, day + shape.days_apart)
                if nd is None:
                    last = day * DAY + secs[-1]
                    break
                day = nd
    if last is not None and last < stop:
        return last
    found = _prev_match(shape, math.ceil(stop) - 1, m)     # the run goes on past stop
    return found if found is not None else m


@dataclass(frozen=True)
class _Piece:
    """A window's matches between two offset changes: wall times in [lo, hi), at ``offset``."""

    shape: _Shape
    offset: int
    lo: float
    hi: float

    @property
    def reach(self) -> tuple[float, float]:
        """The UTC times its spans can hold: [first, last)."""
        return self.lo - self.offset, self.hi - self.offset + self.shape.duration

    def run_end(self, r: float, limit: float) -> float | None:
        """Where the run of this piece's spans that holds UTC time ``r`` ends (None if none
        holds it), looking no further than UTC ``limit``."""
        d, x = self.shape.duration, r + self.offset
        m = _prev_match(self.shape, min(x, self.hi - 1), max(self.lo, x - d))
        if m is None or m + d <= x:
            return None
        last = _run_last(self.shape, m, min(self.hi, limit + self.offset))
        return last + d - self.offset


def _offset(zone: tzinfo, t: float) -> int:
    off = datetime.fromtimestamp(t, zone).utcoffset()
    return int(off.total_seconds()) if off is not None else 0


@functools.lru_cache(maxsize=256)
def _year_changes(zone: tzinfo, year: int) -> tuple[tuple[int, int, int], ...]:
    """The zone's offset changes in ``year``: (UTC instant, offset before, offset after)."""
    t = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(year + 1, 1, 1, tzinfo=UTC).timestamp())
    out, off = [], _offset(zone, t)
    while t < end:
        n = min(t + _SAMPLE, end)
        o = _offset(zone, n)
        if o != off:
            a, b = t, n
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if _offset(zone, mid) == off else (a, mid)
            out.append((b, off, o))
        t, off = n, o
    return tuple(out)


@dataclass(frozen=True)
class _YearPieces:
    """A window set's pieces over whole years, with what the walk needs to know of them."""

    pieces: tuple[tuple[float, float, _Piece], ...]     # with the UTC times each can hold
    changes: tuple[int, ...]        # UTC instants at which any window's offset changes
    period: int | None              # every window repeats daily (DAY) or weekly (WEEK)
    longest: float


@functools.lru_cache(maxsize=64)
def _year_pieces(windows: tuple[Window, ...], first_year: int, last_year: int) -> _YearPieces:
    """The pieces of ``windows`` from 1 January of ``first_year`` to the end of ``last_year``
    (cached: the daemon asks for the same windows every second)."""
    firing = [w for w in windows if _fires(w.cron)]
    pieces: list[_Piece] = []
    changes: set[int] = set()
    for w in firing:
        zone, shape = _zone(w.tz), _shape(w.cron, w.duration)
        wall_lo, off = -math.inf, _offset(zone, datetime(first_year, 1, 1, tzinfo=UTC).timestamp())
        years = range(first_year, last_year + 1) if zone is not UTC else ()
        for at, before, after in (c for y in years for c in _year_changes(zone, y)):
            # fold=0: wall times up to the later of the two readings keep the old offset
            wall_hi = at + max(before, after)
            pieces.append(_Piece(shape, off, wall_lo, wall_hi))
            wall_lo, off = wall_hi, after
            changes.add(at)
        pieces.append(_Piece(shape, off, wall_lo, math.inf))
    periods = {p.shape.period for p in pieces}
    period = None if None in periods else max(periods, default=None)    # DAY divides WEEK
    return _YearPieces(tuple((*p.reach, p) for p in pieces), tuple(sorted(changes)), period,
                 max((w.duration for w in firing), default=0.0))


def _chain_end(windows: tuple[Window, ...], now: float, limit: float) -> float:
    """The end of the joined spans that hold ``now`` (``now`` if none), or ``limit`` if they
    reach it. The same as building every span and merging them (the unit tests check it
    against that), in runs: see the comment above."""
    plan = _year_pieces(windows, _dt(now - 3 * DAY - max(w.duration for w in windows)).year,
                        _dt(limit + 2 * DAY).year)
    if not plan.pieces:
        return now
    period, marks, longest = plan.period, plan.changes, plan.longest
    r = now
    while r < limit:
        ends = [e for first, last, p in plan.pieces
                if first <= r < last and (e := p.run_end(r, limit)) is not None]
        if not ends:
            return r
        if period is not None:
            i = bisect.bisect_right(marks, r)
            settled = marks[i - 1] + longest + DST_SLACK if i else -math.inf
            if r - period >= max(now, settled):
                # [r - period, r] is covered and every window repeats with the period until
                # the next offset change: so is everything up to that change
                upto = marks[i] if i < len(marks) else math.inf
                if upto >= limit:
                    return limit
                n = math.floor((upto - r) / period) - 1
                if n >= 1:
                    r += n * period
                    continue
        r = max(ends)
    return limit


@functools.lru_cache(maxsize=256)
def _fires(text: str) -> bool:
    return _spec(text).fires()


@functools.lru_cache(maxsize=256)
def _spec(text: str) -> CronSpec:
    return parse_cron(text)


@functools.lru_cache(maxsize=64)
def _zone(name: str) -> tzinfo:
    """The policy's time zone (validated when it loaded)."""
    return UTC if name == "UTC" else ZoneInfo(name)


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)
