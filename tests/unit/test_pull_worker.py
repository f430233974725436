"""The daemon's pull worker, driven step by step with fake functions (no HTTP, no store), and
on the real scheduler (APScheduler) where its jobs matter."""

import threading
import time

import pytest

from agent.policy.model import Model, Policy, Pulls
from agent.pull.worker import Progress, WindowState, Worker, WorkerDeps
from agent.scheduler import Scheduler
from tests.waiting import wait_for


class World:
    def __init__(self):
        self.now = 1000.0
        self.latest = "v1"
        self.installed = set()
        self.window_open = True
        self.pulled = []
        self.evictions = 0
        self.fail = None
        self.block = None          # an Event the fake pull waits on (a pull in progress)

    def deps(self):
        def pull(model, version, progress, stop):
            progress(Progress(done=50, total=100, streams=4, fetched=50, rate_bps=8e6))
            if self.block is not None:
                while not stop.is_set() and not self.block.is_set():
                    stop.wait(0.01)
                if stop.is_set():
                    raise RuntimeError("stopped")
            if self.fail:
                raise RuntimeError(self.fail)
            progress(Progress(done=100, total=100, streams=0, fetched=100))
            self.installed.add((model.name, version))
            self.pulled.append((model.name, version))

        def schedule(model, version, published, now):
            slot = published + 60.0
            return slot, max(slot, now) if self.window_open else None

        return WorkerDeps(
            clock=lambda: self.now,
            resolve=lambda m: self.latest,
            published=lambda m, v: 1000.0,
            schedule=schedule,
            window=lambda now: WindowState(self.window_open,
                                      next_open=None if self.window_open else now + 3600),
            have=lambda m, v: (m.name, v) in self.installed,
            local_version=lambda m: None,
            pull=pull,
            evict=lambda: setattr(self, "evictions", self.evictions + 1),
        )


def policy(*models, concurrent=2):
    return Policy(models=tuple(models), poll_interval=300.0,
                  pulls=Pulls(concurrent_models=concurrent))


def step_all(p):
    """One look at every model, in policy order, as their jobs would take it."""
    return min(p.step(m.name) for m in p.policy.models)


def test_waits_for_slot_then_pulls_and_evicts():
    w = World()
    p = Worker(policy(Model("llama")), w.deps())
    assert step_all(p) == 60.0
    (info,) = p.snapshot()
    assert (info.state, info.version, info.slot_at) == ("waiting_slot", "v1", 1060.0)
    w.now = 1060.0
    step_all(p)
    assert w.pulled == [("llama", "v1")] and w.evictions == 1
    (info,) = p.snapshot()
    assert info.state == "done" and info.bytes_done == 100
    assert p.fetched_totals() == {"llama": 100}
    # a new latest is noticed at the next poll, not before
    w.latest = "v2"
    w.now += 10
    step_all(p)
    assert p.snapshot()[0].version == "v1"
    w.now += 400
    step_all(p)
    assert w.pulled[-1] == ("llama", "v2")


def test_failure_is_reported_and_retried_later():
    w = World()
    w.now = 2000.0
    w.fail = "origin said 503"
    p = Worker(policy(Model("llama", version="v9")), w.deps())
    wait = step_all(p)
    (info,) = p.snapshot()
    assert info.state == "failed" and "503" in info.error
    assert wait == 10.0
    w.fail = None
    w.now += 5
    step_all(p)
    assert w.pulled == []            # not before its retry time
    w.now += 6
    step_all(p)
    assert w.pulled == [("llama", "v9")]
    assert p.snapshot()[0].error is None


def test_closed_window_waits_and_pause_holds():
    w = World()
    w.now = 5000.0
    w.window_open = False
    p = Worker(policy(Model("llama")), w.deps())
    step_all(p)
    assert p.snapshot()[0].state == "waiting_window"
    w.window_open = True
    p.pause()
    step_all(p)
    assert p.snapshot()[0].state == "paused" and w.pulled == []
    p.resume()
    step_all(p)
    assert w.pulled == [("llama", "v1")]


@pytest.fixture
def scheduler():
    s = Scheduler()
    s.start()
    yield s
    s.shutdown(wait=False)


