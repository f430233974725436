"""A pull worker that makes no progress for longer than the deadlines allow shows as stalled, and
the daemon as degraded; progress, or the end of the call, clears it. Driven with a fake clock and
fake pull functions (the engine's deadlines are tested against real servers in
tests/integration/test_pull_hostile.py)."""

import threading

import pytest

from agent.policy.model import Model, Policy
from agent.pull.worker import WindowState, Worker, WorkerDeps
from agent.status import EXIT_DEGRADED, EXIT_HEALTHY, DaemonState, exit_code, to_json, to_text
from tests.unit.test_pull_worker import reported

LIMIT = 100.0


class World:
    def __init__(self):
        self.now = 1000.0
        self.release = threading.Event()
        self.entered = threading.Event()
        self.progress = None
        self.hang_in = "pull"

    def _hang(self, where):
        if self.hang_in == where:
            self.entered.set()
            assert self.release.wait(10)

    def deps(self):
        def resolve(model):
            self._hang("resolve")
            return "v1"

        def pull(model, version, progress, stop):
            self.progress = progress
            progress(reported(done=10, total=100, streams=2, fetched=10))
            self._hang("pull")

        return WorkerDeps(
            clock=lambda: self.now, resolve=resolve, published=lambda m, v: 0.0,
            schedule=lambda m, v, pub, now: (0.0, 0.0), window=lambda now: WindowState(True),
            have=lambda m, v: False, local_version=lambda m: None, pull=pull,
            evict=lambda: None, poll_after=lambda m, polled, interval: polled + interval,
            stall_after=lambda: LIMIT)


def state(puller):
    return to_json(DaemonState(pid=1, started_at=0.0, version="0", pulls=puller.snapshot()),
                   now=0.0)


@pytest.mark.parametrize("hang_in, doing", [("pull", "pulling v1"),
                                            ("resolve", "resolving latest")])
def test_a_worker_stuck_past_the_deadlines_makes_the_daemon_degraded(hang_in, doing):
    w = World()
    w.hang_in = hang_in
    p = Worker(Policy(models=(Model("llama"),), poll_interval=300.0), w.deps())
    t = threading.Thread(target=p.step, args=("llama",))
    t.start()
    try:
        assert w.entered.wait(10)
        w.now += LIMIT - 1
        assert state(p)["health"] == "healthy"
        w.now += 2
        doc = state(p)
        assert doc["health"] == "degraded" and exit_code(doc) == EXIT_DEGRADED
        (pull,) = doc["pulls"]
        assert f"while {doing}" in pull["stalled"] and "no progress for 101 s" in pull["stalled"]
        assert doc["problems"] == [f"pull llama: {pull['stalled']}"]
        assert "STALLED: no progress" in to_text(doc)
    finally:
        w.release.set()
        t.join(10)
    doc = state(p)
    assert doc["pulls"][0]["stalled"] is None and exit_code(doc) == EXIT_HEALTHY


def test_bytes_moving_keep_a_long_pull_healthy():
    w = World()
    p = Worker(Policy(models=(Model("llama"),), poll_interval=300.0), w.deps())
    t = threading.Thread(target=p.step, args=("llama",))
    t.start()
    try:
        assert w.entered.wait(10)
        for fetched in range(20, 100, 10):
            w.now += LIMIT * 0.9
            w.progress(reported(done=fetched, total=100, streams=2, fetched=fetched))
            assert state(p)["health"] == "healthy"
        w.now += LIMIT * 0.9
        w.progress(reported(done=90, total=100, streams=2, fetched=90))   # nothing moved
        w.now += LIMIT * 0.2
        assert state(p)["health"] == "degraded"
    finally:
        w.release.set()
        t.join(10)
