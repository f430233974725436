import json
from dataclasses import replace

from agent.status import (
    EXIT_DEGRADED,
    EXIT_HEALTHY,
    SCHEMA,
    BackoffEvent,
    BackoffInfo,
    ClassCounters,
    DaemonState,
    NodeInfo,
    PolicyInfo,
    PullInfo,
    ShapedInterface,
    ShapingInfo,
    StoreInfo,
    TickSummary,
    WindowInfo,
    exit_code,
    one_line,
    to_json,
    to_text,
)

NOW = 1_000_000.0


def busy_state(**over):
    base = dict(
        pid=42, started_at=NOW - 3600, version="0.1.0",
        workers={"scheduler": True, "backoff": True, "control": True},
        jobs={"model:llama": NOW + 30, "shaping-verify": NOW + 5, "metrics": None},
        node=NodeInfo(id="gpu-a1", hostname="gpu-a1", role="training", wave_index=2,
                      wave_delay=3600.0),
        policy=PolicyInfo(path="/etc/wagent/policy.yaml", sha256="ab" * 32, loaded_at=NOW - 60),
        shaping=ShapingInfo(
            enabled=True, policy_ceil_bps=500_000_000, current_ceil_bps=10_000_000,
            interfaces=(ShapedInterface("eth0", "ingress", "wagent-ifb0", (
                ClassCounters("distribution", "1:10", bytes=10**9, packets=700_000, drops=12,
                              overlimits=30, rate_bps=10**7, ceil_bps=10**7),
                ClassCounters("default", "1:20", bytes=5 * 10**9)),),)),
        backoff=BackoffInfo(
            enabled=True, state="backed_off", reason="NCCL traffic", since=NOW - 20,
            rate_bps=10_000_000, floor_bps=10_000_000, cap_bps=500_000_000,
            events=(BackoffEvent(NOW - 20, "backed_off", "NCCL traffic", 10_000_000),),
            readings={"other_bps": 9.1e8, "rdma_bps": 0.0}, yielded_s=20.0,
            idle_bytes=2 * 10**9, pulled_bytes=6 * 10**6, bursts=40),
        pulls=(PullInfo("llama3-70b", "v3", "pulling", bytes_done=41, bytes_total=100,
                        rate_bps=480e6, streams=8, slot_at=NOW - 100, started_at=NOW - 90,
                        local_version="v2"),),
        window=WindowInfo(open=True, closes_at=NOW + 600),
        store=StoreInfo("/var/cache/wagent", used_bytes=2 * 2**30, versions=2,
                        free_bytes=10 * 2**30),
    )
    base.update(over)
    return DaemonState(**base)


def test_schema_fields_and_healthy():
    doc = to_json(busy_state(), NOW)
    assert doc["schema"] == SCHEMA == 1
    assert doc["running"] is True
    assert set(doc) == {"schema", "running", "generated_at", "health", "problems", "daemon", "node",
                        "policy", "shaping", "backoff", "pulls", "window", "store", "mounts",
                        "peers"}
    assert doc["health"] == "healthy" and exit_code(doc) == EXIT_HEALTHY
    assert doc["daemon"]["uptime_s"] == 3600
    assert doc["daemon"]["jobs"] == [{"id": "metrics", "next_run_at": None},
                                     {"id": "model:llama", "next_run_at": NOW + 30},
                                     {"id": "shaping-verify", "next_run_at": NOW + 5}]
    p = doc["pulls"][0]
    assert p["percent"] == 41.0
    assert p["eta_s"] == 59 * 8 / 480e6
    assert doc["shaping"]["interfaces"][0]["classes"][0]["drops"] == 12
    b = doc["backoff"]
    assert (b["yielded_s"], b["bursts"], b["idle_used"]) == (20.0, 40, 0.003)
    assert to_json(busy_state(backoff=BackoffInfo(enabled=True)), NOW)["backoff"][
        "idle_used"] is None                      # nothing yielded yet: no share to give
    json.dumps(doc)  # serialisable as is


def test_one_line_like_the_issue_says():
    busy = busy_state()
    busy_line = TickSummary(pulls=busy.pulls, backoff_state="backed_off",
                            backoff_reason="NCCL traffic")
    assert one_line(busy_line) == \
        "pulling llama3-70b v3 41% at 480 Mbit/s; backed off: NCCL traffic"
    assert one_line(TickSummary(backoff_state="full")) == "idle"
    waiting = PullInfo("m", "v2", "waiting_window")
    assert one_line(TickSummary(paused=True, pulls=(waiting,), backoff_state="ramping",
                                reload_refused=True)) == \
        "paused; waiting for window: m v2; ramping up; reload refused (see wagent status)"


