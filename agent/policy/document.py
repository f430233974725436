"""The effective policy as plain data, roles keyed by name as in the YAML: what
``wagent policy show`` prints (YAML with units, or JSON in base units)."""

from __future__ import annotations

import dataclasses
from typing import Any

from agent.policy.model import Policy
from agent.units import exact_duration, exact_rate, exact_size


def policy_document(policy: Policy, with_units: bool = True) -> dict[str, Any]:
    """The effective policy as plain data, roles keyed by name as in the YAML.

    ``with_units``: rates, sizes and durations written with units (``400000000bit``), so the
    document is a valid policy again; otherwise plain numbers (bits/s, bytes, seconds), for JSON.
    """
    return _plain(policy, {}, with_units)


def _plain(value: Any, meta: Any, with_units: bool) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name), f.metadata, with_units)
                for f in dataclasses.fields(value) if f.metadata.get("yaml", True)
                and not (f.metadata.get("key") and with_units)}
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        key = next((f.name for f in dataclasses.fields(value[0]) if f.metadata.get("key")), None)
        if key and with_units:
            return {getattr(v, key): _plain(v, {}, with_units) for v in value}
        return [_plain(v, {}, with_units) for v in value]
    if isinstance(value, tuple):
        if meta.get("unit") == "port_range":
            return [a if a == b else f"{a}-{b}" for a, b in value] if with_units \
                else [list(v) for v in value]
        return [_plain(v, meta, with_units) for v in value]
    unit = meta.get("unit")
    if value is None or not with_units or unit not in _WRITE:
        return value
    return _WRITE[unit](value)


# Human units that read back to the same value: the document passes `wagent policy check`.
_WRITE = {"rate": exact_rate, "rate_share": exact_rate, "size": exact_size,
          "duration": exact_duration}
