import io
import json

import pytest

from agent.cli import main
from agent.commands.pull import split_url
from agent.pull.engine import PullProgress, PullResult
from agent.pull.progress import Reporter, bar_line, summary


def test_split_url():
    assert split_url("http://o:8080/base/llama/v7/") == ("http://o:8080/base", "llama", "v7")
    with pytest.raises(ValueError, match="source"):
        split_url("llama/v7")


def progress(event, done, file=None):
    return PullProgress("m", "v1", event, 2**30, done, done, 0, 50e6, 8, 3, 10, 2.0, file)


def test_bar_on_a_terminal_and_lines_elsewhere():
    out = io.StringIO()
    r = Reporter(out, tty=True)
    r(progress("progress", 2**29))
    r(progress("file", 2**29, "a.safetensors"))
    assert "\r" in out.getvalue() and "50.0%" in out.getvalue() and "ETA" in out.getvalue()
    assert "a.safetensors" not in out.getvalue()
    out = io.StringIO()
    r = Reporter(out, tty=False)
    r(progress("progress", 2**29))
    r(progress("file", 2**29, "a.safetensors"))
    assert out.getvalue().count("\n") == 1 and "a.safetensors verified" in out.getvalue()
    assert "streams 8" in bar_line(progress("progress", 0))


def test_summary():
    from pathlib import Path
    s = summary(PullResult("m", "v1", 10, 20, 30, 2, 1.5, Path("/s/models/m/v1")))
    assert "m/v1: 2 files" in s and "copied locally" in s


def test_cli_usage_errors_exit_2(capsys, tmp_path):
    assert main(["pull", "nonsense", "--store", str(tmp_path)]) == 2
    assert main(["pull", "http://o/m/v1", "--store", str(tmp_path), "--rate", "fast"]) == 2
    assert main(["manifest", "build", str(tmp_path), "--piece-size", "big"]) == 2


def test_cli_pull_failure_exits_1_with_the_reason(capsys, tmp_path):
    rc = main(["pull", "http://127.0.0.1:9/m/v1", "--store", str(tmp_path / "s"), "-q"])
    assert rc == 1
    assert "connection refused" in capsys.readouterr().err


def test_cli_manifest_build(tmp_path, capsys):
    d = tmp_path / "llama" / "v1"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x" * 5000)
    assert main(["manifest", "build", str(d), "--piece-size", "4KiB"]) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert (m["model"], m["version"]) == ("llama", "v1")
    assert [p["size"] for p in m["files"][0]["pieces"]] == [4096, 904]
    assert main(["manifest", "build", str(tmp_path / "missing")]) == 1


def test_the_bar_fits_the_terminal():
    for columns in (40, 60, 80, 200):
        line = bar_line(progress("progress", 2**29), columns)
        assert len(line) < columns, (columns, line)
        assert "50.0%" in line
    assert "[" in bar_line(progress("progress", 2**29), 80)


def test_a_bad_scheme_is_a_usage_error(capsys, tmp_path):
    assert main(["pull", "ftp://origin/m/v1", "--store", str(tmp_path)]) == 2
    assert "ftp:// is not supported" in capsys.readouterr().err


def test_refused_and_unresolved_are_told_apart(capsys, tmp_path):
    assert main(["pull", "http://127.0.0.1:9/m/v1", "--store", str(tmp_path / "s"), "-q"]) == 1
    assert "connection refused" in capsys.readouterr().err
    assert main(["pull", "http://no-such-host.invalid/m/v1", "--store", str(tmp_path / "s"),
                 "-q"]) == 1
    assert "did not resolve" in capsys.readouterr().err


def test_the_bar_counts_bytes_in_flight():
    from dataclasses import replace
    p = replace(progress("progress", 2**29), bytes_in_flight=2**28)
    assert "75.0%" in bar_line(p, 100)