def test_refused_reload_is_degraded_and_shown():
    err = "/etc/wagent/policy.yaml:12: shaping.ceil: bad rate 'fast'"
    st = busy_state(policy=PolicyInfo(path="/etc/wagent/policy.yaml", sha256="ab" * 32,
                                      loaded_at=NOW - 60, last_error=err, last_error_at=NOW - 5))
    doc = to_json(st, NOW)
    assert doc["health"] == "degraded" and exit_code(doc) == EXIT_DEGRADED
    assert doc["policy"]["last_error"] == err
    text = to_text(doc)
    assert err in text and "previous policy" in text


def test_dead_worker_is_degraded():
    doc = to_json(busy_state(workers={"scheduler": False, "backoff": True}), NOW)
    assert doc["health"] == "degraded"
    assert doc["problems"] == ["worker thread 'scheduler' is not running"]


def test_text_covers_every_section():
    text = to_text(to_json(busy_state(), NOW))
    for needle in ("gpu-a1", "role training", "wave 2", "sha256 abababababab", "eth0 ingress",
                   "12 drops", "backed_off (NCCL traffic)", "llama3-70b v3: pulling", "41%",
                   "8 streams", "ETA", "window:   open", "2 GiB in 2 versions"):
        assert needle in text, needle


def test_minimal_state_renders():
    doc = to_json(DaemonState(pid=1, started_at=NOW, version="x"), NOW)
    assert "shaping:  off" in to_text(doc)
    assert doc["pulls"] == [] and doc["pulls"] is not None


class TickApp:
    """The Application's tick-side interface; counts the status documents built for it."""

    def __init__(self, fail_summaries: int = 0) -> None:
        self.fail_summaries = fail_summaries
        self.snapshots = 0
        self.summaries = 0

    def workers(self, parts): return {"scheduler": True, "backoff": False}
    def error_counts(self, parts): return {}

    def snapshot(self, parts, base):       # the whole document: netlink dumps, a store scan
        self.snapshots += 1
        return base

    def tick_summary(self, parts, base):
        self.summaries += 1
        if self.summaries <= self.fail_summaries:
            raise OSError("a part's state could not be read")
        return replace(base, pulls=(PullInfo("m", "v1", "pulling", 1, 4, rate_bps=8e6),))


def test_a_tick_that_failed_once_does_not_degrade_status_forever():
    from agent.daemon import Daemon
    from agent.notify import Notifier

    d = Daemon(TickApp(fail_summaries=1), Notifier(lambda _m: None), hard_exit=None)
    d.parts = {}
    d.tick()
    assert d.status()["problems"] == [
        "worker thread 'backoff' is not running",
        "reading the daemon's summary failed: a part's state could not be read"]
    d.tick()                            # it works again: the count stays
    doc = d.status()
    assert doc["problems"] == ["worker thread 'backoff' is not running"]
    assert doc["daemon"]["error_counts"] == {"status": 1}


def test_the_tick_reads_the_summary_never_the_status_document(caplog):
    """Every second: the workers and the STATUS= line from the parts' memory. The document
    (netlink dumps of every tc class, a walk of the store) is built only when asked for."""
    from agent.daemon import Daemon
    from agent.notify import Notifier

    app, sent = TickApp(), []
    d = Daemon(app, Notifier(sent.append), hard_exit=None)
    d.parts = {}
    for _ in range(3):
        d.tick()
    assert (app.summaries, app.snapshots) == (3, 0)
    assert sent == ["STATUS=pulling m v1 25% at 8 Mbit/s"]      # sent once: unchanged since
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "worker thread backoff died; withholding the watchdog so systemd restarts the daemon"]
    d.status()                          # `wagent status`: the whole document, once
    assert (app.summaries, app.snapshots) == (3, 1)


def test_mounts_in_the_document_and_the_text():
    mounts = {"serving": True, "reads": 9, "read_errors": 1, "bytes_read": 10, "waiting": 2,
              "wanted": 3, "errors": [{"at": NOW, "error": "m@v1/a: bytes 0+4 not verified"}],
              "mounts": [{"model": "m", "version": "v1", "dirs": ["/models/m"], "since": NOW,
                          "bytes_total": 200, "bytes_verified": 50, "complete": False,
                          "pull": "pulling", "from": "fuse"},
                         {"model": "n", "version": "v2", "dirs": ["/models/n"], "since": NOW,
                          "bytes_total": 9, "bytes_verified": 9, "complete": True,
                          "pull": "idle", "from": "store"}]}
    doc = to_json(busy_state(mounts=mounts), NOW)
    assert doc["mounts"] == mounts
    text = to_text(doc)
    assert "mount:    m@v1 at /models/m: 25% verified\n" in text
    assert "mount:    n@v2 at /models/n: complete (bound from the store)" in text
    assert "2 reads waiting" in text and "last read error: m@v1/a" in text
    # none: the document still says so
    assert to_json(busy_state(), NOW)["mounts"]["mounts"] == []
