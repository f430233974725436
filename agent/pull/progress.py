"""How ``wagent pull`` shows a pull: a bar on a terminal, one log line per file elsewhere."""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

from agent.pull.engine import PullResult
from agent.status import PullProgress
from agent.units import format_duration, format_rate, format_size


def bar_line(p: PullProgress, columns: int = 100) -> str:
    """One line that fits ``columns``: a line longer than the terminal wraps, and ``\r`` then
    redraws only its last part, stacking lines. The details go first, widest last."""
    # Bytes in flight count: with large pieces, verified bytes alone move in jumps.
    done = min(p.bytes_total, p.bytes_done + p.bytes_in_flight)
    frac = done / p.bytes_total if p.bytes_total else 1.0
    frac = min(1.0, max(0.0, frac))
    eta = p.eta
    parts = [f"{frac * 100:5.1f}%",
             f"{format_size(done)}/{format_size(p.bytes_total)}",
             format_rate(p.rate * 8),
             f"ETA {format_duration(eta) if eta is not None else '?'}",
             f"streams {p.streams}", f"files {p.files_done}/{p.files_total}"]
    room = columns - 1                  # the last column stays free: some terminals wrap there
    while parts and len(" ".join(parts)) > room:
        parts.pop()
    text = " ".join(parts)
    width = min(30, room - len(text) - 3)
    if width >= 5:
        filled = int(frac * width)
        text = f"[{'#' * filled}{'.' * (width - filled)}] {text}"
    return text[:room]


def file_line(p: PullProgress, verb: str = "verified") -> str:
    moved = "fetched" if verb == "verified" else "sent"
    return (f"{p.model}/{p.version}: {p.file} {verb} ({p.files_done}/{p.files_total} files, "
            f"{format_size(p.bytes_done)}/{format_size(p.bytes_total)}, "
            f"{format_size(p.bytes_fetched)} {moved})")


def summary(r: PullResult) -> str:
    rate = r.bytes_fetched * 8 / r.seconds if r.seconds > 0 else 0.0
    return (f"{r.model}/{r.version}: {r.files} files, {format_size(r.bytes_total)} in "
            f"{format_duration(r.seconds)}: {format_size(r.bytes_fetched)} fetched "
            f"({format_rate(rate)}), {format_size(r.bytes_reused)} copied locally -> {r.path}")


class Reporter:
    """A progress callback for pull_version (and ``wagent publish``, ``verb`` "uploaded"): a
    redrawn bar if ``out`` is a TTY, else file lines."""

    def __init__(self, out: TextIO | None = None, tty: bool | None = None,
                 quiet: bool = False, verb: str = "verified") -> None:
        self.out = out or sys.stderr
        self.verb = verb
        self.tty = self.out.isatty() if tty is None else tty
        self.quiet = quiet
        self._lock = threading.Lock()
        self._drawn = False

    def __call__(self, p: PullProgress) -> None:
        if self.quiet:
            return
        with self._lock:
            if self.tty:
                if p.event == "file":
                    return
                self.out.write("\r\x1b[K" + bar_line(p, self._columns()))
                self._drawn = True
                if p.event == "done":
                    self.out.write("\n")
                    self._drawn = False
            elif p.event == "file":
                self.out.write(file_line(p, self.verb) + "\n")
            self.out.flush()

    def _columns(self) -> int:
        """The terminal's width now (it may have been resized since the last line)."""
        try:
            return os.get_terminal_size(self.out.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            return 80

    def end(self) -> None:
        """Leave the line after an unfinished bar (an error message follows)."""
        with self._lock:
            if self._drawn:
                self.out.write("\n")
                self.out.flush()
                self._drawn = False
