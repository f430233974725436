"""on_ready hooks: run by /bin/sh with the event in the environment, bounded by their timeout."""

import time

from agent.hooks import run_hook
from tests.waiting import wait_for


def test_a_hook_sees_the_event_and_reports_its_exit(tmp_path):
    out = tmp_path / "seen"
    ok, what = run_hook(f'echo "$WAGENT_MODEL $WAGENT_VERSION" > {out}',
                        {"WAGENT_MODEL": "m", "WAGENT_VERSION": "v2"}, 10)
    assert ok and what.startswith("exit 0 after")
    assert out.read_text() == "m v2\n"
    ok, what = run_hook("echo first; echo 'no such service' >&2; exit 3", {}, 10)
    assert not ok and what.startswith("exit 3 after") and what.endswith(": no such service")


def test_a_hook_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    started = time.monotonic()
    ok, what = run_hook(f"sleep 30 & echo $! > {tmp_path}/child; wait", {}, 0.5)
    assert not ok and what == "killed after 0.5 s (on_ready_timeout)"
    assert time.monotonic() - started < 10
    child = int((tmp_path / "child").read_text())

    def gone() -> bool:          # gone, or gone but for its zombie entry
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    assert wait_for(gone)

