"""The manifest of a model version: its format, validation, and how a publisher builds one.

A version lives at ``{source}/{model}/{version}/`` beside a ``manifest.json``::

    {"format": 1, "model": "llama", "version": "v7", "published": "2026-12-02T11:00:00Z",
     "files": [{"path": "model-00001.safetensors", "size": 123, "sha256": "...",
                "pieces": [{"offset": 0, "size": 100, "sha256": "..."}, ...]}]}

Every file's pieces tile it exactly (contiguous from offset 0 to its size), so a file whose pieces
all verify is the file the publisher hashed. Paths are checked here, before anything is written:
relative, ``/``-separated, no empty, ``.`` or ``..`` parts, no backslash, NUL or control characters,
UTF-8, names of at most 255 bytes (the file system's limit, found before the download rather than
at publish), nothing at or under ``manifest.json``, and no path that is a directory of another one
(a file ``a`` and a file ``a/b`` would make the store write through a symlink), also when compared
without case (``A`` and ``a/b`` collide on a case-folding file system, or once copied to one).
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from agent import hashing, safetensors_layout
from agent.durable import write_atomic

FORMAT = 1
MANIFEST_NAME = "manifest.json"
DEFAULT_PIECE_SIZE = 64 * 2**20
MAX_MANIFEST_BYTES = 64 * 2**20
_MANIFEST_TMP = f".{MANIFEST_NAME}.tmp"   # left by a crashed write (durable.write_atomic)
MAX_NAME_BYTES = 255                  # NAME_MAX of Linux file systems
MAX_PATH_BYTES = 1024                 # well inside PATH_MAX (4096) once under a store
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}$")
# Names a model's directory gives its own entries, never a version's (all the others a store
# makes there start with '.', which no name may): what each one is, for the refusal's message.
RESERVED_VERSIONS = {"current": "the pointer to the version a node serves",
                     "latest": "the name of the newest version, on an origin or a cache node"}
_RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
MAX_COUNT = 2**63                     # sizes and offsets stay below (off_t)
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60


class ManifestError(ValueError):
    """A manifest that can't be used; the message names the manifest, the entry and the fix."""


