"""The CLI ends quietly when the reader of its output goes away (``wagent status | head -1``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.control import ControlServer
from agent.status import DaemonState, PullInfo, to_json

REPO = Path(__file__).resolve().parents[2]


class Daemon:
    """Answers status with a long document (every model of a big policy)."""

    def status(self):
        pulls = tuple(PullInfo(f"model-{i}", "v1", "done") for i in range(2000))
        return to_json(DaemonState(pid=1, started_at=0.0, version="0.1.0", pulls=pulls), 10.0)

    def reload(self):
        return {}

    pause = resume = reload


@pytest.fixture
def socket_path(tmp_path):
    srv = ControlServer(str(tmp_path / "run" / "control.sock"), Daemon(), group=None)
    srv.start()
    yield srv.path
    srv.stop()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"]])
def test_a_reader_that_went_away_ends_the_command_quietly(socket_path, args):
    """The reader closes its end before the first byte (head -1 reads one line, then exits):
    every write fails with EPIPE, also the flush at interpreter exit."""
    p = subprocess.Popen([sys.executable, "-m", "agent", *args, "--socket", socket_path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(30) == 141, err
    assert err == ""


def test_status_output_is_whole_when_read(socket_path):
    out = subprocess.run([sys.executable, "-m", "agent", "status", "--socket", socket_path],
                         capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().count("model-") == 2000 and out.stderr == b""
