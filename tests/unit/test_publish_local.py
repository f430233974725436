"""`wagent publish` to a directory an origin serves: the order, atomic files, resume, refusal."""

import pytest

from agent import manifest
from agent.cli import main
from agent.publish.destination import PublishError
from agent.publish.local import LocalDestination
from agent.publish.publish import local_manifest, publish
from tests import modelgen


@pytest.fixture
def version(tmp_path):
    d = tmp_path / "src" / "m" / "v1"
    modelgen.generate(d, layers=2, hidden=64, shards=2)
    return d


def test_publish_builds_copies_then_manifest_then_latest(version, tmp_path, capsys):
    root = tmp_path / "origin"
    root.mkdir()
    assert main(["publish", str(version), str(root)]) == 0
    out = capsys.readouterr()
    assert "m/latest -> v1" in out.out and "uploaded" in out.err
    for f in version.iterdir():
        assert (root / "m" / "v1" / f.name).read_bytes() == f.read_bytes()
        assert (root / "m" / "v1" / f.name).stat().st_mode & 0o777 == 0o644
    assert (root / "m" / "latest").read_text() == "v1\n"
    assert not [p for p in (root / "m" / "v1").iterdir() if p.name.startswith(".")]


def test_a_run_again_sends_only_what_is_missing(version, tmp_path):
    root = tmp_path / "origin"
    root.mkdir()
    m, built = local_manifest(version, lambda: _built(version))
    assert built
    first = publish(version, m, LocalDestination(root), latest=False)
    assert first.bytes_sent == m.size and not (root / "m" / "latest").exists()
    victim = root / "m" / "v1" / m.files[0].path
    victim.unlink()                                   # as if interrupted before it landed
    (root / "m" / "v1" / "manifest.json").unlink()
    again = publish(version, m, LocalDestination(root))
    assert again.bytes_sent == m.files[0].size and not again.already
    assert victim.read_bytes() == (version / m.files[0].path).read_bytes()


def test_a_published_version_with_other_bytes_is_refused(version, tmp_path):
    root = tmp_path / "origin"
    root.mkdir()
    m, _ = local_manifest(version, lambda: _built(version))
    publish(version, m, LocalDestination(root))
    other = tmp_path / "other" / "m" / "v1"
    modelgen.generate(other, layers=2, hidden=64, shards=2, seed=9)
    m2, _ = local_manifest(other, lambda: _built(other))
    with pytest.raises(PublishError, match="already published with other bytes"):
        publish(other, m2, LocalDestination(root))
    assert (root / "m" / "v1" / m.files[0].path).read_bytes() == \
        (version / m.files[0].path).read_bytes()
    same = publish(version, m, LocalDestination(root))       # the same bytes: fine
    assert same.already and same.bytes_sent == 0


def test_files_that_changed_since_the_build_are_never_published(version, tmp_path, capsys):
    m = _built(version)
    path = version / m.files[-1].path
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    root = tmp_path / "origin"
    root.mkdir()
    assert main(["publish", str(version), str(root), "-q"]) == 1
    assert "changed since the build" in capsys.readouterr().err
    published = root / "m" / "v1"
    assert not (published / m.files[-1].path).exists()      # its bytes never landed
    assert not (published / "manifest.json").exists() and not (root / "m" / "latest").exists()
    assert not [p for p in published.iterdir() if p.name.startswith(".")]


def test_usage_errors(version, tmp_path, capsys):
    assert main(["publish", str(version), "http://origin/models"]) == 2
    assert "s3://BUCKET/PREFIX or to a local directory" in capsys.readouterr().err
    assert main(["publish", str(version), str(tmp_path), "--region", "x"]) == 2
    assert main(["publish", str(version), str(tmp_path / "nowhere"), "-q"]) == 1


def _built(d):
    m = manifest.build(d)
    manifest.write(d, m)
    return m
