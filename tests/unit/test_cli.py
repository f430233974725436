import subprocess
import sys

from agent import __version__
from agent.cli import SUBCOMMANDS, main


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "agent", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"wagent {__version__}"
    out = subprocess.run([sys.executable, "-m", "agent", "--help"], capture_output=True,
                         text=True, check=True)
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_usage_error_exits_2(capsys):
    try:
        main(["no-such-command"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("argparse should exit 2")
