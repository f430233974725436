"""`wagent manifest build`: the publisher's options, through the real CLI."""

import json
import subprocess
import sys


def build(*args):
    return subprocess.run([sys.executable, "-m", "agent", "manifest", "build", *args],
                          capture_output=True, text=True, timeout=60)


def test_an_empty_directory_is_refused(tmp_path):
    d = tmp_path / "m" / "v1"
    d.mkdir(parents=True)
    r = build(str(d))
    assert r.returncode == 1 and "no file to publish" in r.stderr
    assert not (d / "manifest.json").exists()


def test_published_sets_when_the_stagger_clock_starts(tmp_path):
    d = tmp_path / "m" / "v1"
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 100)
    assert build(str(d), "--published", "2026-01-02T03:04:05Z", "-q").returncode == 0
    assert json.loads((d / "manifest.json").read_bytes())["published"] == "2026-01-02T03:04:05Z"
    r = build(str(d), "--published", "tomorrow")
    assert r.returncode == 2 and "RFC 3339" in r.stderr
