"""Who owns which testbed run, and the sweeper that removes what dead runs left behind.

Every run claims a short prefix (``wt`` + 4 hex digits) by creating an owner record in
``/run/wagent-testbed/<prefix>.json`` *before* it makes any namespace. The record names the owning
pid (with its start time, so a recycled pid doesn't count as alive) and the run's temp root. A run
killed with SIGKILL can't clean up; the next run's sweeper finds namespaces and temp roots whose
owner is gone and removes them. Runs of other live processes (helpers share this machine) are
never touched.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

STATE_DIR = Path(os.environ.get("WAGENT_TESTBED_STATE", "/run/wagent-testbed"))
PREFIX_RE = re.compile(r"^(wt[0-9a-f]{4})-")


def _start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses; the fields after it start past the last ')'.
    return stat[stat.rindex(")") + 2:].split()[19]


def claim_prefix(tmp_root_parent: Path) -> tuple[str, Path]:
    """Pick an unused prefix, write its owner record, make its temp root; return both."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    existing = set(list_netns())
    for _ in range(100):
        prefix = "wt" + secrets.token_hex(2)
        if any(ns.startswith(prefix + "-") for ns in existing):
            continue
        record = STATE_DIR / f"{prefix}.json"
        try:
            fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        tmp_root = tmp_root_parent / f"{prefix}-{os.getpid()}"
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "start": _start_time(os.getpid()),
                       "tmp": str(tmp_root)}, f)
        tmp_root.mkdir(parents=True, exist_ok=True)
        return prefix, tmp_root
    raise RuntimeError(f"no free testbed prefix after 100 tries; look at {STATE_DIR}")


def release_prefix(prefix: str) -> None:
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)


def list_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def kill_netns_processes(ns: str, grace: float = 2.0) -> None:
    """SIGTERM everything inside the namespace, then SIGKILL what is still there after `grace`."""
    pids = netns_pids(ns)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if _alive(p)]
    for pid in netns_pids(ns):
        _signal(pid, signal.SIGKILL)


def delete_netns(ns: str) -> None:
    """Kill what runs inside, then delete; deleting the namespace removes its veths and bridges."""
    kill_netns_processes(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is as good as gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _owner_alive(record: dict) -> bool:
    pid = record.get("pid")
    return isinstance(pid, int) and _alive(pid) and _start_time(pid) == record.get("start")


def sweep() -> list[str]:
    """Remove namespaces, temp roots and records of runs whose owner is gone; return what went."""
    if not STATE_DIR.is_dir() and not any(PREFIX_RE.match(ns) for ns in list_netns()):
        return []
    removed: list[str] = []
    records: dict[str, dict] = {}
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("wt*.json"):
            try:
                records[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                # A half-written record: its writer is either still writing or died mid-write.
                if time.time() - path.stat().st_mtime > 60:
                    records[path.stem] = {}
    for ns in list_netns():
        m = PREFIX_RE.match(ns)
        if not m:
            continue
        record = records.get(m.group(1))
        if record is not None and _owner_alive(record):
            continue
        if record is None and (STATE_DIR / f"{m.group(1)}.json").exists():
            continue  # a record being written right now
        delete_netns(ns)
        removed.append(ns)
    for prefix, record in records.items():
        if _owner_alive(record):
            continue
        tmp = record.get("tmp")
        if tmp and Path(tmp).name.startswith(prefix + "-"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        release_prefix(prefix)
    return removed
