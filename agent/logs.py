"""Where log lines go and how they look: plain on a terminal, with syslog priorities for journald.

When stderr is the journal (systemd sets ``JOURNAL_STREAM`` to its device and inode), each line
starts with its syslog priority (``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug):
journald reads it as the line's priority, so ``journalctl -p warning -u wagent`` finds the
errors. The prefix is only written when stderr really is that stream (a shell started from the
unit inherits the variable, not the stream).
"""

from __future__ import annotations

import logging
import os
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


def setup(verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter(JOURNAL_FORMAT) if stderr_is_journal()
                         else logging.Formatter(FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.WARNING - 10 * min(verbose, 2))
