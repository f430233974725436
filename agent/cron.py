"""Cron expressions, parsed and evaluated in UTC or a time zone: pure, no clock, no scheduler.

Five fields, as in crontab(5): minute, hour, day of month, month, day of week. Day of week uses
cron's numbering, 0 and 7 both Sunday (APScheduler's CronTrigger counts from Monday = 0, which is
why wagent never hands a cron string to it). Names work for months (jan..dec) and weekdays
(sun..sat); lists (``mon,wed``), ranges (``mon-fri``), steps (``*/15``, ``1-30/2``) and the
macros ``@hourly @daily @midnight @weekly @monthly @yearly @annually`` too. A weekday range may
end on Sunday (``fri-sun``). As in Vixie cron, when both day fields are restricted (neither starts
with ``*``) a day matches if EITHER matches.

>>> spec = parse_cron("0 22 * * mon-fri")
>>> spec.next_match(datetime(2026, 12, 4, 23, 0, tzinfo=UTC))   # a Friday night
datetime.datetime(2026, 12, 7, 22, 0, tzinfo=datetime.timezone.utc)
"""

from __future__ import annotations

import bisect
import calendar
import functools
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo

MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# How far next_match looks before it declares that an expression never fires: 29 February on a
# given weekday can take 28 years to come round.
HORIZON_YEARS = 28
# How long after a spring change the skipped hour's matches can land (on the old offset): the
# largest jump of a zone's offset, with margin.
SPRING_REACH = timedelta(hours=3)
FORMS = "five fields 'minute hour day-of-month month day-of-week', e.g. '0 22 * * mon-fri', " \
    "'*/15 * * * *', '30 1 * * sat,sun', or @daily/@hourly/@weekly"


class CronError(ValueError):
    """A cron expression that doesn't parse; the message names the field and the fix."""


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    name_base: int = 0


_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field("month", 1, 12, MONTHS, 1),
    _Field("day of week", 0, 7, WEEKDAYS, 0),
)


@dataclass(frozen=True)
class CronSpec:
    """A parsed expression: the sets of values each field allows."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]          # 0 = Sunday .. 6 = Saturday
    days_star: bool                   # day-of-month field starts with '*'
    weekdays_star: bool

    def __hash__(self) -> int:
        # the text decides the sets, and is cheap to hash: window arithmetic looks specs up in
        # caches many times a call
        return hash(self.text)

    def matches(self, t: datetime, tz: tzinfo = UTC) -> bool:
        """Whether minute ``t`` is a match, read on the wall clock of ``tz``."""
        t = t.astimezone(tz)
        return (t.minute in self.minutes and t.hour in self.hours and t.month in self.months
                and self._day_ok(t))

    def next_match(self, after: datetime, inclusive: bool = False,
                   tz: tzinfo = UTC) -> datetime | None:
        """The first match at or after (``inclusive``) or strictly after ``after``, in UTC.

        The fields are read on the wall clock of ``tz``. Across a daylight-saving change: a
        wall time that doesn't exist (the hour skipped in spring) matches at the same distance
        past the change (02:30 becomes 03:30); one that happens twice (the hour repeated in
        autumn) matches once, the first time.

        None if the expression never fires (e.g. ``0 0 30 2 *``). Jumps field by field, so a
        call costs a few dozen steps, not one per minute.

        The skipped hour's matches land just after a spring change, among the first matches of
        the new offset: there the wall clock's order is not time's, and both sides are searched
        so that the earliest match is the one returned, whatever ``after``.
        """
        after = after.astimezone(UTC)
        t = after.astimezone(tz).replace(tzinfo=None)     # wall clock, stepped naively
        exact = t.second == 0 and t.microsecond == 0
        t = t.replace(second=0, microsecond=0)
        if not (inclusive and exact):
            t += timedelta(minutes=1)
        at = self._search(t, after, inclusive, tz)
        if tz is UTC:
            return at
        before, now_off = _utcoffset(after - SPRING_REACH, tz), _utcoffset(after, tz)
        if before < now_off:
            # just after a spring change: the skipped hour's matches, on the old offset, sit
            # before the wall clock's reading of ``after``
            start = (after + before).replace(tzinfo=None, second=0, microsecond=0)
            at = _earliest(at, self._search(start, after, inclusive, tz))
        if at is not None:
            wall = at.astimezone(tz).replace(tzinfo=None)
            if _utcoffset(at - SPRING_REACH, tz) < _utcoffset(at, tz):
                # ``at`` is just after a spring change (maybe a skipped wall time): the new
                # offset's first wall times can map to earlier instants
                change = _change_between(at - SPRING_REACH, at, tz)
                start = max(after, change).astimezone(tz).replace(tzinfo=None)
                start = start.replace(second=0, microsecond=0)
                if start < wall:
                    at = _earliest(at, self._search(start, after, inclusive, tz))
        return at

    def _search(self, t: datetime, after: datetime, inclusive: bool,
                tz: tzinfo) -> datetime | None:
        """The first match, in wall order from naive wall minute ``t``, after ``after``."""
        while True:
            wall = self._next_wall(t)
            if wall is None:
                return None
            # fold=0: the first of a repeated wall time; a skipped one lands past the change.
            at = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
            if at > after or (inclusive and at == after):
                return at
            t = wall + timedelta(minutes=1)     # the repeated hour's second pass: skip it

    def _next_wall(self, t: datetime) -> datetime | None:
        """The first matching naive wall-clock minute at or after ``t``."""
        limit_year = t.year + HORIZON_YEARS
        while t.year <= limit_year:
            if t.month not in self.months:
                t = _next_month(t)
                continue
            if not self._day_ok(t):
                # the next matching day of this month, else the month's end: one step, not one
                # per day (29 February on a weekday would otherwise walk years day by day)
                days = month_days(self, t.year, t.month)
                i = bisect.bisect_right(days, t.day)
                if i < len(days):
                    t = t.replace(day=days[i], hour=0, minute=0)
                else:
                    t = _next_month(t)
                continue
            if t.hour not in self.hours:
                later = [h for h in self.hours if h > t.hour]
                if later:
                    t = t.replace(hour=min(later), minute=0)
                else:
                    t = (t + timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if t.minute not in self.minutes:
                later = [m for m in self.minutes if m > t.minute]
                if later:
                    t = t.replace(minute=min(later))
                else:
                    t = t.replace(minute=0) + timedelta(hours=1)
                continue
            return t
        return None

    def fires(self) -> bool:
        """Whether the expression ever matches (``0 0 31 2 *`` never does)."""
        return self.next_match(datetime(2000, 1, 1, tzinfo=UTC)) is not None

    def day_seconds(self) -> tuple[int, ...]:
        """The seconds after midnight at which a matching day matches, in order: the same
        for every matching day, as the minute and hour fields don't depend on the day."""
        return tuple(sorted(h * 3600 + m * 60 for h in self.hours for m in self.minutes))

    def _day_ok(self, t: date) -> bool:
        dom = t.day in self.days
        dow = (t.isoweekday() % 7) in self.weekdays
        if self.days_star or self.weekdays_star:
            return dom and dow
        return dom or dow


