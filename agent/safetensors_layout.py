"""Where a .safetensors file's pieces start and end, following its tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
``data_offsets`` (relative to the end of the header), then the tensor bytes. The pieces are:

* piece 0: the length and the JSON header (it changes whenever any tensor moves or is resized);
* a tensor of ``min_piece`` bytes or more: a piece of its own, split every ``piece_size`` bytes
  counted from the tensor's own start;
* smaller tensors: grouped with their neighbours of the same layer (``model.layers.7.``) or the same
  module (``model.norm.``), a group closing before it would exceed ``min_piece`` bytes.

Every boundary is decided by tensor names and sizes local to one layer, never by a byte count
running across the file, so a new version that changes or resizes a few layers leaves every other
piece's bytes (and sha256) as they were: only offsets move, and pieces are matched by hash.

>>> fixed_pieces(10, 4)
[(0, 4), (4, 4), (8, 2)]
"""

from __future__ import annotations

import json
import re
import struct
from typing import BinaryIO

MAX_HEADER = 100 * 2**20          # safetensors itself refuses larger headers
DEFAULT_MIN_PIECE = 2**20
_LAYER = re.compile(r"^(.*?\.\d+\.)")


class LayoutError(ValueError):
    """A .safetensors file whose header can't be read; the message names the file."""


def fixed_pieces(size: int, piece_size: int) -> list[tuple[int, int]]:
    return [(o, min(piece_size, size - o)) for o in range(0, size, piece_size)]


def read_header(f: BinaryIO, file_size: int, where: str = "") -> tuple[int, dict]:
    """(header length, parsed header) of an open safetensors file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise LayoutError(f"{where}: shorter than a safetensors header (8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER or 8 + n > file_size:
        raise LayoutError(f"{where}: header length {n} does not fit the file ({file_size} bytes)")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise LayoutError(f"{where}: header is not a JSON object")
    return n, header


def tensor_spans(header: dict, data_size: int, where: str = "") -> list[tuple[str, int, int]]:
    """(name, start, end) of each tensor in file order, relative to the data section."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise LayoutError(f"{where}: tensor {name!r} has bad data_offsets {offsets!r}")
        spans.append((name, offsets[0], offsets[1]))
    spans.sort(key=lambda s: (s[1], s[2]))
    for (a, _, a_end), (b, b_start, _) in zip(spans, spans[1:], strict=False):
        if b_start < a_end:
            raise LayoutError(f"{where}: tensors {a!r} and {b!r} overlap")
    return spans


def group_key(name: str) -> str:
    """The layer (``model.layers.7.``) or module (``model.norm.``) a tensor belongs to."""
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] + "." if "." in name else name


def layout(header_len: int, header: dict, file_size: int, piece_size: int,
           min_piece: int = DEFAULT_MIN_PIECE, where: str = "") -> list[tuple[int, int]]:
    """(offset, size) of every piece; together they tile the file exactly."""
    base = 8 + header_len
    spans = tensor_spans(header, file_size - base, where)
    # A unit runs from one tensor's start to the next one's, so gaps and trailing bytes are
    # covered too (they belong to the tensor before them).
    starts = [s for _, s, _ in spans]
    units = []
    for i, (name, start, _) in enumerate(spans):
        end = starts[i + 1] if i + 1 < len(spans) else file_size - base
        if end > start:
            units.append((name, base + start, end - start))
    if not spans or spans[0][1] > 0:
        first = spans[0][1] if spans else file_size - base
        if first:
            units.insert(0, ("", base, first))
    pieces = [(0, base)]
    group: list[tuple[int, int]] = []
    group_name = None

    def close() -> None:
        nonlocal group, group_name
        if group:
            pieces.append((group[0][0], sum(s for _, s in group)))
        group, group_name = [], None

    for name, offset, size in units:
        if size >= min_piece:
            close()
            pieces.extend((offset + o, s) for o, s in fixed_pieces(size, piece_size))
            continue
        key = group_key(name)
        if group and (key != group_name or sum(s for _, s in group) + size > min_piece):
            close()
        group.append((offset, size))
        group_name = key
    close()
    return pieces


def pieces(f: BinaryIO, file_size: int, piece_size: int, min_piece: int = DEFAULT_MIN_PIECE,
           where: str = "") -> list[tuple[int, int]]:
    """Tensor-aligned pieces of an open .safetensors file (read from its header only)."""
    n, header = read_header(f, file_size, where)
    return layout(n, header, file_size, piece_size, min(min_piece, piece_size), where)
