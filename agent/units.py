"""Units used in policies and on the command line: rates, sizes and durations.

Rates are bits per second internally (``int``), sizes bytes (``int``), durations seconds
(``float``). Accepted forms, as in design.md:

>>> parse_rate("300mbit"), parse_rate("25gbit"), parse_rate("200MB/s")
(300000000, 25000000000, 1600000000)
>>> parse_size("64MiB"), parse_size("1GB")
(67108864, 1000000000)
>>> parse_duration("15m"), parse_duration("1h30m"), parse_duration("100ms")
(900.0, 5400.0, 0.1)

A command-line option also reads a bare number as seconds (``--timeout 60``, as ``timeout(1)``
and systemd read one); a policy wants the unit:

>>> parse_option_duration("60"), parse_option_duration("2.5"), parse_option_duration("1m30s")
(60.0, 2.5, 90.0)

Some rates may also be written as a share of another (``floor: 1%`` of ``link_rate``):

>>> parse_rate_or_share("1%"), parse_rate_or_share("0.5%").of(10**9), parse_rate_or_share("1gbit")
(Share(percent=1.0), 5000000, 1000000000)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RATE_FORMS = "a number and a unit: bit, kbit, mbit, gbit, tbit (per second) or B/s, KB/s, MB/s, " \
    "GB/s, KiB/s, MiB/s, GiB/s (bytes per second), e.g. 300mbit, 25gbit, 200MB/s"
SIZE_FORMS = "a number and a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, e.g. 64MiB, 2TB"
DURATION_FORMS = "numbers with units ms, s, m, h, d, w, e.g. 100ms, 15m, 1h30m, 7d"
OPTION_DURATION_FORMS = f"{DURATION_FORMS}, or a number of seconds, e.g. 60 or 2.5"

_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_NUM_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z/]+)\s*$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_SECONDS = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")


class UnitError(ValueError):
    """A value that doesn't parse; the message names the accepted forms."""


@dataclass(frozen=True)
class Share:
    """A rate written as a percentage of another rate (the policy resolves it: ``of``)."""

    percent: float

    def of(self, bits_per_second: int) -> int:
        """The rate this share is of ``bits_per_second``: at least 1 bit/s."""
        return max(1, int(round(bits_per_second * self.percent / 100)))

    def __str__(self) -> str:
        return f"{self.percent:g}%"


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
SHARE_FORMS = "or a share of the link, e.g. 1%"


def parse_rate_or_share(text: str | int | float) -> int | Share:
    """A rate (``300mbit``) or a percentage (``1%``, more than 0 and at most 100)."""
    if isinstance(text, str) and "%" in text:
        m = _PERCENT.match(text)
        if not m or not 0 < float(m.group(1)) <= 100:
            raise UnitError(f"bad share {text!r}; a share is more than 0% and at most 100%, "
                            "e.g. 1% or 0.5%")
        return Share(float(m.group(1)))
    try:
        return parse_rate(text)
    except UnitError as e:
        raise UnitError(f"{e}, {SHARE_FORMS}") from None


def resolve_rate(value: int | Share | None, base: int) -> int | None:
    """An absolute rate: a ``Share`` taken of ``base``; a rate or None as it is."""
    return value.of(base) if isinstance(value, Share) else value


def parse_rate(text: str | int | float) -> int:
    """Bits per second from ``300mbit``, ``25gbit``, ``200MB/s`` (a bare number is refused)."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise UnitError(f"rate {text!r} needs a unit; accepted: {RATE_FORMS}")
    m = _NUM_UNIT.match(text)
    if m:
        number, unit = float(m.group(1)), m.group(2)
        low = unit.lower()
        if low in _BIT_UNITS and unit in (low, unit.capitalize()):
            return _positive(int(round(number * _BIT_UNITS[low])), text, RATE_FORMS)
        if low.endswith("/s") and low[:-2] in _BYTE_UNITS and unit[-3] == "B":
            return _positive(int(round(number * _BYTE_UNITS[low[:-2]] * 8)), text, RATE_FORMS)
    raise UnitError(f"bad rate {text!r}; accepted: {RATE_FORMS}")


def parse_size(text: str | int) -> int:
    """Bytes from ``64MiB``, ``2TB``, ``512B``."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise UnitError(f"size {text!r} needs a unit; accepted: {SIZE_FORMS}")
    m = _NUM_UNIT.match(text)
    if m and m.group(2).lower() in _BYTE_UNITS and m.group(2)[-1] == "B":
        return _positive(int(round(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])),
                         text, SIZE_FORMS)
    raise UnitError(f"bad size {text!r}; accepted: {SIZE_FORMS}")


def parse_duration(text: str | int | float) -> float:
    """Seconds from ``15m``, ``1h30m``, ``100ms``, ``7d``."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise UnitError(f"duration {text!r} needs a unit; accepted: {DURATION_FORMS}")
    compact = text.replace(" ", "")
    parts = _DURATION_PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise UnitError(f"bad duration {text!r}; accepted: {DURATION_FORMS}")
    return round(sum(float(n) * _DURATION_UNITS[u] for n, u in parts), 6)


def parse_option_duration(text: str) -> float:
    """Seconds from a command-line option taking a time (every one reads this syntax): the
    forms of :func:`parse_duration`, or a bare number of seconds (``60``, ``2.5``)."""
    if _SECONDS.match(text):
        return float(text)
    try:
        return parse_duration(text)
    except UnitError:
        raise UnitError(f"bad duration {text!r}; accepted: {OPTION_DURATION_FORMS}") from None


def format_rate(bits_per_second: float | Share) -> str:
    """``480 Mbit/s`` style, for people (status lines, logs, tables)."""
    if isinstance(bits_per_second, Share):
        return f"{bits_per_second} of the link"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.0f} bit/s"


def format_size(n_bytes: float) -> str:
    """``1.5 GiB`` style, for people."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes:.0f} B"


def format_duration(seconds: float) -> str:
    """``1h05m`` / ``42s`` style, for people."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def _positive(value: int, text: str, forms: str) -> int:
    if value <= 0:
        raise UnitError(f"{text!r} must be more than zero; accepted: {forms}")
    return value


def exact_rate(bits_per_second: int) -> str:
    """The largest unit that writes the rate exactly, in a form ``parse_rate`` reads back."""
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second and bits_per_second % scale == 0:
            return f"{bits_per_second // scale}{unit}"
    return f"{bits_per_second}bit"


def exact_size(n_bytes: int) -> str:
    """The largest unit that writes the size exactly, in a form ``parse_size`` reads back."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10),
                        ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n_bytes and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes}B"


def exact_duration(seconds: float) -> str:
    """``1h30m``, ``100ms``: whole units where they fit, in a form ``parse_duration`` reads."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    s, out = ms // 1000, ""
    for unit, scale in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if s >= scale:
            out += f"{s // scale}{unit}"
            s %= scale
    return out + (f"{s}s" if s or not out else "")
