import io
import json
import struct

import pytest

from agent.safetensors_layout import LayoutError, fixed_pieces, group_key, layout, pieces

MiB = 2**20


def make(tensors):
    header, blob, off = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, size, fill in tensors:
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [off, off + size]}
        blob += bytes([fill]) * size
        off += size
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blob


def piece_bytes(data, piece_size=4 * MiB, min_piece=MiB):
    bounds = pieces(io.BytesIO(data), len(data), piece_size, min_piece)
    assert bounds[0][0] == 0
    assert sum(s for _, s in bounds) == len(data)
    for (o1, s1), (o2, _) in zip(bounds, bounds[1:], strict=False):
        assert o1 + s1 == o2
    return [data[o:o + s] for o, s in bounds]


def model(resize_layer3=0, change_layer7=False):
    t = []
    t.append(("model.embed_tokens.weight", 3 * MiB, 1))
    for i in range(12):
        fill = 50 + i
        t += [(f"model.layers.{i}.input_layernorm.weight", 4096 + (resize_layer3 if i == 3 else 0),
               fill),
              (f"model.layers.{i}.self_attn.q_proj.weight", 300_000, fill),
              (f"model.layers.{i}.mlp.down_proj.weight", 2 * MiB, fill + (100 if change_layer7
                                                                         and i == 7 else 0))]
    t.append(("model.norm.weight", 4096, 9))
    t.append(("lm_head.weight", 9 * MiB, 2))       # > piece_size: split at 4 MiB
    return make(t)


def test_stable_under_resize_and_change_elsewhere():
    old = piece_bytes(model())
    new = piece_bytes(model(resize_layer3=512, change_layer7=True))
    changed = [p for p in new if p not in old]
    # The header, layer 3's small-tensor group, layer 7's changed tensor: nothing else.
    assert len(changed) == 3, [len(p) for p in changed]
    assert sum(len(p) for p in changed[1:]) <= 4096 + 512 + 300_000 + 2 * MiB
    assert len(new) == len(old)


def test_big_tensor_split_at_fixed_size_from_its_start():
    sizes = [len(p) for p in piece_bytes(model())]
    assert sizes[-3:] == [4 * MiB, 4 * MiB, 1 * MiB]


def test_group_keys():
    assert group_key("model.layers.7.mlp.up_proj.weight") == "model.layers.7."
    assert group_key("model.norm.weight") == "model.norm."
    assert group_key("bias") == "bias"


def test_fixed_pieces():
    assert fixed_pieces(0, 4) == []
    assert fixed_pieces(8, 4) == [(0, 4), (4, 4)]


def test_gap_and_trailing_bytes_are_covered():
    h = json.dumps({"a": {"data_offsets": [10, 20]}, "b": {"data_offsets": [30, 40]}}).encode()
    n = len(h)
    bounds = layout(n, json.loads(h), 8 + n + 50, 4 * MiB, MiB)
    assert sum(s for _, s in bounds) == 8 + n + 50


@pytest.mark.parametrize("data,msg", [
    (b"\x01\x02", "shorter"),
    (struct.pack("<Q", 10**9) + b"{}", "does not fit"),
    (struct.pack("<Q", 3) + b"{x}", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
])
def test_bad_headers(data, msg):
    with pytest.raises(LayoutError, match=msg):
        pieces(io.BytesIO(data), len(data), MiB)


def test_bad_offsets():
    h = json.dumps({"a": {"data_offsets": [0, 100]}}).encode()
    data = struct.pack("<Q", len(h)) + h + b"x" * 10
    with pytest.raises(LayoutError, match="bad data_offsets"):
        pieces(io.BytesIO(data), len(data), MiB)
    h = json.dumps({"a": {"data_offsets": [0, 8]}, "b": {"data_offsets": [4, 10]}}).encode()
    data = struct.pack("<Q", len(h)) + h + b"x" * 10
    with pytest.raises(LayoutError, match="overlap"):
        pieces(io.BytesIO(data), len(data), MiB)
