"""Shared pytest wiring: the `testbed` fixture and the netns skip rule.

Tests marked `netns` need root (network namespaces). Without it they skip and say why, except when
CI=true: there a skipped netns test would hide a broken pipeline, so it fails instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

from tests.testbed import Testbed

NETNS_TOOLS = ("ip", "tc")
# The testbed's `wagent` launcher runs the python that runs the tests (the venv's, or Debian's
# for the `debian` run), also when a test calls it outside a testbed host.
os.environ.setdefault("WAGENT_PYTHON", sys.executable)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def netns_unavailable() -> str | None:
    """Why netns tests can't run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root)"
    missing = [tool for tool in NETNS_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install iproute2)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is None:
        return
    reason = netns_unavailable()
    if reason is None:
        return
    if _in_ci():
        pytest.fail(f"CI=true and a netns test can't run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed


CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def testbed(request: pytest.FixtureRequest) -> Iterator[Testbed]:
    """A fresh Testbed per test; everything it made is gone after the test, pass or fail.

    When the test fails, the logs of the processes it started (nginx, iperf3, popen) are printed
    at teardown, so the failure report shows them.
    """
    with Testbed() as tb:
        yield tb
        if request.node.stash.get(CALL_FAILED, False):
            logs = tb.logs()
            if logs:
                print(f"testbed {tb.prefix} logs:\n{logs}")


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that runs the CLI in-process (``agent.cli.main``) sets up logging, which adds a
    handler on the root logger bound to that test's captured stderr: later tests' warnings
    would then print "Logging error" tracebacks into a closed stream. Put the root logger back."""
    import logging
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
