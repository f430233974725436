"""The model generator writes real safetensors and next versions that change only what was asked."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from tests.modelgen import (
    DTYPE_SIZE,
    INDEX,
    generate,
    generate_sized,
    main,
    next_version,
    read_spec,
)

safetensors = pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")


def tensor_bytes(root: Path, spec_tensor) -> bytes:
    with open(root / spec_tensor.file, "rb") as f:
        f.seek(spec_tensor.begin)
        return f.read(spec_tensor.size)


@pytest.fixture
def model(tmp_path):
    root = tmp_path / "v1"
    return root, generate(root, layers=4, hidden=64, shards=3, seed=7, vocab=256)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZE))
def test_safetensors_reads_every_tensor(tmp_path, dtype):
    spec = generate(tmp_path, layers=2, hidden=32, shards=2, seed=1, dtype=dtype, vocab=64)
    np_dtype = {"F16": np.float16, "F32": np.float32}.get(dtype)
    seen = 0
    for shard in spec.shards():
        # BF16 has no numpy type; the pt-free "numpy" loader refuses it, so read its bytes raw.
        with safetensors.safe_open(tmp_path / shard, "np") as f:
            for t in (t for t in spec.tensors if t.file == shard):
                if np_dtype is not None:
                    arr = f.get_tensor(t.name)
                    assert arr.shape == t.shape and arr.dtype == np_dtype
                    assert arr.tobytes() == tensor_bytes(tmp_path, t)
                else:
                    assert f.get_slice(t.name).get_shape() == list(t.shape)
                seen += 1
    assert seen == len(spec.tensors) == 2 + 2 * 12 + 1
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == {t.name for t in spec.tensors}
    assert index["metadata"]["total_size"] == sum(t.size for t in spec.tensors)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2


def test_layout_has_small_tensor_groups_and_header_alignment(model):
    root, spec = model
    small = [t for t in spec.tensors if len(t.shape) == 1]
    assert small and all(t.size == 64 * 2 for t in small)
    runs = [a.name for a, b in zip(spec.tensors, spec.tensors[1:], strict=False)
            if a.file == b.file and len(a.shape) == len(b.shape) == 1]
    assert runs  # consecutive small tensors, as a manifest's piece grouping will meet them
    for shard in spec.shards():
        names = [t.name for t in spec.tensors if t.file == shard]
        assert names == sorted(names)  # the safetensors library's own order
    for shard in spec.shards():
        raw = (root / shard).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0
        assert json.loads(raw[8:8 + n])["__metadata__"] == {"format": "pt"}


def test_deterministic_from_seed(tmp_path):
    a = generate(tmp_path / "a", layers=2, hidden=32, shards=2, seed=3, vocab=64)
    generate(tmp_path / "b", layers=2, hidden=32, shards=2, seed=3, vocab=64)
    c = generate(tmp_path / "c", layers=2, hidden=32, shards=2, seed=4, vocab=64)
    for f in a.files:
        assert (tmp_path / "a" / f.path).read_bytes() == (tmp_path / "b" / f.path).read_bytes()
    assert (tmp_path / "a" / a.shards()[0]).read_bytes() != \
        (tmp_path / "c" / c.shards()[0]).read_bytes()


def test_every_tensor_has_its_own_bytes(model):
    root, spec = model
    digests = {hashlib.sha256(tensor_bytes(root, t)).hexdigest() for t in spec.tensors}
    assert len(digests) == len(spec.tensors)


def test_next_version_changes_only_chosen_tensors(model, tmp_path):
    root, old = model
    new = next_version(root, tmp_path / "v2", change_layers=[2])
    assert set(new.changed) == {t.name for t in old.tensors if t.name.startswith("model.layers.2.")}
    for t_old in old.tensors:
        t_new = new.tensor(t_old.name)
        same = tensor_bytes(root, t_old) == tensor_bytes(tmp_path / "v2", t_new)
        assert same != (t_old.name in new.changed), t_old.name
        assert t_new.shape == t_old.shape and t_new.begin == t_old.begin
    # Shards without a changed tensor are byte-identical copies.
    touched = {new.tensor(n).file for n in new.changed}
    for f in old.files:
        same = (root / f.path).read_bytes() == (tmp_path / "v2" / f.path).read_bytes()
        assert same == (f.path not in touched), f.path
    assert new.changed_bytes == sum(new.tensor(n).size for n in new.changed)
    assert new.delta_bytes == new.changed_bytes + sum(
        f.header_size for f in new.files if f.path in touched)


def test_next_version_versions_differ(model, tmp_path):
    root, _ = model
    name = "model.layers.1.mlp.up_proj.weight"
    v2 = next_version(root, tmp_path / "v2", change_tensors=[name])
    v3 = next_version(tmp_path / "v2", tmp_path / "v3", change_tensors=[name])
    blobs = {tensor_bytes(r, s.tensor(name))
             for r, s in ((root, read_spec(root)), (tmp_path / "v2", v2), (tmp_path / "v3", v3))}
    assert len(blobs) == 3


def test_resize_shifts_offsets_after_it(model, tmp_path):
    root, old = model
    name = "model.layers.1.self_attn.k_proj.weight"
    new = next_version(root, tmp_path / "v2", resize={name: [80, 64]})
    assert new.changed == (name,)
    grown = new.tensor(name).size - old.tensor(name).size
    assert grown == 16 * 64 * 2
    shard = old.tensor(name).file
    with safetensors.safe_open(tmp_path / "v2" / shard, "np") as f:
        assert f.get_tensor(name).shape == (80, 64)
    for t_old in (t for t in old.tensors if t.file == shard):
        t_new = new.tensor(t_old.name)
        old_hdr = next(f.header_size for f in old.files if f.path == shard)
        new_hdr = next(f.header_size for f in new.files if f.path == shard)
        rel_old, rel_new = t_old.begin - old_hdr, t_new.begin - new_hdr
        assert rel_new == rel_old + (grown if t_old.begin > old.tensor(name).begin else 0)
        if t_old.name != name:
            assert tensor_bytes(root, t_old) == tensor_bytes(tmp_path / "v2", t_new)


def test_add_and_drop_file(model, tmp_path):
    root, old = model
    dropped = old.shards()[-1]
    new = next_version(root, tmp_path / "v2", add_file="extra/model-extra.safetensors",
                       drop_file=dropped)
    paths = {f.path for f in new.files}
    assert dropped not in paths and "extra/model-extra.safetensors" in paths
    assert new.added_files == ("extra/model-extra.safetensors",)
    assert new.dropped_files == (dropped,)
    index = json.loads((tmp_path / "v2" / INDEX).read_text())
    assert dropped not in index["weight_map"].values()
    assert "extra.0.weight" in index["weight_map"]
    with safetensors.safe_open(tmp_path / "v2" / "extra/model-extra.safetensors", "np") as f:
        assert f.get_tensor("extra.0.weight").shape == (64, 64)
    plain = next_version(root, tmp_path / "v3", add_file="tokenizer.bin", add_size=1000)
    assert (tmp_path / "v3" / "tokenizer.bin").stat().st_size == 1000
    assert plain.changed == ()


def test_bad_requests_are_refused(model, tmp_path):
    root, _ = model
    with pytest.raises(KeyError, match="no tensor"):
        next_version(root, tmp_path / "x", change_tensors=["nope"])
    with pytest.raises(KeyError, match="layers"):
        next_version(root, tmp_path / "x", change_layers=[99])
    with pytest.raises(FileNotFoundError):
        next_version(root, tmp_path / "x", drop_file="missing.bin")
    with pytest.raises(ValueError, match="dtype"):
        generate(tmp_path / "y", dtype="F8")


def test_generate_sized_and_cli(tmp_path, capsys):
    spec = generate_sized(tmp_path / "s", total_bytes=4 << 20, shards=4)
    assert abs(spec.total_bytes - (4 << 20)) < 0.05 * (4 << 20)
    assert len(spec.shards()) == 4
    assert main([str(tmp_path / "c"), "--size", "1MiB", "--shards", "2"]) == 0
    assert "2 shards" in capsys.readouterr().out


def test_hardlinked_next_version_shares_unchanged_shards(model, tmp_path):
    root, old = model
    new = next_version(root, tmp_path / "v2", change_layers=[0], hardlink=True)
    touched = {new.tensor(n).file for n in new.changed}
    for f in old.shards():
        linked = (root / f).stat().st_ino == (tmp_path / "v2" / f).stat().st_ino
        assert linked == (f not in touched), f
