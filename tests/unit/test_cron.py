"""Cron parsing and matching: cron's weekday numbers (0 and 7 = Sunday), names, ranges, steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent.cron import CronError, parse_cron


def dt(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# 2026-12-06 is a Sunday, 2026-12-07 a Monday.
SUNDAY, MONDAY = dt(2026, 12, 6, 12, 0), dt(2026, 12, 7, 12, 0)


@pytest.mark.parametrize("dow", ["0", "7", "sun", "SUN", "Sun"])
def test_sunday_is_0_and_7_and_sun(dow):
    spec = parse_cron(f"0 12 * * {dow}")
    assert spec.matches(SUNDAY) and not spec.matches(MONDAY)


def test_monday_is_1_not_0():
    spec = parse_cron("0 12 * * 1")
    assert spec.matches(MONDAY) and not spec.matches(SUNDAY)


def test_weekday_range_and_weekend_list():
    weekdays = parse_cron("0 12 * * mon-fri")
    weekend = parse_cron("0 12 * * sat,sun")
    days = [dt(2026, 12, d, 12, 0) for d in range(6, 13)]  # Sun..Sat
    assert [weekdays.matches(d) for d in days] == [False] + [True] * 5 + [False]
    assert [weekend.matches(d) for d in days] == [True] + [False] * 5 + [True]


def test_range_ending_on_sunday():
    spec = parse_cron("0 12 * * fri-sun")
    assert spec.weekdays == {5, 6, 0}
    assert parse_cron("0 12 * * 5-7").weekdays == {5, 6, 0}


def test_weekday_step_counts_from_sunday():
    # cron: */2 = 0,2,4,6 = sun,tue,thu,sat (APScheduler would say mon,wed,fri,sun)
    assert parse_cron("0 0 * * */2").weekdays == {0, 2, 4, 6}


def test_steps_ranges_lists():
    assert parse_cron("*/15 * * * *").minutes == {0, 15, 30, 45}
    assert parse_cron("5/20 * * * *").minutes == {5, 25, 45}
    assert parse_cron("0 1-7/3,22 * * *").hours == {1, 4, 7, 22}
    assert parse_cron("0 0 1 jan,jul *").months == {1, 7}


def test_day_fields_or_when_both_restricted():
    spec = parse_cron("0 0 13 * fri")             # the 13th, or any Friday (Vixie cron)
    assert spec.matches(dt(2026, 12, 13, 0, 0))   # a Sunday the 13th
    assert spec.matches(dt(2026, 12, 4, 0, 0))    # a Friday the 4th
    assert not spec.matches(dt(2026, 12, 5, 0, 0))


def test_day_fields_and_when_one_is_star():
    spec = parse_cron("0 0 */2 * fri")            # starts with '*': both must match
    assert spec.matches(dt(2026, 12, 11, 0, 0))   # Friday the 11th
    assert not spec.matches(dt(2026, 12, 4, 0, 0))  # Friday the 4th: even day


def test_next_match_across_midnight_year_and_inclusive():
    spec = parse_cron("0 22 * * *")
    assert spec.next_match(dt(2026, 12, 2, 23, 0)) == dt(2026, 12, 3, 22, 0)
    assert spec.next_match(dt(2026, 12, 31, 23, 0)) == dt(2027, 1, 1, 22, 0)
    assert spec.next_match(dt(2026, 12, 2, 22, 0)) == dt(2026, 12, 3, 22, 0)
    assert spec.next_match(dt(2026, 12, 2, 22, 0), inclusive=True) == dt(2026, 12, 2, 22, 0)
    assert spec.next_match(dt(2026, 12, 2, 21, 59, 30)) == dt(2026, 12, 2, 22, 0)


def test_next_match_agrees_with_brute_force():
    for text in ["0 22 * * mon-fri", "*/7 3-5 * * sat", "30 0 1,15 * *",
                 "15 */6 * jun-aug 0"]:
        spec = parse_cron(text)
        t = dt(2026, 12, 2, 11, 7)
        expected = t + timedelta(minutes=1)
        while not spec.matches(expected):
            expected += timedelta(minutes=1)
            assert expected.year < 2031
        assert spec.next_match(t) == expected, text


def test_leap_day_and_never():
    assert parse_cron("0 0 29 2 *").next_match(dt(2026, 1, 1)) == dt(2028, 2, 29)
    assert parse_cron("0 0 30 2 *").next_match(dt(2026, 1, 1)) is None
    assert not parse_cron("0 0 31 apr *").fires()
    assert parse_cron("0 0 31 * *").fires()


def test_macros():
    assert parse_cron("@daily").hours == {0} and parse_cron("@hourly").minutes == {0}
    assert parse_cron("@weekly").weekdays == {0}


@pytest.mark.parametrize("text, words", [
    ("0 25 * * *", "hour 25 is out of range 0-23"),
    ("61 * * * *", "minute 61 is out of range 0-59"),
    ("0 0 * * mon-fry", "day of week 'fry' is not a number (names: sun..sat)"),
    ("0 0 * foo *", "month 'foo' is not a number (names: jan..dec)"),
    ("0 0 * * 8", "day of week 8 is out of range 0-7"),
    ("*/0 * * * *", "step '0' must be a whole number above 0"),
    ("0 0 * *", "has 4 fields; expected five fields"),
    ("0 0 5-1 * *", "range '5-1' runs backwards"),
    ("@fortnightly", "unknown cron macro"),
    ("", "is empty"),
])
def test_errors_name_the_field(text, words):
    with pytest.raises(CronError) as e:
        parse_cron(text)
    assert words in str(e.value)


def test_a_time_zone_reads_the_fields_on_its_wall_clock():
    from zoneinfo import ZoneInfo
    berlin = ZoneInfo("Europe/Berlin")
    spec = parse_cron("0 22 * * *")
    summer = spec.next_match(datetime(2026, 6, 1, tzinfo=UTC), tz=berlin)
    winter = spec.next_match(datetime(2026, 12, 1, tzinfo=UTC), tz=berlin)
    assert summer == datetime(2026, 6, 1, 20, 0, tzinfo=UTC)
    assert winter == datetime(2026, 12, 1, 21, 0, tzinfo=UTC)
    assert spec.matches(winter, berlin) and not spec.matches(winter)


def test_daylight_saving_changes_skip_nothing_and_repeat_nothing():
    from zoneinfo import ZoneInfo
    berlin = ZoneInfo("Europe/Berlin")
    spec = parse_cron("30 2 * * *")
    # 29 March 2026: 02:00 CET jumps to 03:00 CEST; 02:30 doesn't exist and comes an hour late.
    spring = spec.next_match(datetime(2026, 3, 29, 0, 0, tzinfo=UTC), tz=berlin)
    assert spring == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    # 25 October 2026: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice, matches once.
    first = spec.next_match(datetime(2026, 10, 25, 0, 0, tzinfo=UTC), tz=berlin)
    assert first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert spec.next_match(first, tz=berlin) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    every = parse_cron("*/20 * * * *")
    t, seen = datetime(2026, 10, 24, 23, 0, tzinfo=UTC), []
    while t < datetime(2026, 10, 25, 3, 0, tzinfo=UTC):
        t = every.next_match(t, tz=berlin)
        seen.append(t)
    assert seen == sorted(set(seen))                  # strictly forward, never twice


def test_a_skipped_hours_match_is_found_from_just_after_the_change():
    from zoneinfo import ZoneInfo
    berlin = ZoneInfo("Europe/Berlin")
    # 02:30 on 29 March 2026 is 01:30 UTC (on CET). From 01:10 UTC the wall clock reads 03:10
    # CEST, past 02:30: it used to answer the next night, hiding that night's window.
    spec = parse_cron("30 2 * * *")
    assert spec.next_match(dt(2026, 3, 29, 1, 10), tz=berlin) == dt(2026, 3, 29, 1, 30)
    assert spec.next_match(dt(2026, 3, 29, 1, 30), tz=berlin) == dt(2026, 3, 30, 0, 30)


def test_lord_howes_half_hour_change_interleaves_and_the_earliest_comes_first():
    from zoneinfo import ZoneInfo
    howe = ZoneInfo("Australia/Lord_Howe")
    # 4 October 2026, 02:00 +10:30 becomes 02:30 +11 (15:30 UTC): 02:10 doesn't exist and
    # lands at 15:40 UTC, after 02:35 (15:35 UTC), though it comes first on the wall.
    spec = parse_cron("10,35 2 * * *")
    assert spec.next_match(dt(2026, 10, 3, 15, 0), tz=howe) == dt(2026, 10, 3, 15, 35)
    assert spec.next_match(dt(2026, 10, 3, 15, 35), tz=howe) == dt(2026, 10, 3, 15, 40)


@pytest.mark.parametrize("zone,day", [("Europe/Berlin", (2026, 3, 29)),
                                      ("Europe/Berlin", (2026, 10, 25)),
                                      ("America/New_York", (2026, 3, 8)),
                                      ("Australia/Lord_Howe", (2026, 10, 4)),
                                      ("Australia/Lord_Howe", (2026, 4, 5))])
@pytest.mark.parametrize("text", ["30 2 * * *", "*/20 * * * *", "10,35 1-3 * * *",
                                  "59 2 * * *", "0 3 * * *"])
def test_next_match_is_the_earliest_match_around_a_change(zone, day, text):
    """Every wall minute of three days, mapped as documented (fold=0), against next_match from
    every 90 s of the hours around the change."""
    from zoneinfo import ZoneInfo
    tz, spec = ZoneInfo(zone), parse_cron(text)
    wall = datetime(*day) - timedelta(days=1)
    matches = set()
    for _ in range(3 * 1440):
        if spec.matches(wall.replace(tzinfo=UTC)):         # the fields, read on the naive wall
            matches.add(wall.replace(tzinfo=tz, fold=0).astimezone(UTC))
        wall += timedelta(minutes=1)
    after = datetime(*day, tzinfo=tz).astimezone(UTC) - timedelta(hours=2)
    while after < datetime(*day, tzinfo=tz).astimezone(UTC) + timedelta(hours=8):
        want = min(m for m in matches if m > after)
        assert spec.next_match(after, tz=tz) == want, after
        assert spec.next_match(after, inclusive=True, tz=tz) == \
            (after if after in matches else want), after
        after += timedelta(seconds=90)
