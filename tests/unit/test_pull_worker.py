"""The daemon's pull worker, driven step by step with fake functions (no HTTP, no store), and
on the real scheduler (APScheduler) where its jobs matter."""

import threading
import time

import pytest

from agent import schedule
from agent.policy.model import Model, Policy, Pulls
from agent.pull.worker import MIN_POLL_WAIT, WindowState, Worker, WorkerDeps
from agent.schedule import poll_after
from agent.scheduler import Scheduler
from agent.status import PullProgress
from tests.waiting import wait_for


def reported(done, total, streams, fetched, rate=0.0):
    """What the engine reports of a pull ``done`` bytes of ``total`` in (``rate``: bytes/s)."""
    return PullProgress("llama", "v1", "progress", total, done, fetched, 0, rate, streams, 0, 1,
                        0.0)


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
        self.node_id = "node-a"
        self.polls = []            # when `latest` was asked
        self.resolve_error = None

    def resolve(self, model):
        self.polls.append(self.now)
        if self.resolve_error:
            raise RuntimeError(self.resolve_error)
        return self.latest

    def deps(self):
        def pull(model, version, progress, stop):
            progress(reported(done=50, total=100, streams=4, fetched=50, rate=1e6))
            if self.block is not None:
                while not stop.is_set() and not self.block.is_set():
                    stop.wait(0.01)
                if stop.is_set():
                    raise RuntimeError("stopped")
            if self.fail:
                raise RuntimeError(self.fail)
            progress(reported(done=100, total=100, streams=0, fetched=100))
            self.installed.add((model.name, version))
            self.pulled.append((model.name, version))

        def schedule(model, version, published, now):
            slot = published + 60.0
            return slot, max(slot, now) if self.window_open else None

        return WorkerDeps(
            clock=lambda: self.now,
            resolve=self.resolve,
            published=lambda m, v: 1000.0,
            schedule=schedule,
            window=lambda now: WindowState(self.window_open,
                                      next_open=None if self.window_open else now + 3600),
            have=lambda m, v: (m.name, v) in self.installed,
            local_version=lambda m: None,
            pull=pull,
            evict=lambda: setattr(self, "evictions", self.evictions + 1),
            poll_after=lambda m, polled, interval: poll_after(polled, self.node_id, m.name,
                                                             interval),
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
    polled = w.polls[-1]
    due = poll_after(polled, w.node_id, "llama", 300.0)
    w.now = due - 0.5
    step_all(p)
    assert p.snapshot()[0].version == "v1" and w.polls[-1] == polled
    w.now = due
    step_all(p)
    assert w.polls[-1] == due and p.snapshot()[0].version == "v2"
    w.now += 60
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


def test_polls_latest_at_once_then_at_the_nodes_poll_times():
    w = World()
    w.now = 1000.0               # started somewhere in an interval
    w.installed.add(("llama", "v1"))
    pol = Policy(models=(Model("llama"),), poll_interval=10.0)
    p = Worker(pol, w.deps())
    wait = step_all(p)
    assert w.polls == [1000.0]   # at once: a restarted daemon doesn't wait for its phase
    phase = schedule.poll_phase(w.node_id, "llama", 10.0)
    for _ in range(5):
        w.now += wait / 2        # a look in between (a wake, a reload of another model)
        wait = step_all(p)
        w.now += wait            # the job runs when the step said
        wait = step_all(p)
    polls = w.polls[1:]
    assert len(polls) == 5
    assert all(b - a == pytest.approx(10.0) for a, b in zip(polls, polls[1:], strict=False))
    # every poll after the first is on the node's phase, whatever time it started
    assert all(((t - phase) / 10.0) == pytest.approx(round((t - phase) / 10.0), abs=1e-9)
               for t in polls)
    assert 1000.0 < polls[0] <= 1010.0


def test_poll_now_polls_before_the_next_poll_time():
    w = World()
    w.installed.add(("llama", "v1"))
    p = Worker(Policy(models=(Model("llama"),), poll_interval=300.0), w.deps())
    wait = step_all(p)
    w.now += 1.0
    assert step_all(p) == pytest.approx(wait - 1.0) and len(w.polls) == 1   # not due yet
    w.latest = "v2"
    p.poll_now("llama")                  # told: its cache started v2
    p.poll_now("gone")                   # a model the policy doesn't have: nothing
    step_all(p)
    assert len(w.polls) == 2 and p.snapshot()[0].version == "v2"


def test_nodes_started_together_poll_at_their_own_phases():
    firsts = {}
    for node in ("gpu-1", "gpu-2", "gpu-3"):
        w = World()
        w.node_id = node
        w.installed.add(("llama", "v1"))
        p = Worker(Policy(models=(Model("llama"),), poll_interval=10.0), w.deps())
        w.now += step_all(p)
        step_all(p)
        firsts[node] = w.polls[1]
        assert w.polls[0] == 1000.0
        assert firsts[node] == schedule.next_poll(1000.0, node, "llama", 10.0)
    assert len(set(firsts.values())) == 3


def test_a_failed_poll_waits_for_the_next_poll_time_and_keeps_its_answer():
    w = World()
    w.installed.add(("llama", "v1"))
    p = Worker(Policy(models=(Model("llama"),), poll_interval=10.0), w.deps())
    step_all(p)
    w.now = poll_after(w.now, w.node_id, "llama", 10.0)
    w.resolve_error = "origin said 503"
    wait = step_all(p)
    failed_at = w.now
    assert wait == pytest.approx(10.0)          # the next poll time, an interval on
    (info,) = p.snapshot()
    assert "503" in info.error and info.version == "v1" and info.state == "done"
    w.now += wait - 1
    assert step_all(p) == pytest.approx(1.0)    # a look before it doesn't poll
    assert w.polls[-1] == failed_at
    w.now += 1
    w.resolve_error = None
    step_all(p)
    assert w.polls[-1] == failed_at + 10.0 and p.snapshot()[0].error is None


def test_a_poll_interval_of_zero_polls_at_every_look_without_spinning():
    w = World()
    w.installed.add(("llama", "v1"))
    p = Worker(Policy(models=(Model("llama"),), poll_interval=0.0), w.deps())
    assert step_all(p) == MIN_POLL_WAIT
    w.now += MIN_POLL_WAIT
    assert step_all(p) == MIN_POLL_WAIT
    assert w.polls == [1000.0, 1000.0 + MIN_POLL_WAIT]


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
        # The pull returns before the worker records its end: wait for the state, not the list.
        assert wait_for(lambda: {i.state for i in p.snapshot()} == {"done"})
        assert len(w.pulled) == 3
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
            progress(reported(done=100, total=100, streams=0, fetched=100))
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


FAR_FUTURE = 253402300799.0      # 9999-12-31T23:59:59Z, as `manifest build --published` takes it


def test_a_version_published_for_a_far_future_keeps_the_model_polling(scheduler):
    """A publisher's far-future `published` (docs/publishing.md invites future times): the
    model waits for its slot without an error, its job stays armed, and it still polls
    `latest` at its poll times, so the next good version is seen. Before, arming the job for a
    slot after year 9999 raised inside APScheduler and the model's job was gone for good."""
    w = World()
    w.latest = "v9"
    deps = w.deps()
    p = Worker(policy(Model("llama")),
               WorkerDeps(**{**deps.__dict__, "clock": time.time,
                             "published": lambda m, v: FAR_FUTURE if v == "v9" else 1000.0}))
    p.start(scheduler)
    try:
        assert wait_for(lambda: p.snapshot()[0].state == "waiting_slot")
        assert wait_for(lambda: "model:llama" in scheduler.jobs())
        assert scheduler.jobs()["model:llama"] <= time.time() + 300.0 + 1
        assert p.errors() == () and p.snapshot()[0].error is None
    finally:
        p.stop()


def test_waiting_for_a_slot_never_sleeps_past_the_next_poll():
    w = World()
    w.latest = "v9"
    deps = w.deps()
    p = Worker(policy(Model("llama")),
               WorkerDeps(**{**deps.__dict__,
                             "published": lambda m, v: FAR_FUTURE if v == "v9" else 1000.0}))
    wait = step_all(p)
    assert p.snapshot()[0].state == "waiting_slot"
    assert wait == poll_after(w.now, w.node_id, "llama", 300.0) - w.now
    w.latest = "v2"                  # a good version replaces it
    w.now += wait
    step_all(p)
    assert p.snapshot()[0].version == "v2"
    # a pinned version polls nothing: it looks again no later than a day
    pinned = Worker(policy(Model("llama", version="v9")),
                    WorkerDeps(**{**deps.__dict__, "published": lambda m, v: FAR_FUTURE}))
    assert step_all(pinned) == 86400.0


def test_polls_that_keep_failing_make_the_model_failed_and_a_good_one_clears_it():
    """One lost poll is a blip (the model keeps its state); three in a row (no source answers,
    or each names a version that can't be one, like `current`) show as failed, which makes the
    daemon degraded; the next good answer moves the model on."""
    w = World()
    w.installed.add(("llama", "v1"))
    p = Worker(Policy(models=(Model("llama"),), poll_interval=10.0), w.deps())
    step_all(p)
    w.resolve_error = "version 'current' is reserved"
    states = []
    for _ in range(3):
        w.now = poll_after(w.now, w.node_id, "llama", 10.0)
        step_all(p)
        states.append(p.snapshot()[0].state)
    assert states == ["done", "done", "failed"]
    assert "reserved" in p.snapshot()[0].error
    w.resolve_error = None
    w.now = poll_after(w.now, w.node_id, "llama", 10.0)
    step_all(p)
    assert p.snapshot()[0].state == "done" and p.snapshot()[0].error is None
