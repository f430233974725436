import pytest

from agent.units import (
    UnitError,
    format_duration,
    format_rate,
    format_size,
    parse_duration,
    parse_rate,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("300mbit", 300_000_000),
        ("25gbit", 25_000_000_000),
        ("400gbit", 400_000_000_000),
        ("1Mbit", 1_000_000),
        ("200MB/s", 1_600_000_000),
        ("1MiB/s", 8 * 2**20),
        ("1.5gbit", 1_500_000_000),
    ],
)
def test_rates(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["300", "3mbits", "0mbit", "fast", "10 MB", "mbit", "-1mbit"])
def test_bad_rates_name_the_accepted_forms(bad):
    with pytest.raises(UnitError, match="accepted"):
        parse_rate(bad)


def test_bare_numbers_are_refused_for_every_unit():
    for parse in (parse_rate, parse_size, parse_duration):
        with pytest.raises(UnitError, match="needs a unit"):
            parse(300)


def test_sizes_and_durations():
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("2TiB") == 2 * 2**40
    assert parse_size("1GB") == 10**9
    assert parse_duration("15m") == 900
    assert parse_duration("1h30m") == 5400
    assert parse_duration("100ms") == 0.1
    assert parse_duration("7d") == 7 * 86400
    for bad in ("15", "m", "1x", "1h 30"):
        with pytest.raises(UnitError):
            parse_duration(bad)
    with pytest.raises(UnitError):
        parse_size("64mib")


def test_formats_for_people():
    assert format_rate(480e6) == "480 Mbit/s"
    assert format_size(1.5 * 2**30) == "1.5 GiB"
    assert format_duration(65) == "1m05s"
    assert format_duration(3900) == "1h05m"
