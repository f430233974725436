"""The APScheduler glue: late jobs still run (misfire), one-shot jobs re-armed from their own run
are kept, UTC throughout.

Runs with the venv's newest APScheduler 3.x and with Debian 12's 3.9.1 (`make test` runs the
unit tests under both: PYTHONPATH=. /usr/bin/python3 -m pytest -p no:cacheprovider tests/unit).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from agent.scheduler import Scheduler
from tests.waiting import wait_for


@pytest.fixture
def make_scheduler():
    made = []

    def make(**kw) -> Scheduler:
        s = Scheduler(**kw)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown(wait=False)



def busy_then_late(s: Scheduler) -> list[float]:
    """One worker held for 0.3 s; behind it a job that was already 0.9 s due. The worker picks
    it up about 1.2 s late: past APScheduler's default grace of 1 s."""
    ran: list[float] = []
    started = threading.Event()

    def busy() -> None:
        started.set()
        time.sleep(0.3)

    s.at(time.time(), busy, job_id="busy")
    assert started.wait(2)
    s.at(time.time() - 0.9, lambda: ran.append(time.time()), job_id="late")
    s.at(time.time() + 0.01, lambda: ran.append(0.0), job_id="marker")
    wait_for(lambda: 0.0 in ran)
    return ran


def test_job_runs_when_the_worker_was_busy_past_its_time(make_scheduler):
    ran = busy_then_late(make_scheduler(workers=1))
    assert len(ran) == 2                    # the late job ran, then the marker


def test_control_the_default_grace_would_drop_it(make_scheduler):
    # What the glue protects against: APScheduler's default grace (1 s) drops the late job.
    ran = busy_then_late(make_scheduler(workers=1, misfire_grace_time=1))
    assert ran == [0.0]


def test_job_due_in_the_past_runs_at_once(make_scheduler):
    s = make_scheduler()
    ran = []
    s.at(time.time() - 3600, ran.append, job_id="past", args=["v2"])
    assert wait_for(lambda: ran == ["v2"])


def test_control_apscheduler_drops_late_jobs_with_a_grace_time(make_scheduler):
    # What the glue protects against: with a 1 s grace, the hour-late job never runs.
    s = make_scheduler(misfire_grace_time=1)
    ran = []
    s.at(time.time() - 3600, ran.append, job_id="past", args=["v2"])
    s.at(time.time(), ran.append, job_id="now", args=["marker"])
    assert wait_for(lambda: "marker" in ran)
    time.sleep(0.1)
    assert ran == ["marker"]


def test_at_replaces_a_job_with_the_same_id(make_scheduler):
    s = make_scheduler()
    later = time.time() + 3600
    s.at(later, print, job_id="pull:m:v1")
    s.at(later + 60, print, job_id="pull:m:v1")
    assert s.jobs() == {"pull:m:v1": pytest.approx(later + 60, abs=1e-3)}
    assert s.cancel("pull:m:v1") and not s.cancel("pull:m:v1")


def test_every(make_scheduler):
    s = make_scheduler()
    ticks = []
    s.every(0.05, lambda: ticks.append(1), job_id="poll", first=time.time())
    assert wait_for(lambda: len(ticks) >= 2)


def test_a_job_that_rearms_itself_at_once_runs_again_after_its_run_returns(make_scheduler):
    # APScheduler skips a job due while its last run still runs (max_instances 1) and drops a
    # one-shot job it skipped: a model's job whose next poll is already due re-arms itself at
    # once, and its run ends only after that.
    s = make_scheduler()
    runs: list[float] = []

    def job() -> None:
        runs.append(time.time())
        if len(runs) < 3:
            s.at(time.time(), job, job_id="model:x")
            time.sleep(0.05)            # still running when the new one comes due

    s.at(time.time(), job, job_id="model:x")
    assert wait_for(lambda: len(runs) == 3)
    assert wait_for(lambda: "model:x" not in s.jobs())


