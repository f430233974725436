"""Log lines for journald carry their syslog priority; -v works anywhere on the command line."""

import os
import subprocess
import sys


def run_with_journal(tmp_path, *args):
    """Run the CLI with stderr on a file named by JOURNAL_STREAM, as systemd does."""
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        r = subprocess.run([sys.executable, "-m", "agent", *args], stderr=f,
                           stdout=subprocess.PIPE, env=env, timeout=60)
    return r, err.read_text()


def test_journal_lines_carry_their_priority(tmp_path):
    # A pull from a port nothing listens on: warnings and an info line on the way.
    r, err = run_with_journal(tmp_path, "pull", "http://127.0.0.1:9/m/v1", "--store",
                              str(tmp_path / "s"), "--quiet", "-vv")
    assert r.returncode == 1
    logged = [line for line in err.splitlines() if line.startswith("<")]
    assert logged and all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in logged), err


def test_no_prefix_when_stderr_is_not_the_journal(tmp_path):
    env = dict(os.environ, JOURNAL_STREAM="1:2")
    r = subprocess.run([sys.executable, "-m", "agent", "pull", "http://127.0.0.1:9/m/v1",
                        "--store", str(tmp_path / "s"), "--quiet", "-vv"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1
    assert not any(line.startswith("<") for line in r.stderr.splitlines())
    assert "DEBUG" in r.stderr or "INFO" in r.stderr        # -v after the command counted


def test_priorities():
    from agent.logs import syslog_priority
    assert [syslog_priority(n) for n in (40, 50, 30, 20, 10)] == [3, 3, 4, 6, 7]


def test_printed_errors_are_errors_in_the_journal(tmp_path):
    """A command's own message (printed, not logged) carries <3>: `journalctl -p err` shows it.
    Before, such lines had no priority and journald filed them at the stream's default."""
    r, err = run_with_journal(tmp_path, "store", "ls", "--store", str(tmp_path / "none"))
    assert r.returncode == 1
    assert err.startswith(f"<3>wagent store ls: no store at {tmp_path / 'none'}"), err
    assert all(line.startswith(("<3>", "<4>", "<6>", "<7>")) for line in err.splitlines()), err


def test_priority_lines_prefix_only_lines_without_one():
    import io

    from agent.logs import PriorityLines
    raw = io.StringIO()
    s = PriorityLines(raw)
    s.write("refusing to start: ")
    s.write("p.yaml:3: bad\n<4>wagent: a warning\nlast")
    assert raw.getvalue() == "<3>refusing to start: p.yaml:3: bad\n<4>wagent: a warning\n"
