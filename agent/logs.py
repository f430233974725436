"""Where log lines go and how they look: plain on a terminal, with syslog priorities for journald.

When stderr is the journal (systemd sets ``JOURNAL_STREAM`` to its device and inode), each line
starts with its syslog priority (``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug):
journald reads it as the line's priority, so ``journalctl -p warning -u wagent`` finds the
errors. The prefix is only written when stderr really is that stream (a shell started from the
unit inherits the variable, not the stream). Lines a command prints to stderr itself, rather
than logs, are errors there (``PriorityLines``).
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
from typing import TextIO

FORMAT = "%(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"        # journald keeps the level as the priority


def syslog_priority(levelno: int) -> int:
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class JournalFormatter(logging.Formatter):
    """Every line of a record (a traceback too) carries the record's priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def stderr_is_journal(stream: TextIO | None = None,
                      env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class PriorityLines(io.TextIOBase):
    """stderr when it is the journal: a line written without a priority (a command's own
    message, printed rather than logged, like the daemon's "refusing to start: the policy has
    errors") is an error, ``<3>``, so ``journalctl -p err -u wagent`` shows why the unit won't
    start; lines that carry one (the log records') pass as they are."""

    def __init__(self, raw: TextIO, priority: int = 3) -> None:
        self.raw = raw
        self.prefix = f"<{priority}>"
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.raw.write(("" if _PRIORITY.match(line) else self.prefix) + line + "\n")
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True


_PRIORITY = re.compile(r"<[0-7]>")


def setup(verbose: int) -> None:
    journal = stderr_is_journal()
    if journal and not isinstance(sys.stderr, PriorityLines):
        sys.stderr = PriorityLines(sys.stderr)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter(JOURNAL_FORMAT) if journal
                         else logging.Formatter(FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.WARNING - 10 * min(verbose, 2))
