"""The daemon's main loop in-process with a stand-in application: the watchdog is withheld
once a worker thread dies (so systemd restarts the daemon), and status says which one."""

import threading
import time

import pytest

from agent.control import ControlError
from agent.daemon import Daemon
from agent.notify import Notifier
from agent.policy.model import Policy

pytestmark = pytest.mark.debian


class StandIn:
    """The Application's interface with nothing behind it."""

    def __init__(self):
        self.alive = {"scheduler": True, "backoff": True}
        self.stopped = False
        self.loads = []

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
        return dict(self.alive)

    def error_counts(self, parts):
        return {"pull": 2}

    def supervise(self, parts):
        pass

    def snapshot(self, parts, base):
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
    deadline = time.monotonic() + 5
    while "READY=1" not in sent and time.monotonic() < deadline:
        time.sleep(0.01)
    return d, t


def test_watchdog_stops_when_a_worker_dies():
    app, sent = StandIn(), []
    d, t = run_daemon(app, sent)
    try:
        time.sleep(0.3)
        assert sent.count("WATCHDOG=1") >= 3
        app.alive["scheduler"] = False
        time.sleep(0.15)
        n = sent.count("WATCHDOG=1")
        time.sleep(0.4)
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