@dataclass(frozen=True)
class Piece:
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Manifest:
    model: str
    version: str
    published: str
    files: tuple[FileEntry, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def check_name(kind: str, name: object) -> str:
    """A model or version name: one path component, usable in a URL and as a directory name.

    A version may not take a name the store gives its own entries in a model's directory
    (``RESERVED_VERSIONS``; names starting with '.' are refused for every kind): a version
    called ``current`` would be published where the current pointer goes, and hidden from
    ``store ls``, ``verify`` and eviction, which would then delete its blobs.

    >>> check_name("version", "v7")
    'v7'
    >>> check_name("version", "current")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ManifestError: version name 'current' is reserved: the store uses it ...
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ManifestError(
            f"{kind} name {name!r} is not usable: use letters, digits and . _ + - (at most 200, "
            "not starting with '.' or '-', no '/')")
    if kind == "version" and name in RESERVED_VERSIONS:
        raise ManifestError(
            f"version name {name!r} is reserved: the store uses it beside the versions "
            f"({RESERVED_VERSIONS[name]}); publish the version under another name")
    return name


def check_path(path: object) -> str:
    """A file path in a version: relative, '/'-separated, never leaving the version directory."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"file path {path!r} must be a non-empty string")
    if path.startswith("/"):
        raise ManifestError(f"file path {path!r} is absolute; paths are relative to the version")
    if "\\" in path or any(ord(c) < 0x20 or c == "\x7f" for c in path):
        raise ManifestError(f"file path {path!r} holds a backslash or a control character")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise ManifestError(f"file path {path!r} is not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise ManifestError(f"file path {path[:60]!r}... is {size} bytes long; at most "
                            f"{MAX_PATH_BYTES}")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ManifestError(
                f"file path {path!r} has an empty, '.' or '..' part; it must stay inside the "
                "version directory")
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise ManifestError(f"file path {path[:60]!r}... has a name longer than "
                                f"{MAX_NAME_BYTES} bytes, which no file system stores")
    if parts[0] == MANIFEST_NAME:
        raise ManifestError(f"file path {path!r}: {MANIFEST_NAME!r} is reserved for the manifest "
                            "itself")
    return path


def parse(data: bytes, where: str = "manifest.json") -> Manifest:
    """Load and validate a manifest; ``where`` (a URL or file) goes into every error message."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(data)} bytes, more than a manifest may have "
                            f"({MAX_MANIFEST_BYTES})")
    doc = _load_json(data, where)
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: the top level must be a JSON object")
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise ManifestError(f"{where}: format {_show(fmt)} is not supported (this wagent reads "
                            f"format {FORMAT})")
    try:
        model = check_name("model", doc.get("model"))
        version = check_name("version", doc.get("version"))
        published = doc.get("published")
        if not isinstance(published, str) or not _RFC3339_UTC.match(published):
            raise ManifestError(f"published {published!r} must be an RFC 3339 UTC time such as "
                                "2026-12-02T11:00:00Z")
        files = doc.get("files")
        if not isinstance(files, list):
            raise ManifestError("'files' must be a list")
        entries = tuple(_file_entry(i, f) for i, f in enumerate(files))
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}") from None
    except (RecursionError, ValueError) as e:
        # A value too deep or too long to show or compare: still the manifest's fault.
        raise ManifestError(f"{where}: a value can't be read ({type(e).__name__}); rebuild it "
                            "with 'wagent manifest build DIR'") from None
    _check_tree(entries, where)
    return Manifest(model, version, published, entries)


def _load_json(data: bytes, where: str) -> object:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e}); is it truncated? Rebuild it with "
                            "'wagent manifest build DIR'") from None
    except RecursionError:
        raise ManifestError(f"{where}: JSON nested too deeply to be a manifest") from None
    except ValueError:
        # Python's limit on the digits of an integer (4300): no size or offset has that many.
        raise ManifestError(f"{where}: holds a number with too many digits to be a size or "
                            "an offset") from None


def _file_entry(index: int, f: object) -> FileEntry:
    if not isinstance(f, dict):
        raise ManifestError(f"files[{index}] must be an object, got {_show(f)}")
    path = check_path(f.get("path"))
    what = f"files[{index}] ({path})"
    size = _count(f.get("size"), f"{what} size")
    sha = _sha(f.get("sha256"), f"{what} sha256")
    raw_pieces = f.get("pieces")
    if not isinstance(raw_pieces, list):
        raise ManifestError(f"{what}: 'pieces' must be a list")
    pieces: list[Piece] = []
    end = 0
    for j, p in enumerate(raw_pieces):
        if not isinstance(p, dict):
            raise ManifestError(f"{what} pieces[{j}] must be an object")
        offset = _count(p.get("offset"), f"{what} pieces[{j}] offset")
        psize = _count(p.get("size"), f"{what} pieces[{j}] size")
        if psize == 0 or offset != end:
            raise ManifestError(f"{what} pieces[{j}] at {offset} (+{psize}): pieces must be "
                                f"non-empty and follow each other from offset 0 (expected {end})")
        pieces.append(Piece(offset, psize, _sha(p.get("sha256"), f"{what} pieces[{j}] sha256")))
        end += psize
    if end != size:
        raise ManifestError(f"{what}: pieces cover {end} bytes, the file has {size}")
    return FileEntry(path, size, sha, tuple(pieces))


def _fold(path: str) -> str:
    return unicodedata.normalize("NFC", path).casefold()


def _check_tree(entries: Sequence[FileEntry], where: str) -> None:
    check_paths([e.path for e in entries], where)
    sizes: dict[str, int] = {}
    for e in entries:
        if sizes.setdefault(e.sha256, e.size) != e.size:
            raise ManifestError(f"{where}: {e.path!r} has the sha256 of another file but not "
                                "its size; rebuild the manifest")


def _fold(path: str) -> str:
    return unicodedata.normalize("NFC", path).casefold()


def check_paths(paths: Iterable[str], where: str) -> None:
    """The paths of one version together: no duplicate, no file that is also a directory of
    another, also compared without case and Unicode form."""
    folded: dict[str, str] = {}
    for path in paths:
        key = _fold(path)
        other = folded.get(key)
        if other is not None:
            if other == path:
                raise ManifestError(f"{where}: file path {path!r} appears twice")
            raise ManifestError(f"{where}: file paths {other!r} and {path!r} differ only in "
                                "case or Unicode form; a case-folding file system would see one")
        folded[key] = path
    for key, path in folded.items():
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = folded.get("/".join(parts[:i]))
            if prefix is not None:
                raise ManifestError(f"{where}: {prefix!r} is a file and also a directory of "
                                    f"{path!r}")


def _count(v: object, what: str) -> int:
    """A size or an offset: also below 2**63, where off_t ends (and every file system long
    before it), so that no later arithmetic or system call overflows."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ManifestError(f"{what} must be a whole number >= 0, got {_show(v)}")
    if v >= MAX_COUNT:
        raise ManifestError(f"{what} is {_show(v)}, more than any file can hold (at most "
                            f"2**63 - 1)")
    return v


def _show(v: object) -> str:
    """``v`` for a message: short, whatever its depth or length."""
    return _SHORT.repr(v)


def _sha(v: object, what: str) -> str:
    if not isinstance(v, str) or not _SHA256.match(v):
        raise ManifestError(f"{what} must be 64 lowercase hex digits, got {v!r}")
    return v


def to_json(m: Manifest) -> bytes:
    doc = {
        "format": FORMAT, "model": m.model, "version": m.version, "published": m.published,
        "files": [
            {"path": f.path, "size": f.size, "sha256": f.sha256,
             "pieces": [{"offset": p.offset, "size": p.size, "sha256": p.sha256}
                        for p in f.pieces]}
            for f in m.files],
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def published_ts(published: str) -> float:
    return datetime.fromisoformat(published.replace("Z", "+00:00")).timestamp()


def parse_published(text: str) -> float:
    """A publication time as a publisher writes it (RFC 3339 UTC), as a timestamp."""
    try:
        if _RFC3339_UTC.match(text):
            return published_ts(text)
    except ValueError:
        pass
    raise ManifestError(f"{text!r} is not an RFC 3339 UTC time such as 2026-12-02T11:00:00Z")


def piece_bounds(path: Path, size: int, piece_size: int) -> list[tuple[int, int]]:
    """(offset, size) of each piece: tensor-aligned for .safetensors, fixed for anything else."""
    if path.name.endswith(".safetensors"):
        with open(path, "rb") as f:
            return safetensors_layout.pieces(f, size, piece_size, where=str(path))
    return safetensors_layout.fixed_pieces(size, piece_size)


def build(directory: Path, model: str | None = None, version: str | None = None, *,
          piece_size: int = DEFAULT_PIECE_SIZE, jobs: int | None = None,
          clock: Callable[[], float] | None = None) -> Manifest:
    """Hash every regular file under ``directory`` (but the manifest) into a Manifest.

    Model and version default to the names of the directory's parent and of the directory, as in
    the origin layout ``{model}/{version}/``.
    """
    directory = directory.resolve()
    model = check_name("model", model or directory.parent.name)
    version = check_name("version", version or directory.name)
    rel_paths = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            full = Path(root, name)
            rel = full.relative_to(directory).as_posix()
            if rel == MANIFEST_NAME or rel.startswith(_MANIFEST_TMP) or not full.is_file():
                continue
            rel_paths.append(check_path(rel))
    check_paths(rel_paths, str(directory))      # what every node would refuse, refused here
    plans = []
    for rel in rel_paths:
        full = directory / rel
        size = full.stat().st_size
        plans.append((full, piece_bounds(full, size, piece_size)))
    hashed = hashing.hash_files(plans, jobs=jobs)
    files = tuple(
        FileEntry(rel, sum(s for _, s in bounds), file_sha,
                  tuple(Piece(o, s, h) for (o, s), h in zip(bounds, piece_shas, strict=True)))
        for rel, (_, bounds), (file_sha, piece_shas) in zip(rel_paths, plans, hashed, strict=True))
    now = (clock or time.time)()
    return Manifest(model, version, rfc3339(now), files)


def write(directory: Path, m: Manifest) -> Path:
    """Write ``manifest.json`` atomically (a reader never sees half a manifest)."""
    target = directory / MANIFEST_NAME
    write_atomic(target, to_json(m))
    return target
