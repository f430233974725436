"""Issue 22: one duration syntax for every option taking a time. `--timeout 2` was 2 seconds for
`reload` and a usage error for `wait`; `--timeout 2s` the other way round."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest

from agent import commands
from agent.cli import build_parser, main
from agent.control import ControlServer

POLICIES = Path(__file__).resolve().parents[2] / "policies"
TIME_WORDS = {"time", "timeout", "interval", "deadline", "delay", "duration", "period"}


def time_options() -> dict[str, argparse.Action]:
    """'COMMAND --option' -> its action, for every option whose name says it takes a time."""
    found = {}
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if TIME_WORDS & set(action.dest.split("_")):
                found[f"{name} {action.option_strings[-1]}"] = action
    return found


def test_every_option_taking_a_time_reads_the_one_syntax():
    options = time_options()
    assert {"reload --timeout", "wait --timeout", "plan --pull-time"} <= set(options)
    for name, action in options.items():
        assert action.type is commands.duration, name
        assert action.metavar == "DURATION", name
        assert "(seconds)" in action.help, name       # the help says what a bare number is
    for text, seconds in (("2", 2.0), ("2.5", 2.5), ("2s", 2.0), ("100ms", 0.1),
                          ("1m30s", 90.0), ("1h", 3600.0)):
        assert commands.duration(text) == seconds


@pytest.mark.parametrize("argv", [["reload"], ["wait", "m"], ["plan", "--nodes", "1"]])
def test_a_bad_duration_is_a_usage_error_naming_the_forms(argv, capsys):
    flag = "--pull-time" if argv[0] == "plan" else "--timeout"
    with pytest.raises(SystemExit) as e:
        main(argv + [flag, "2x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: bad duration '2x'" in err and "a number of seconds" in err


class SlowReload:
    """A daemon whose reload takes until the test lets it finish."""

    def __init__(self):
        self.release = threading.Event()

    def status(self):
        return {}

    def reload(self):
        self.release.wait(10)
        return {"reloaded": True, "path": "/p.yaml", "sha256": "a" * 64}


def test_reload_timeout_with_a_unit_or_bare_seconds(tmp_path, capsys):
    daemon = SlowReload()
    srv = ControlServer(str(tmp_path / "run" / "control.sock"), daemon, group=None)
    srv.start()
    try:
        for timeout in ("0.2", "200ms"):
            assert main(["reload", "--socket", srv.path, "--timeout", timeout]) == 1
            assert "didn't answer 'reload' within 0.2 s" in capsys.readouterr().err
        daemon.release.set()
        assert main(["reload", "--socket", srv.path, "--timeout", "1m"]) == 0
        assert capsys.readouterr().out.startswith("reloaded /p.yaml")
    finally:
        daemon.release.set()
        srv.stop()


def test_wait_timeout_with_a_unit_or_bare_seconds(tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    for timeout in ("0", "0s", "0ms"):         # nothing there: given up at once
        assert main(["wait", "m", "--timeout", timeout, "--store", str(store)]) == 1
        err = capsys.readouterr().err
        assert "m: a current version not complete" in err and err.endswith(" after 0s\n")


def test_plan_pull_time_with_a_unit_or_bare_seconds(capsys):
    argv = ["plan", "--policy", str(POLICIES / "fleet.example.yaml"), "--nodes", "100",
            "--published", "2026-12-02T12:00:00Z", "--json"]
    docs = []
    for pull_time in ("600", "10m", None):     # None: the default, 10m
        assert main(argv + (["--pull-time", pull_time] if pull_time else [])) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0] == docs[1] == docs[2]
    assert main(argv + ["--pull-time", "20m"]) == 0
    assert json.loads(capsys.readouterr().out) != docs[0]    # the option is read, not ignored
