"""`wagent policy check` and `wagent policy show` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

from agent.cli import main

POLICIES = Path(__file__).resolve().parents[2] / "policies"


def test_check_clean_files_exit_0(capsys):
    files = [str(POLICIES / "fleet.example.yaml"), str(POLICIES / "demo.yaml")]
    assert main(["policy", "check", *files]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{f}: ok" for f in files]


def test_check_prints_every_error_and_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\npulls:\n  straems: 4\nwaves:\n  gap: 30 mins\n")
    good = POLICIES / "demo.yaml"
    assert main(["policy", "check", str(bad), str(good)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{bad}:3: unknown key 'straems' in pulls; did you mean 'streams'?"
    assert out[1].startswith(f"{bad}:5: waves.gap: bad duration '30 mins'; accepted:")
    assert out[2] == f"{good}: ok"


def test_check_quiet_and_missing_file(tmp_path, capsys):
    assert main(["policy", "check", "-q", str(POLICIES / "demo.yaml")]) == 0
    assert capsys.readouterr().out == ""
    assert main(["policy", "check", str(tmp_path / "nope.yaml")]) == 1
    assert "can't read the policy" in capsys.readouterr().out


def test_show_json_has_defaults_in_plain_units(capsys):
    assert main(["policy", "show", "--policy", str(POLICIES / "demo.yaml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["waves"]["gap"] == 10.0 and doc["shaping"]["ceil"] == 200_000_000
    assert doc["pulls"]["rate"] is None and doc["store"]["keep_versions"] == 2


def test_show_bad_policy_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 3\n")
    assert main(["policy", "show", "--policy", str(bad)]) == 1
    assert f"{bad}:1: policy schema version 3" in capsys.readouterr().err


def test_check_json_lists_each_files_problems(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\npulls:\n  straems: 4\n")
    assert main(["policy", "check", "--json", str(bad), str(POLICIES / "demo.yaml")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert doc["files"][0]["problems"][0]["line"] == 3
    assert "straems" in doc["files"][0]["problems"][0]["message"]
    assert doc["files"][1]["problems"] == []


def test_show_prints_human_units_and_passes_check(tmp_path, capsys):
    for name in ("fleet.example.yaml", "demo.yaml"):
        assert main(["policy", "show", "--policy", str(POLICIES / name)]) == 0
        shown = capsys.readouterr().out
        out = tmp_path / name
        out.write_text(shown)
        assert main(["policy", "check", str(out)]) == 0, capsys.readouterr().out
        capsys.readouterr()
        assert main(["policy", "show", "--policy", str(out), "--json"]) == 0
        again = json.loads(capsys.readouterr().out)
        assert main(["policy", "show", "--policy", str(POLICIES / name), "--json"]) == 0
        assert again == json.loads(capsys.readouterr().out)
    assert "ceil: 200mbit" in shown and "gap: 10s" in shown
