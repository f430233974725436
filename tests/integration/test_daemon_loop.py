"""The daemon's main loop in-process with a stand-in application: the watchdog is withheld
once a worker thread dies (so systemd restarts the daemon), and status says which one."""

import threading
import time

import pytest

from agent.control import ControlError
from agent.daemon import Daemon
from agent.notify import Notifier
from agent.policy.model import Policy
from tests.waiting import wait_for

pytestmark = pytest.mark.debian


class StandIn:
    """The Application's interface with nothing behind it."""

    def __init__(self):
        self.alive = {"scheduler": True, "backoff": True}
        self.stopped = False
        self.loads = []
        self.asked = []          # (when, what workers() answered): the daemon's every look

    def start(self, policy, controls):
        return {"policy": policy}

    def stop(self, parts, budget):
        self.stopped = True

    def load(self):
        if self.loads:
            raise self.loads.pop(0)
        return Policy(path="/p.yaml", sha256="b" * 64)

    def reconcile(self, parts, new):
        return {"policy": new}

    def workers(self, parts):
        answer = dict(self.alive)
        self.asked.append((time.monotonic(), answer))
        return answer

    def error_counts(self, parts):
        return {"pull": 2}

    def supervise(self, parts):
        pass

    def snapshot(self, parts, base):
        return base

    def tick_summary(self, parts, base):
        return base

    def export_metrics(self, parts, state):
        pass

    def pause(self, parts):
        pass

    def resume(self, parts):
        pass


def run_daemon(app, sent):
    d = Daemon(app, Notifier(sent.append), watchdog_interval=0.05)
    t = threading.Thread(target=d.run, args=(Policy(path="/p.yaml", sha256="a" * 64),))
    t.start()
    assert wait_for(lambda: "READY=1" in sent)
    return d, t


def test_watchdog_stops_when_a_worker_dies():
    app, sent = StandIn(), []
    d, t = run_daemon(app, sent)
    interval = d.gate.interval
    try:
        assert wait_for(lambda: sent.count("WATCHDOG=1") >= 3)
        app.alive["scheduler"] = False
        # Once the main loop has been told, a ping decided on an earlier answer has gone out
        # (one thread asks, pings, then asks again).
        assert wait_for(lambda: any(not a["scheduler"] for _, a in app.asked))
        n = sent.count("WATCHDOG=1")
        seen = next(when for when, a in app.asked if not a["scheduler"])
        # The loop keeps looking, for four watchdog intervals, and pings no more.
        assert wait_for(lambda: app.asked[-1][0] > seen + 4 * interval)
        assert sent.count("WATCHDOG=1") == n      # withheld: systemd will restart us
        doc = d.status()
        assert doc["health"] == "degraded"
        assert "worker thread 'scheduler' is not running" in doc["problems"]
    finally:
        d.request_stop()
        t.join(5)
    assert app.stopped and sent[-2:] == ["STOPPING=1", "STATUS=stopping"]


def test_reload_from_another_thread_is_answered_by_the_loop():
    from agent.policy import Issue, PolicyError

    app, sent = StandIn(), []
    d, t = run_daemon(app, sent)
    try:
        assert d.reload()["sha256"] == "b" * 64
        app.loads.append(PolicyError([Issue("/p.yaml", 3, "unknown key 'x'")]))
        try:
            d.reload()
        except ControlError as e:
            assert e.kind == "refused" and "/p.yaml:3: unknown key 'x'" in str(e)
        else:
            raise AssertionError("a bad policy must be refused")
        doc = d.status()
        assert doc["policy"]["last_error"] == "/p.yaml:3: unknown key 'x'"
        assert doc["policy"]["sha256"] == "b" * 64 and doc["policy"]["reloads"] == 1
        assert doc["daemon"]["error_counts"] == {"pull": 2, "reload": 1}
        assert sum(m.startswith("RELOADING=1") for m in sent) == 2
    finally:
        d.request_stop()
        t.join(5)