def test_supervise_stops_a_running_pull_when_the_window_closes(scheduler):
    w = World()
    w.now = 5000.0
    w.block = threading.Event()
    p = Worker(policy(Model("llama")), w.deps())
    p.start(scheduler)
    try:
        assert wait_for(lambda: p.snapshot()[0].state == "pulling")
        info = p.snapshot()[0]
        assert info.state == "pulling" and info.streams == 4 and info.rate_bps == 8e6
        w.window_open = False
        p.supervise()
        assert wait_for(lambda: p.snapshot()[0].state != "pulling")
        assert p.snapshot()[0].state in ("idle", "waiting_window")
        assert w.pulled == []
    finally:
        p.stop()


def test_models_pull_at_once_up_to_the_limit_the_others_queue(scheduler):
    w = World()
    w.now = 5000.0
    w.block = threading.Event()
    p = Worker(policy(Model("a"), Model("b"), Model("c"), concurrent=2), w.deps())
    p.start(scheduler)
    try:
        assert wait_for(lambda: sorted(i.state for i in p.snapshot())
                          == ["pulling", "pulling", "queued"])
        assert p.pulling() == 2
        w.block.set()                            # the two finish; the third's turn comes
        assert wait_for(lambda: len(w.pulled) == 3)
        assert {i.state for i in p.snapshot()} == {"done"}
    finally:
        p.stop()


def test_a_stuck_model_never_holds_the_others(scheduler):
    w = World()
    w.now = 5000.0
    w.block = threading.Event()
    inner = w.deps().pull
    p = Worker(policy(Model("slow"), Model("fast"), concurrent=2), w.deps())

    def pull(model, version, progress, stop):
        if model.name == "fast":
            progress(Progress(done=100, total=100, streams=0, fetched=100))
            w.installed.add((model.name, version))
            w.pulled.append((model.name, version))
            return
        inner(model, version, progress, stop)

    p.deps = WorkerDeps(**{**p.deps.__dict__, "pull": pull})
    p.start(scheduler)
    try:
        assert wait_for(lambda: ("fast", "v1") in w.pulled)
        assert {i.model: i.state for i in p.snapshot()}["slow"] == "pulling"
    finally:
        p.stop()


def test_the_version_made_current_once_complete(scheduler):
    w = World()
    w.now = 5000.0
    made = []
    p = Worker(policy(Model("llama")), w.deps())
    p.deps = WorkerDeps(**{**p.deps.__dict__, "ready": lambda m, v: made.append((m.name, v))})
    step_all(p)
    step_all(p)                                  # done already: not handed over twice
    assert made == [("llama", "v1")]


def test_reload_sweeps_models_no_longer_declared():
    w = World()
    p = Worker(policy(Model("a"), Model("b")), w.deps())
    step_all(p)
    assert [i.model for i in p.snapshot()] == ["a", "b"]
    p.update(policy(Model("b"), Model("c")))
    assert [i.model for i in p.snapshot()] == ["b", "c"]


def test_a_model_dropped_by_a_reload_as_its_pull_finishes_is_no_error():
    """The reload lands while the last piece is written: the pull completes, the model's state
    is already swept; the pass goes on (no KeyError turned into a failed pass)."""
    w = World()
    p = Worker(policy(Model("a"), Model("b")), w.deps())
    w.now = 1100.0                               # past every slot
    inner = w.deps().pull

    def pull(model, version, progress, stop):
        inner(model, version, progress, stop)
        if model.name == "a":
            p.update(policy(Model("b")))         # reload: "a" dropped

    p.deps = WorkerDeps(**{**p.deps.__dict__, "pull": pull})
    step_all(p)
    assert [i.model for i in p.snapshot()] == ["b"]
    assert ("b", "v1") in w.pulled


def test_a_failing_step_is_that_models_error_alone(scheduler):
    w = World()
    w.now = time.time()          # the retry of the failed step is armed on the real scheduler
    deps = w.deps()
    have = deps.have

    def broken(model, version):
        if model.name == "bad":
            raise OSError("store unreadable")
        return have(model, version)

    p = Worker(policy(Model("bad"), Model("good")),
               WorkerDeps(**{**deps.__dict__, "have": broken}))
    p.start(scheduler)
    try:
        assert wait_for(lambda: ("good", "v1") in w.pulled and p.errors())
        # the good model's steps succeed and don't clear the other's error
        assert p.errors() == (
            "the pull worker failed a step for bad (retrying): store unreadable",)
    finally:
        p.stop()
