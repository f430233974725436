"""APScheduler 3.x behind a small interface: the only module that imports apscheduler.

Three traps in APScheduler 3 are closed here:

* ``misfire_grace_time`` defaults to 1 s: a job whose time passed while the worker was busy, the
  machine suspended or the process starting, is dropped with only a warning. wagent's jobs
  ("start pulling version v2", "the night window opened") must run however late, so every job
  gets ``misfire_grace_time=None`` and ``coalesce=True`` (several missed runs collapse into one).
* ``CronTrigger(day_of_week=0)`` means Monday, where cron's 0 is Sunday (and cron ORs the two day
  fields where CronTrigger ANDs them). wagent never gives APScheduler a cron field: the
  windows' openings and closings are reckoned by ``agent.schedule`` (from ``agent.cron``), and
  the pull worker arms one-shot jobs at them: a model's job for the opening its pull waits for,
  ``window-close:{model}`` for the closing of the window a pull started in.
* A one-shot job that re-arms itself to run at once (a model's job whose next poll is already
  due, after a pull that took longer than the poll interval) can come due before its current
  run has returned: APScheduler then skips it ("maximum number of running instances reached",
  a warning in the journal) and, a DateTrigger having no next run, drops it for good. A job
  armed while a run of it is in progress, from that run or from another thread, is taken up
  as the run ends: run then, within that run, if it is due by then, else added to APScheduler
  only then. One skipped all the same (due as a run had just ended, before APScheduler took
  back its instance) is armed again a moment later (``SKIPPED_RETRY``). Before, a job armed
  from another thread during a pull was skipped and armed again every 10 ms for the rest of
  the pull, a warning each time.

Works with APScheduler 3.9.1 (Debian 12) and the newest 3.x. Times are POSIX seconds or aware
datetimes; the scheduler runs in UTC.

>>> s = Scheduler(); s.start()
>>> s.at(time.time() + 60, start_pull, job_id="pull:llama:v2")
>>> s.every(5.0, verify, job_id="shaping-verify")
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.schedule import NEVER

log = logging.getLogger(__name__)

JOB_DEFAULTS = {"misfire_grace_time": None, "coalesce": True, "max_instances": 1}
SKIPPED_RETRY = 0.01           # s: a one-shot job skipped while its last run returns, again
# the latest time a job is armed for (``_aware``): the schedule's "never", one limit for both
LATEST = datetime.fromtimestamp(NEVER, UTC)


class Scheduler:
    """One-shot and interval jobs on a background thread pool, in UTC."""

    # Each model's job may hold a thread for a whole pull (hours): threads enough for every
    # model and the housekeeping jobs; an idle thread costs nothing.
    def __init__(self, workers: int = 32, misfire_grace_time: float | None = None) -> None:
        # misfire_grace_time is a parameter only so a test can show what the default would do.
        defaults = dict(JOB_DEFAULTS, misfire_grace_time=misfire_grace_time)
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._aps = BackgroundScheduler(
            timezone=UTC, job_defaults=defaults, executors={"default": self._pool})
        self._lock = threading.Lock()
        # job id -> the one-shot job last armed under it, to arm again if it is skipped
        self._oneshots: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        # job id -> its next run, armed while a run of it was in progress: taken up as that
        # run ends (added to APScheduler then, it would come due while the run holds the job's
        # one instance, and be skipped)
        self._deferred: dict[str, datetime] = {}
        self._in_run: set[str] = set()         # one-shot jobs whose run is in progress
        self._aps.add_listener(self._skipped, EVENT_JOB_MAX_INSTANCES)

    def start(self) -> None:
        self._aps.start()

    def alive(self) -> bool:
        """The scheduler's thread runs (the daemon's watchdog waits on it)."""
        thread = getattr(self._aps, "_thread", None)
        return bool(self._aps.running and thread is not None and thread.is_alive())

    def shutdown(self, wait: bool = True) -> None:
        """Stop; with ``wait``, until the running jobs have returned.

        APScheduler's own wait joins the pool while it holds its job-store lock, so a job that
        adds or cancels a job as it ends (a pull does) would deadlock it: stop without waiting,
        then join the pool here, holding nothing."""
        if self._aps.running:
            self._aps.shutdown(wait=False)
        if wait:
            self._pool.shutdown(wait=True)

    def at(self, when: float | datetime, func: Callable[..., Any], *, job_id: str,
           args: Iterable[Any] = ()) -> None:
        """Run ``func(*args)`` once at ``when`` (at once if already past); replaces ``job_id``."""
        args, run_date = tuple(args), _aware(when)
        with self._lock:
            self._oneshots[job_id] = (func, args)
            if job_id in self._in_run:       # armed by its run, or by another thread meanwhile
                self._deferred[job_id] = run_date
                return
            self._deferred.pop(job_id, None)
        self._add_oneshot(job_id, run_date, func, args)

    def _add_oneshot(self, job_id: str, run_date: datetime, func: Callable[..., Any],
                     args: tuple[Any, ...]) -> None:
        self._aps.add_job(self._run_oneshot, DateTrigger(run_date=run_date, timezone=UTC),
                          args=[job_id, func, *args], id=job_id, name=job_id,
                          replace_existing=True)

    def _run_oneshot(self, job_id: str, func: Callable[..., Any], *args: Any) -> None:
        """Runs the job; then the run it armed for itself: at once, in this same run, if it is
        due already, else added to APScheduler now that nothing of this run is left to do."""
        with self._lock:
            self._in_run.add(job_id)
        while True:
            try:
                func(*args)
            except BaseException:
                self._take_deferred(job_id, inline=False)   # a job that raised keeps its next run
                raise
            again = self._take_deferred(job_id, inline=True)
            if again is None:
                return
            func, args = again

    def _take_deferred(self, job_id: str, inline: bool
                       ) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        """The next run armed while this one ran, as it ends: returned to run now (``inline``
        and due; the run goes on), else added to APScheduler. Added from the run's own thread,
        not from a listener of its end: APScheduler can call that on its own thread, inside the
        loop that then removes the finished one-shot job, the new one with it."""
        with self._lock:
            run_date = self._deferred.pop(job_id, None)
            job = self._oneshots.get(job_id)
            ready = run_date is not None and job is not None and self._aps.running
            if ready and inline and run_date is not None and run_date <= datetime.now(UTC):
                return job
            self._in_run.discard(job_id)
        if ready and run_date is not None and job is not None:
            self._add_oneshot(job_id, run_date, *job)
        return None

    def _skipped(self, event: JobSubmissionEvent) -> None:
        """A one-shot job came due while its previous run still ran and APScheduler dropped it.
        While that run goes on, the run takes it up as it ends; a run that has just ended (its
        instance not yet given back) gets it again a moment later, and again until it is given
        back, since here a job runs however late (the module's docstring)."""
        with self._lock:
            job = self._oneshots.get(event.job_id)
            if job is not None and event.job_id in self._in_run:
                now = datetime.now(UTC)
                self._deferred[event.job_id] = min(self._deferred.get(event.job_id, now), now)
                return
        if job is None or not self._aps.running or self._aps.get_job(event.job_id) is not None:
            return      # an interval job (it runs again anyway), or armed anew meanwhile
        func, args = job
        self.at(datetime.now(UTC) + timedelta(seconds=SKIPPED_RETRY), func, job_id=event.job_id,
                args=args)

    def every(self, seconds: float, func: Callable[..., Any], *, job_id: str,
              first: float | datetime | None = None) -> None:
        """Run ``func()`` every ``seconds``, first at ``first`` (default: one interval from now)."""
        trigger = IntervalTrigger(seconds=seconds, timezone=UTC,
                                  start_date=_aware(first) if first is not None else None)
        self._aps.add_job(func, trigger, id=job_id, name=job_id, replace_existing=True)

    def cancel(self, job_id: str) -> bool:
        """Remove a job; False if there was none."""
        with self._lock:
            self._oneshots.pop(job_id, None)
            deferred = self._deferred.pop(job_id, None) is not None
        try:
            self._aps.remove_job(job_id)
        except JobLookupError:
            return deferred
        return True

    def jobs(self) -> dict[str, float | None]:
        """job id -> next run (POSIX seconds), for status and tests; None while a one-shot job
        runs and its next run isn't armed yet (APScheduler forgets a one-shot job as it starts
        it: a model's job vanished from status for the part of each run before it re-armed)."""
        out: dict[str, float | None] = {
            j.id: (j.next_run_time.timestamp() if j.next_run_time else None)
            for j in self._aps.get_jobs()}
        with self._lock:
            out.update((k, v.timestamp()) for k, v in self._deferred.items())
            for k in self._in_run:
                out.setdefault(k, None)
        return out


def _aware(when: float | datetime) -> datetime:
    """``when`` as an aware datetime; a time past what a datetime holds (a far-future
    publication plus a wave's delay lands after year 9999) is clamped to ``LATEST``: a job
    armed for then never runs, but arming it never raises inside a run that must re-arm."""
    if isinstance(when, datetime):
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    if not when < NEVER:                       # NaN and infinity included
        return LATEST
    return datetime.fromtimestamp(max(when, 0.0), UTC)
