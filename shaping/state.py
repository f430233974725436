"""What each interface had before wagent touched it: ``{state_dir}/shaping.json``.

Written before the first change to an interface (so a crash right after still knows what to put
back), kept across restarts and upgrades, and dropped for an interface once ``clear`` restored it.
A record with no ``root`` means wagent found its own tree already there (adopted after the state
was lost): clearing then leaves the kernel's default.

    {"version": 1, "interfaces": {"eth0": {"root": {"kind": "mq", "handle": 0}, "ifb": "wg-eth0"}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent.durable import write_atomic
from shaping.errors import ShapingError
from shaping.reconcile import Original

STATE_FILE = "shaping.json"
VERSION = 1


@dataclass(frozen=True)
class Record:
    interface: str
    original: Original | None
    ifb: str = ""


def path(state_dir: str) -> Path:
    return Path(state_dir) / STATE_FILE


def load(state_dir: str) -> dict[str, Record]:
    p = path(state_dir)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ShapingError(f"{p}: can't read wagent's shaping state ({e}); it records the root "
                           "qdiscs to restore on clear: repair it, or move it away to treat every "
                           "interface's original qdisc as the kernel default") from None
    out = {}
    try:
        for name, rec in data["interfaces"].items():
            root = rec.get("root")
            original = Original(str(root["kind"]), int(root["handle"])) if root else None
            out[name] = Record(name, original, str(rec.get("ifb", "")))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ShapingError(f"{p}: unexpected content ({e!r}); expected {{'version': 1, "
                           "'interfaces': {...}}; move it away to start afresh") from None
    return out


def save(state_dir: str, records: dict[str, Record]) -> None:
    """Atomically: a crash leaves the old file or the new one, never half of one."""
    p = path(state_dir)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": VERSION, "interfaces": {
            r.interface: {"root": ({"kind": r.original.kind, "handle": r.original.handle}
                                   if r.original else None), "ifb": r.ifb}
            for r in sorted(records.values(), key=lambda r: r.interface)}}
        write_atomic(p, (json.dumps(body, indent=2) + "\n").encode(), mode=0o600)
    except OSError as e:
        raise ShapingError(f"{p}: can't write wagent's shaping state ({e}); check that the state "
                           "directory (policy state_dir, or --state-dir) is writable") from None
