"""Which versions and blobs leave the store: a pure choice on values, no file system.

Rules, in order:

1. Per model, the ``keep`` newest versions (by published time) and every pinned version are kept;
   nothing a kept version uses is ever removed.
2. Any other version goes once it has been unused for ``evict_after`` seconds (at once when
   ``evict_after`` is None).
3. While the blobs still referenced exceed ``max_size``, the least recently used remaining
   candidate goes next.
4. A blob no remaining version references goes.

>>> v = [VersionUse("m", "v1", 1.0, 5.0, frozenset({"a"})),
...      VersionUse("m", "v2", 2.0, 6.0, frozenset({"a", "b"}))]
>>> choose(v, {"a": 10, "b": 5, "c": 1}, keep=1, pins={}, max_size=None, now=7.0)
Choice(versions=(('m', 'v1'),), blobs=('c',))
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class VersionUse:
    model: str
    version: str
    published: float
    last_used: float
    blobs: frozenset[str]


@dataclass(frozen=True)
class Choice:
    versions: tuple[tuple[str, str], ...]   # (model, version), least recently used first
    blobs: tuple[str, ...]                  # blob ids (agent.blob_id), sorted


def choose(versions: Sequence[VersionUse], blob_sizes: Mapping[str, int], *,
           keep: int | Mapping[str, int], pins: Mapping[str, Collection[str]],
           max_size: int | None, now: float, evict_after: float | None = None) -> Choice:
    by_model: dict[str, list[VersionUse]] = {}
    for v in versions:
        by_model.setdefault(v.model, []).append(v)
    kept: list[VersionUse] = []
    candidates: list[VersionUse] = []
    for model, vs in by_model.items():
        vs.sort(key=lambda v: (v.published, v.version), reverse=True)
        n = keep.get(model, 0) if isinstance(keep, Mapping) else keep
        pinned = set(pins.get(model, ()))
        for i, v in enumerate(vs):
            (kept if i < n or v.version in pinned else candidates).append(v)
    candidates.sort(key=lambda v: (v.last_used, v.published, v.model, v.version))
    going = [v for v in candidates
             if evict_after is None or now - v.last_used >= evict_after]
    staying = [v for v in candidates if v not in going]
    if max_size is not None:
        while staying and _size(kept + staying, blob_sizes) > max_size:
            going.append(staying.pop(0))
    used = set().union(*(v.blobs for v in kept + staying)) if kept or staying else set()
    return Choice(
        versions=tuple((v.model, v.version) for v in going),
        blobs=tuple(sorted(b for b in blob_sizes if b not in used)),
    )


def _size(versions: Sequence[VersionUse], blob_sizes: Mapping[str, int]) -> int:
    used: set[str] = set()
    for v in versions:
        used |= v.blobs
    return sum(blob_sizes.get(b, 0) for b in used)
