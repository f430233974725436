import json
import struct

import pytest

from agent import manifest
from agent.manifest import ManifestError, check_path, parse

SHA = "a" * 64


def doc(**over):
    d = {"format": 1, "model": "m", "version": "v1", "published": "2026-12-02T11:00:00Z",
         "files": [{"path": "a/b.bin", "size": 10, "sha256": SHA,
                    "pieces": [{"offset": 0, "size": 4, "sha256": SHA},
                               {"offset": 4, "size": 6, "sha256": SHA}]}]}
    d.update(over)
    return json.dumps(d).encode()


def test_round_trip():
    m = parse(doc())
    assert m.files[0].pieces[1].offset == 4
    assert parse(manifest.to_json(m)) == m


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.",
                                  "a\\b", "a\x00b", "a\nb", "", "manifest.json"])
def test_bad_paths_refused(path):
    with pytest.raises(ManifestError):
        check_path(path)


@pytest.mark.parametrize("path", ["a", "a/b.safetensors", "dir/sub/x.json", "..a", "a..b"])
def test_good_paths(path):
    assert check_path(path) == path


def test_traversal_in_manifest_names_the_entry():
    bad = json.loads(doc())
    bad["files"][0]["path"] = "../../etc/cron.d/x"
    with pytest.raises(ManifestError, match=r"files\[0\].*'\.\.'|'\.\.' part"):
        parse(json.dumps(bad).encode(), "http://o/m/v1/manifest.json")


def test_file_and_directory_of_another_refused():
    d = json.loads(doc())
    d["files"].append(dict(d["files"][0], path="a"))
    with pytest.raises(ManifestError, match="is a file and also a directory"):
        parse(json.dumps(d).encode())


def test_duplicate_path_refused():
    d = json.loads(doc())
    d["files"].append(d["files"][0])
    with pytest.raises(ManifestError, match="appears twice"):
        parse(json.dumps(d).encode())


def test_same_hash_needs_same_size():
    d = json.loads(doc())
    d["files"].append({"path": "other", "size": 1, "sha256": SHA,
                       "pieces": [{"offset": 0, "size": 1, "sha256": SHA}]})
    with pytest.raises(ManifestError, match="not its size"):
        parse(json.dumps(d).encode())


