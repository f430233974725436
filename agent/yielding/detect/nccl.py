"""Processes that map libnccl: a training job is present on this node.

Scans ``{root}/proc/<pid>/maps`` for ``libnccl`` (``libnccl.so.2``, and the copies wheels ship,
e.g. ``nvidia/nccl/lib/libnccl.so.2``). Reading every process's maps costs a few milliseconds, so
the scan runs at most every ``every`` seconds and the last result is reported in between.
Processes vanish mid-scan and some maps are unreadable (hidepid, another user without
CAP_SYS_PTRACE): both are skipped silently.

    det = NcclDetector(every=5.0)
    det.sample(now)  # -> (NcclReading(pid=4242, comm="python"),)
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.yielding.detect.readings import NcclReading

NEEDLE = b"libnccl"


class NcclDetector:
    def __init__(self, root: str | Path = "/", every: float = 5.0) -> None:
        self._proc = Path(root) / "proc"
        self._every = every
        self._last_scan: float | None = None
        self._found: tuple[NcclReading, ...] = ()
        self.scans = 0

    def sample(self, now: float) -> tuple[NcclReading, ...]:
        if self._last_scan is None or now - self._last_scan >= self._every:
            self._found = self.scan()
            self._last_scan = now
        return self._found

    def scan(self) -> tuple[NcclReading, ...]:
        self.scans += 1
        me = os.getpid() if str(self._proc) == "/proc" else None
        found = []
        try:
            pids = sorted(int(e.name) for e in os.scandir(self._proc) if e.name.isdigit())
        except OSError:
            return ()
        for pid in pids:
            if pid == me:
                continue
            try:
                with open(self._proc / str(pid) / "maps", "rb") as f:
                    maps = f.read()
            except OSError:  # gone, a kernel thread's empty maps, or not ours to read
                continue
            if NEEDLE not in maps:
                continue
            try:
                comm = (self._proc / str(pid) / "comm").read_text().strip()
            except OSError:
                comm = "?"
            found.append(NcclReading(pid, comm))
        return tuple(found)