@functools.lru_cache(maxsize=4096)
def month_days(spec: CronSpec, year: int, month: int) -> tuple[int, ...]:
    """The days of ``year``-``month`` on which ``spec`` matches, in order (empty if the month
    field excludes it). Cached: window arithmetic walks a year month by month, not day by day."""
    if month not in spec.months:
        return ()
    n = calendar.monthrange(year, month)[1]
    return tuple(d for d in range(1, n + 1) if spec._day_ok(date(year, month, d)))


def parse_cron(text: str) -> CronSpec:
    """Parse ``text``; raises CronError naming the bad field and the accepted forms."""
    if not isinstance(text, str) or not text.strip():
        raise CronError(f"cron {text!r} is empty; expected {FORMS}")
    expanded = MACROS.get(text.strip().lower(), text)
    if expanded.startswith("@"):
        raise CronError(f"unknown cron macro {text.strip()!r}; known: {', '.join(MACROS)}")
    parts = expanded.split()
    if len(parts) != 5:
        raise CronError(f"cron {text!r} has {len(parts)} fields; expected {FORMS}")
    sets = [_parse_field(p, f, text) for p, f in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(d % 7 for d in sets[4])
    return CronSpec(text, sets[0], sets[1], sets[2], sets[3], weekdays,
                    parts[2].startswith("*"), parts[4].startswith("*"))


def _parse_field(part: str, f: _Field, text: str) -> frozenset[int]:
    values: set[int] = set()
    for item in part.split(","):
        base, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise CronError(f"cron {text!r}: {f.name} step {step_text!r} must be a whole "
                                f"number above 0")
            step = int(step_text)
        if base == "*":
            low, high = f.low, f.high if f.name != "day of week" else 6
        elif "-" in base:
            a, _, b = base.partition("-")
            low, high = _value(a, f, text), _value(b, f, text)
            if f.name == "day of week" and high == 0 and low > 0:
                high = 7                      # fri-sun: Sunday as the end of a range
            if high < low:
                raise CronError(f"cron {text!r}: {f.name} range {base!r} runs backwards")
        else:
            low = _value(base, f, text)
            # "5/15" in minutes means 5, 20, 35, 50: from the value to the field's end.
            high = (f.high if f.name != "day of week" else 6) if step_text else low
        values.update(range(low, high + 1, step))
    return frozenset(values)


def _value(token: str, f: _Field, text: str) -> int:
    low = token.lower()
    if f.names and low in f.names:
        return f.names.index(low) + f.name_base
    if not token.isdigit():
        hint = f" (names: {f.names[0]}..{f.names[-1]})" if f.names else ""
        raise CronError(f"cron {text!r}: {f.name} {token!r} is not a number{hint}")
    value = int(token)
    if not f.low <= value <= f.high:
        raise CronError(f"cron {text!r}: {f.name} {value} is out of range {f.low}-{f.high}")
    return value


def _utcoffset(t: datetime, tz: tzinfo) -> timedelta:
    return t.astimezone(tz).utcoffset() or timedelta(0)


def _change_between(lo: datetime, hi: datetime, tz: tzinfo) -> datetime:
    """The instant in (lo, hi] at which ``tz``'s offset changes (it differs at the two ends)."""
    off = _utcoffset(lo, tz)
    while hi - lo > timedelta(seconds=1):
        mid = lo + (hi - lo) / 2
        lo, hi = (mid, hi) if _utcoffset(mid, tz) == off else (lo, mid)
    return hi.replace(microsecond=0) if hi.microsecond else hi


def _earliest(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else min(a, b)


def _next_month(t: datetime) -> datetime:
    if t.month == 12:
        return t.replace(year=t.year + 1, month=1, day=1, hour=0, minute=0)
    return t.replace(month=t.month + 1, day=1, hour=0, minute=0)