def test_truncated_and_malformed():
    raw = doc()
    with pytest.raises(ManifestError, match="not valid JSON.*truncated"):
        parse(raw[: len(raw) // 2], "x/manifest.json")
    with pytest.raises(ManifestError, match="top level"):
        parse(b"[]")
    with pytest.raises(ManifestError, match="format 2 is not supported"):
        parse(doc(format=2))
    with pytest.raises(ManifestError, match="published"):
        parse(doc(published="yesterday"))
    with pytest.raises(ManifestError, match="model name"):
        parse(doc(model="a/b"))
    with pytest.raises(ManifestError, match="'files' must be a list"):
        parse(doc(files={}))


@pytest.mark.parametrize("pieces,msg", [
    ([{"offset": 0, "size": 4, "sha256": SHA}], "cover 4 bytes"),
    ([{"offset": 0, "size": 4, "sha256": SHA}, {"offset": 5, "size": 5, "sha256": SHA}],
     "follow each other"),
    ([{"offset": 0, "size": 10, "sha256": "xyz"}], "64 lowercase hex"),
    ([{"offset": 0, "size": -1, "sha256": SHA}], "whole number"),
    ([{"offset": 0, "size": True, "sha256": SHA}], "whole number"),
])
def test_pieces_must_tile_the_file(pieces, msg):
    d = json.loads(doc())
    d["files"][0]["pieces"] = pieces
    with pytest.raises(ManifestError, match=msg):
        parse(json.dumps(d).encode())


def _safetensors(path, tensors):
    header, blob, off = {}, b"", 0
    for name, data in tensors:
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        blob += data
        off += len(data)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + blob)


def test_build_hashes_pieces_and_files(tmp_path):
    d = tmp_path / "llama" / "v3"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub").mkdir()
    (d / "sub" / "big.bin").write_bytes(bytes(range(256)) * 40)          # 10240 bytes
    _safetensors(d / "model.safetensors", [("model.layers.0.w", b"x" * 3000),
                                           ("model.layers.1.w", b"y" * 50)])
    m = manifest.build(d, piece_size=4096, jobs=2, clock=lambda: 0.0)
    assert (m.model, m.version, m.published) == ("llama", "v3", "1970-01-01T00:00:00Z")
    by = {f.path: f for f in m.files}
    assert sorted(by) == ["config.json", "model.safetensors", "sub/big.bin"]
    import hashlib
    big = (d / "sub" / "big.bin").read_bytes()
    assert by["sub/big.bin"].sha256 == hashlib.sha256(big).hexdigest()
    assert [p.size for p in by["sub/big.bin"].pieces] == [4096, 4096, 2048]
    assert by["sub/big.bin"].pieces[1].sha256 == hashlib.sha256(big[4096:8192]).hexdigest()
    assert len(by["model.safetensors"].pieces) == 3           # header, layer 0, layer 1
    manifest.write(d, m)
    assert parse((d / "manifest.json").read_bytes()) == m
    # The manifest itself is never listed when rebuilt.
    assert "manifest.json" not in {f.path for f in manifest.build(d).files}


@pytest.mark.parametrize("path", ["manifest.json/x", "a/" + "n" * 256, "x/" * 600 + "y",
                                  "a\udc80b", "\ud800"])
def test_paths_that_would_fail_only_at_publish_are_refused_up_front(path):
    with pytest.raises(ManifestError):
        check_path(path)


def test_long_but_legal_names_pass():
    assert check_path("a/" + "n" * 255) == "a/" + "n" * 255


@pytest.mark.parametrize("a,b", [("A", "a/b"), ("Model.bin", "model.BIN"),
                                 ("caf\u00e9", "cafe\u0301"), ("a", "a")])
def test_paths_that_collide_on_a_case_folding_file_system_are_refused(a, b):
    d = json.loads(doc())
    f = d["files"][0]
    d["files"] = [dict(f, path=a), dict(f, path=b)]
    with pytest.raises(ManifestError, match="differ only in case|appears twice|directory of"):
        parse(json.dumps(d).encode())


def test_a_temporary_manifest_left_by_a_crash_is_not_a_file_of_the_version(tmp_path):
    d = tmp_path / "m" / "v1"
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a")
    (d / ".manifest.json.tmp").write_text("{half")
    assert [f.path for f in manifest.build(d).files] == ["a.bin"]


def test_build_refuses_what_every_node_would_refuse(tmp_path):
    d = tmp_path / "m" / "v1"
    d.mkdir(parents=True)
    (d / "README").write_text("a")
    (d / "readme").write_text("b")
    with pytest.raises(ManifestError, match="differ only in case"):
        manifest.build(d)


@pytest.mark.parametrize("name", ["current", "latest", ".hidden", ".tmp-v1"])
def test_names_the_store_uses_itself_are_no_version(name, tmp_path):
    """Issue 21: a version called `current` was published where the current pointer goes, then
    hidden from ls, verify and gc (which deleted its blobs). Refused wherever a name enters:
    the check, a manifest, a build (from the directory's name or given)."""
    with pytest.raises(ManifestError, match="reserved|not usable"):
        manifest.check_name("version", name)
    with pytest.raises(ManifestError, match="reserved|not usable"):
        parse(doc(version=name))
    d = tmp_path / "m" / name
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a")
    with pytest.raises(ManifestError, match="reserved|not usable"):
        manifest.build(d)
    with pytest.raises(ManifestError, match="reserved|not usable"):
        manifest.build(tmp_path / "m" / name, version=name)


def test_a_reserved_name_says_what_the_store_uses_it_for():
    with pytest.raises(ManifestError, match="'current' is reserved.*current pointer|pointer"):
        manifest.check_name("version", "current")
    # Only versions: a model may be called so (models/current/ is no pointer), and names that
    # merely contain the word are versions like any other.
    assert manifest.check_name("model", "current") == "current"
    for ok in ("current-2", "latest.v7", "v-latest"):
        assert manifest.check_name("version", ok) == ok


def test_a_policy_may_not_follow_or_pin_a_reserved_name(tmp_path):
    """The daemon's own way in: a policy naming `current` (or pinning `latest`) is refused at
    load, with its line, rather than pulled into the pointer's place; `latest` still follows."""
    from agent.policy import check_policy

    p = tmp_path / "p.yaml"
    p.write_text("version: 1\nsources:\n  - url: http://origin:8080\nmodels:\n"
                 "  - name: a\n    version: current\n"
                 "  - name: b\n    version: latest\n    pin: [latest, .x, v1]\n")
    issues = [(i.line, i.message) for i in check_policy(p)]
    assert [line for line, _ in issues] == [6, 9, 9], issues
    assert "'current' is reserved" in issues[0][1] and "'latest' is reserved" in issues[1][1]
    assert "not usable" in issues[2][1]