def test_a_job_armed_from_its_own_run_is_added_when_the_run_returns(make_scheduler, caplog):
    # ... not added at once and skipped: APScheduler's skip is a warning in the journal after
    # every pull that outlasted the poll interval
    s = make_scheduler()
    runs: list[float] = []
    seen: list[dict[str, float | None]] = []

    def job() -> None:
        runs.append(time.time())
        if len(runs) < 3:
            s.at(time.time(), job, job_id="model:z")
            seen.append(s.jobs())           # the next run shows while this one still runs
            time.sleep(0.05)

    with caplog.at_level(logging.WARNING, logger="apscheduler"):
        s.at(time.time(), job, job_id="model:z")
        assert wait_for(lambda: len(runs) == 3)
    assert all("model:z" in j for j in seen)
    assert runs[1] - runs[0] >= 0.05 and runs[2] - runs[1] >= 0.05
    assert not [r for r in caplog.records if "maximum number of running" in r.getMessage()]


def test_a_job_that_raises_after_arming_itself_still_runs_again(make_scheduler):
    s = make_scheduler()
    runs: list[float] = []

    def job() -> None:
        runs.append(time.time())
        if len(runs) < 3:
            s.at(time.time(), job, job_id="window:x")
            raise RuntimeError("the window's action failed")

    s.at(time.time(), job, job_id="window:x")
    assert wait_for(lambda: len(runs) == 3)


def test_a_job_armed_by_another_thread_while_it_runs_runs_again_once_it_returns(
        make_scheduler, caplog):
    # another thread re-arms a model's job while a step of it (a pull: hours) runs: the run
    # takes it up as it ends. Added to APScheduler, it came due at once and was skipped, then
    # armed again every 10 ms until the step returned: a warning and a job added each time.
    s = make_scheduler()
    runs: list[float] = []
    started = threading.Event()

    def job() -> None:
        runs.append(time.time())
        started.set()
        if len(runs) == 1:
            time.sleep(0.3)

    with caplog.at_level(logging.WARNING, logger="apscheduler"):
        s.at(time.time(), job, job_id="model:w")
        assert started.wait(5)
        s.at(time.time(), job, job_id="model:w")
        assert "model:w" in s.jobs()                 # shown while the run goes on
        assert wait_for(lambda: len(runs) == 2)
    assert runs[1] - runs[0] >= 0.3
    assert not [r for r in caplog.records if "maximum number of running" in r.getMessage()]


def test_a_one_shot_job_shows_while_it_runs_before_it_arms_its_next_run(make_scheduler):
    # status lists a model's job throughout (docs/status.md: null while it runs), not only
    # once the run has armed the next one
    s = make_scheduler()
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(5)

    s.at(time.time(), job, job_id="model:v")
    assert started.wait(5)
    try:
        assert s.jobs().get("model:v", 0.0) is None
    finally:
        release.set()
    assert wait_for(lambda: "model:v" not in s.jobs())


def test_a_cancelled_job_skipped_meanwhile_stays_cancelled(make_scheduler):
    s = make_scheduler()
    runs: list[float] = []

    def job() -> None:
        runs.append(time.time())
        s.at(time.time(), job, job_id="model:y")
        s.cancel("model:y")
        time.sleep(0.05)

    s.at(time.time(), job, job_id="model:y")
    assert wait_for(lambda: runs)
    time.sleep(0.2)
    assert len(runs) == 1 and "model:y" not in s.jobs()


def test_a_time_past_what_a_datetime_holds_is_armed_not_raised(make_scheduler):
    """Year 10000 (a far-future publication plus a wave's delay) is clamped, not a
    ValueError inside the run that re-arms the job."""
    s = make_scheduler()
    for when in (253402300799.0 + 3600, float("inf"), float("nan")):
        s.at(when, lambda: None, job_id="far")
        assert s.jobs()["far"] > 253402300799.0 - 1e12
