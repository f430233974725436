"""Manifests built to break the parser (too deep, too big, too many digits) are refused with a
ManifestError, which sends the pull to the next mirror, never with a traceback."""

import json

import pytest

from agent.manifest import ManifestError, parse

SHA = "0" * 64


def doc(size=1, offset=0, **top):
    d = {"format": 1, "model": "m", "version": "v1", "published": "2026-12-02T11:00:00Z",
         "files": [{"path": "a.bin", "size": size, "sha256": SHA,
                    "pieces": [{"offset": offset, "size": size, "sha256": SHA}]}]}
    d.update(top)
    return json.dumps(d).encode()


@pytest.mark.parametrize("data, message", [
    (b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (doc().replace(b'"size": 1,', b'"size": ' + b"9" * 5000 + b",", 1), "too many digits"),
    (doc(size=2**80), r"size is 1208925819614629174706176, more than any file can hold"),
    (doc(size=2**63), r"size is 9223372036854775808, more than any file"),
    (doc(offset=2**64), r"pieces\[0\] offset is 18446744073709551616, more than any file"),
    # shown briefly however deep or long: a message, not a dump (nor a RecursionError)
    (doc(format=json.loads("[" * 900 + "]" * 900)), r"format \[\[\[\[\[\[.*\]\] is not supported"),
    (doc(format="x" * 10**6), r"format 'x{20,30}\.\.\.x+' is not supported"),
])
def test_a_hostile_manifest_is_a_manifest_error(data, message):
    with pytest.raises(ManifestError, match=message) as e:
        parse(data, "http://origin/m/v1/manifest.json")
    assert str(e.value).startswith("http://origin/m/v1/manifest.json: ")
    assert len(str(e.value)) < 400


def test_the_largest_sane_size_is_accepted():
    m = parse(doc(size=2**63 - 1))
    assert m.files[0].size == 2**63 - 1
