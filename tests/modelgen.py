"""Fake but real model weights: `.safetensors` shards laid out like a Hugging Face llama model.

Written with the standard library only (Debian's python3 runs the integration tests), fast enough
for a few GiB, deterministic from a seed:

```python
spec = generate(d1, layers=4, hidden=64, shards=2, seed=1)
new = next_version(d1, d2, change_layers=[3], resize={"model.norm.weight": [80]})
new.changed, new.changed_bytes, new.delta_bytes   # what a tensor-aware pull should fetch
```

File format (https://huggingface.co/docs/safetensors): 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets relative to the data that follows
the header), then the data. Tensor bytes are a 1 MiB random block (from the seed) XORed with a
32-byte key repeated, one key per MiB of each tensor from sha256(seed, name, version salt, chunk):
every chunk of every tensor of every version differs, and nothing repeats that rsync or a
compressor could exploit.

CLI: ``python -m tests.modelgen DIR --size 1GiB --shards 16``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

DTYPE_SIZE = {"F16": 2, "BF16": 2, "F32": 4}
TORCH_DTYPE = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
CHUNK = 1 << 20
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: where it lives (absolute byte offsets in its file) and whether it changed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int  # absolute offset in the file
    end: int
    changed: bool = False

    @property
    def size(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileSpec:
    path: str  # relative to the model directory
    size: int
    header_size: int = 0  # 8 + JSON header length, for .safetensors files
    rewritten: bool = False  # bytes differ from the previous version (or new)


@dataclass(frozen=True)
class ModelSpec:
    """What a generated version holds and, for a next version, what changed against the source."""

    root: Path
    files: tuple[FileSpec, ...]
    tensors: tuple[TensorSpec, ...]
    added_files: tuple[str, ...] = ()
    dropped_files: tuple[str, ...] = ()
    config: Mapping[str, object] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors if t.changed)

    @property
    def changed_bytes(self) -> int:
        """Bytes of the changed (or resized, or added) tensors."""
        return sum(t.size for t in self.tensors if t.changed)

    @property
    def delta_bytes(self) -> int:
        """What a tensor-aware pull must fetch: changed tensors, the headers of rewritten shards,
        whole added or rewritten non-safetensors files."""
        total = self.changed_bytes
        for f in self.files:
            if f.rewritten:
                total += f.header_size if f.path.endswith(".safetensors") else f.size
        return total

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor {name!r} in {self.root}")

    def shards(self) -> list[str]:
        return [f.path for f in self.files if f.path.endswith(".safetensors")]


# --- tensor bytes ----------------------------------------------------------------------------
_BASE: dict[int, bytes] = {}


def _base_block(seed: int) -> bytes:
    if seed not in _BASE:
        _BASE[seed] = random.Random(seed).randbytes(CHUNK)
    return _BASE[seed]


def tensor_bytes(seed: int, name: str, salt: str, size: int) -> Iterator[bytes]:
    """The deterministic content of a tensor, in chunks of up to 1 MiB."""
    base = _base_block(seed)
    for j, start in enumerate(range(0, size, CHUNK)):
        n = min(CHUNK, size - start)
        key = hashlib.sha256(f"{seed}\0{name}\0{salt}\0{j}".encode()).digest()
        # One big-int XOR per chunk: C speed, no numpy needed.
        mixed = int.from_bytes(base[:n], "little") ^ int.from_bytes(
            (key * (n // 32 + 1))[:n], "little")
        yield mixed.to_bytes(n, "little")


# --- layout ----------------------------------------------------------------------------------
def llama_tensors(layers: int, hidden: int, intermediate: int, vocab: int,
                  bias: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in Hugging Face llama order; norms and q/k/v biases are the small ones."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (hidden,)))
        for proj in ("q", "k", "v"):
            out.append((p + f"self_attn.{proj}_proj.weight", (hidden, hidden)))
            if bias:
                out.append((p + f"self_attn.{proj}_proj.bias", (hidden,)))
        out.append((p + "self_attn.o_proj.weight", (hidden, hidden)))
        out.append((p + "post_attention_layernorm.weight", (hidden,)))
        out.append((p + "mlp.gate_proj.weight", (intermediate, hidden)))
        out.append((p + "mlp.up_proj.weight", (intermediate, hidden)))
        out.append((p + "mlp.down_proj.weight", (hidden, intermediate)))
    out.append(("model.norm.weight", (hidden,)))
    out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _nbytes(shape: Iterable[int], dtype: str) -> int:
    return math.prod(shape) * DTYPE_SIZE[dtype]


def _split(tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str,
           shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of about equal bytes, at most `shards` of them, none empty."""
    total = sum(_nbytes(s, dtype) for _, s in tensors)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    done = 0
    for i, (name, shape) in enumerate(tensors):
        left = len(tensors) - i
        if (groups[-1] and len(groups) < shards
                and (done >= total * len(groups) / shards or left <= shards - len(groups))):
            groups.append([])
        groups[-1].append((name, shape))
        done += _nbytes(shape, dtype)
    return groups


def shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# --- writing ---------------------------------------------------------------------------------
def _header(entries: Sequence[tuple[str, str, tuple[int, ...], int]],
            metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix plus JSON header, padded with spaces to a multiple of 8 bytes."""
    head: dict[str, object] = {}
    if metadata:
        head["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, size in entries:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: Sequence[tuple[str, str, tuple[int, ...],
                                                          Iterable[bytes] | int]],
                      seed: int = 0, salt: str = "",
                      metadata: Mapping[str, str] | None = None) -> list[TensorSpec]:
    """Write one file. A tensor's data is an iterable of byte chunks, or an int: that many bytes
    generated from (seed, name, salt)."""
    entries = [(n, d, s, _nbytes(s, d)) for n, d, s, _ in tensors]
    header = _header(entries, metadata if metadata is not None else {"format": "pt"})
    specs = []
    with open(path, "wb") as f:
        f.write(header)
        pos = len(header)
        for (name, dtype, shape, data), (_, _, _, size) in zip(tensors, entries, strict=True):
            chunks = tensor_bytes(seed, name, salt, size) if isinstance(data, int) else data
            written = 0
            for chunk in chunks:
                f.write(chunk)
                written += len(chunk)
            if written != size:
                raise ValueError(f"{path}: tensor {name} got {written} bytes, shape wants {size}")
            specs.append(TensorSpec(name, dtype, tuple(shape), path.name, pos, pos + size))
            pos += size
    return specs


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_index(root: Path, tensors: Sequence[TensorSpec]) -> None:
    _write_json(root / INDEX, {"metadata": {"total_size": sum(t.size for t in tensors)},
                               "weight_map": {t.name: t.file for t in tensors}})


def generate(root: str | Path, layers: int = 16, hidden: int = 256, shards: int = 4,
             seed: int = 0, dtype: str = "F16", intermediate: int | None = None,
             vocab: int = 1024, bias: bool = True, order: str = "sorted") -> ModelSpec:
    """Write a model (shards, index when sharded, config.json) into `root`; return its spec.

    Shards take consecutive layers. Inside a shard tensors are sorted by name, as the
    safetensors library writes them (order="model" keeps the model's order instead); either way
    small tensors (norms, biases) sit next to each other in places, as in real checkpoints.
    """
    if order not in ("sorted", "model"):
        raise ValueError(f"order {order!r}: use 'sorted' or 'model'")
    if dtype not in DTYPE_SIZE:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_SIZE)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    intermediate = intermediate or 4 * hidden
    names = llama_tensors(layers, hidden, intermediate, vocab, bias)
    groups = _split(names, dtype, max(1, shards))
    specs: list[TensorSpec] = []
    for i, group in enumerate(groups):
        path = root / shard_name(i, len(groups))
        if order == "sorted":
            group = sorted(group)
        specs += write_safetensors(path, [(n, dtype, s, 0) for n, s in group], seed=seed,
                                   salt="")
    if len(groups) > 1:
        _write_index(root, specs)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64), "vocab_size": vocab,
        "torch_dtype": TORCH_DTYPE[dtype], "wagent_modelgen": {"seed": seed},
    }
    _write_json(root / "config.json", config)
    return read_spec(root)


def generate_sized(root: str | Path, total_bytes: int, shards: int = 16, seed: int = 0,
                   dtype: str = "F16", layers: int | None = None) -> ModelSpec:
    """A model of about `total_bytes` (within a few percent): sizes hidden, then vocab, to fit."""
    ds = DTYPE_SIZE[dtype]
    layers = layers or max(2, min(32, shards * 2))
    # A layer holds 4 h^2 (attention) + 12 h^2 (mlp, intermediate = 4h) elements; 90% go there.
    hidden = max(64, int(math.sqrt(total_bytes * 0.9 / (layers * 16 * ds))) // 64 * 64)
    layer_bytes = layers * (16 * hidden * hidden + 6 * hidden) * ds
    vocab = max(16, (total_bytes - layer_bytes) // (2 * hidden * ds))
    return generate(root, layers=layers, hidden=hidden, shards=shards, seed=seed, dtype=dtype,
                    vocab=vocab)


# --- reading ---------------------------------------------------------------------------------
def read_header(path: Path, with_metadata: bool = False) -> tuple[int, dict[str, dict]]:
    """(8 + header length, the JSON header) of one .safetensors file; `__metadata__` is left
    out unless asked for."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    if not with_metadata:
        head.pop("__metadata__", None)
    return 8 + n, head


def read_spec(root: str | Path) -> ModelSpec:
    """The spec of a model directory as it is on disk (nothing marked changed)."""
    root = Path(root)
    files: list[FileSpec] = []
    tensors: list[TensorSpec] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        header_size = 0
        if path.suffix == ".safetensors":
            header_size, head = read_header(path)
            for name, info in sorted(head.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                b, e = info["data_offsets"]
                tensors.append(TensorSpec(name, info["dtype"], tuple(info["shape"]), rel,
                                          header_size + b, header_size + e))
        files.append(FileSpec(rel, path.stat().st_size, header_size))
    config = {}
    if (root / "config.json").exists():
        config = json.loads((root / "config.json").read_text())
    return ModelSpec(root, tuple(files), tuple(tensors), config=config)


def _read_range(path: Path, begin: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(begin)
        left = end - begin
        while left:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                raise ValueError(f"{path} ends before byte {end}")
            left -= len(chunk)
            yield chunk


def _salt_from(src: Path, old: ModelSpec, names: set[str]) -> str:
    """By default new bytes derive from the old bytes of what changes: v2 -> v3 differs from
    v1 -> v2, and the same source gives the same next version."""
    h = hashlib.sha256()
    for t in old.tensors:
        if t.name in names:
            for chunk in _read_range(src / t.file, t.begin, t.end):
                h.update(chunk)
    return h.hexdigest()[:16]


# --- next version ----------------------------------------------------------------------------
def next_version(src: str | Path, dst: str | Path, change_layers: Iterable[int] = (),
                 change_tensors: Iterable[str] = (),
                 resize: Mapping[str, Sequence[int]] | None = None,
                 add_file: str | None = None, add_size: int = 1 << 20,
                 drop_file: str | None = None, seed: int | None = None,
                 hardlink: bool = False) -> ModelSpec:
    """Write `dst` as the next version of the model in `src`.

    The tensors of `change_layers`, those named in `change_tensors`, and the resized ones get new
    bytes (salted with `seed`, by default with a digest of their old bytes). A shard holding none
    of them is copied byte for byte (hard-linked with hardlink=True); one holding some is rewritten
    with only those tensors' bytes new, later offsets shifting when a size changes. `add_file`
    adds a file: a `.safetensors` path gets a small shard of new tensors (and joins the index),
    anything else `add_size` pseudo-random bytes. `drop_file` leaves a file out (and its tensors
    out of the index).
    """
    src, dst = Path(src), Path(dst)
    old = read_spec(src)
    base_seed = int(dict(old.config.get("wagent_modelgen", {}) or {}).get("seed", 0))
    resize = {k: tuple(v) for k, v in (resize or {}).items()}
    known = {t.name for t in old.tensors}
    wanted = set(change_tensors) | set(resize)
    for name in sorted(wanted - known):
        raise KeyError(f"{src}: no tensor {name!r} to change or resize")
    prefixes = tuple(f"model.layers.{i}." for i in change_layers)
    to_change = {n for n in known if n.startswith(prefixes)} | wanted if prefixes else wanted
    if prefixes and not any(n.startswith(prefixes) for n in known):
        raise KeyError(f"{src}: no tensors for layers {list(change_layers)}")
    if drop_file and not (src / drop_file).is_file():
        raise FileNotFoundError(f"{src}: no file {drop_file!r} to drop")
    salt = f"v{seed}" if seed is not None else _salt_from(src, old, to_change)

    dst.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[TensorSpec]] = {}
    for t in old.tensors:
        by_file.setdefault(t.file, []).append(t)
    new_tensors: list[TensorSpec] = []
    rewritten: set[str] = set()
    for f in old.files:
        if f.path == drop_file or f.path == INDEX:
            continue
        out = dst / f.path
        out.parent.mkdir(parents=True, exist_ok=True)
        tensors = by_file.get(f.path, [])
        if not any(t.name in to_change for t in tensors):
            if hardlink:
                out.unlink(missing_ok=True)
                out.hardlink_to(src / f.path)
            else:
                shutil.copyfile(src / f.path, out)
            new_tensors += tensors
            continue
        rewritten.add(f.path)
        items: list[tuple[str, str, tuple[int, ...], Iterable[bytes] | int]] = []
        for t in tensors:
            if t.name in to_change:
                items.append((t.name, t.dtype, resize.get(t.name, t.shape), 0))
            else:
                items.append((t.name, t.dtype, t.shape, _read_range(src / f.path, t.begin, t.end)))
        metadata = read_header(src / f.path, with_metadata=True)[1].get("__metadata__", {})
        written = write_safetensors(out, items, seed=base_seed, salt=salt, metadata=metadata)
        new_tensors += [replace(w, file=f.path, changed=w.name in to_change) for w in written]
    added: list[str] = []
    if add_file:
        path = dst / add_file
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            hidden = int(old.config.get("hidden_size", 64))  # type: ignore[arg-type]
            dtype = old.tensors[0].dtype if old.tensors else "F16"
            items = [(f"extra.{i}.weight", dtype, (hidden, hidden), 0) for i in range(2)]
            written = write_safetensors(path, items, seed=base_seed, salt=salt)
            new_tensors += [replace(w, file=add_file, changed=True) for w in written]
        else:
            with open(path, "wb") as fh:
                for chunk in tensor_bytes(base_seed, add_file, salt, add_size):
                    fh.write(chunk)
        added.append(add_file)
        rewritten.add(add_file)
    if (src / INDEX).exists():
        _write_index(dst, new_tensors)
        if (dst / INDEX).read_bytes() != (src / INDEX).read_bytes():
            rewritten.add(INDEX)
    spec = read_spec(dst)
    changed = {t.name for t in new_tensors if t.changed}
    return replace(
        spec,
        files=tuple(replace(f, rewritten=f.path in rewritten) for f in spec.files),
        tensors=tuple(replace(t, changed=t.name in changed) for t in spec.tensors),
        added_files=tuple(added), dropped_files=(drop_file,) if drop_file else ())


# --- CLI -------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.modelgen",
                                     description="Write a fake safetensors model for tests.")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--size", help="about this many bytes in total, e.g. 1GiB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPE_SIZE), default="F16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from", dest="src", type=Path,
                        help="write DIR as the next version of this model")
    parser.add_argument("--change-layers", default="", help="with --from: e.g. 3,7")
    args = parser.parse_args(argv)
    if args.src:
        layers = [int(x) for x in args.change_layers.split(",") if x.strip()]
        spec = next_version(args.src, args.dir, change_layers=layers)
        print(f"{args.dir}: {len(spec.changed)} tensors changed, "
              f"{spec.delta_bytes} bytes to fetch of {spec.total_bytes}")
        return 0
    if args.size:
        from agent.units import parse_size
        spec = generate_sized(args.dir, parse_size(args.size), shards=args.shards,
                              seed=args.seed, dtype=args.dtype)
    else:
        spec = generate(args.dir, layers=args.layers, hidden=args.hidden, shards=args.shards,
                        seed=args.seed, dtype=args.dtype)
    print(f"{args.dir}: {len(spec.shards())} shards, {len(spec.tensors)} tensors, "
          f"{spec.total_bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
