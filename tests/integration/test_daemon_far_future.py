"""A publisher's far-future `published` (issue 21, item 1): the real daemon waits for that
version's slot without losing its model's job, keeps polling `latest`, and pulls the next good
version as soon as `latest` names it. Before, arming the job for a slot after year 9999 raised
inside APScheduler: `model:m` left `daemon.jobs`, status stayed healthy, and the node never
polled that model again until a reload."""

from __future__ import annotations

import json
import time

import pytest

from agent import manifest
from tests.daemon_helpers import start_daemon, stop_daemon, wagent, wait_for_socket, write_policy
from tests.pull_helpers import LoopbackNginx

pytestmark = pytest.mark.debian

FAR = 253402300799.0             # 9999-12-31T23:59:59Z


def stage(origin, version: str, published: float, seed: int) -> None:
    from tests import modelgen
    d = origin / "m" / version
    modelgen.generate(d, layers=2, hidden=32, shards=1, seed=seed)
    manifest.write(d, manifest.build(d, clock=lambda: published))
    (origin / "m" / "latest").write_text(version + "\n")


def status(sock) -> tuple[int, dict]:
    r = wagent("status", "--json", "--socket", str(sock))
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("windows", [None, [{"cron": "* * * * *", "duration": "1m"}]])
def test_a_far_future_version_waits_and_the_next_one_is_pulled(tmp_path, windows):
    origin = tmp_path / "origin"
    stage(origin, "v9", FAR, seed=1)
    sock = tmp_path / "control.sock"
    role = {"hosts": ["*"]} | ({"windows": windows} if windows else {})
    with LoopbackNginx(origin) as ng:
        policy = write_policy(tmp_path / "policy.yaml", tmp_path, sources=[{"url": ng.url}],
                              models=[{"name": "m"}], poll_interval="1s",
                              roles={"training": role},
                              waves={"spread": "1s", "gap": "1s", "cache_lead": "0s"})
        proc = start_daemon(policy, log=tmp_path / "daemon.log")
        try:
            wait_for_socket(sock, proc)
            deadline = time.monotonic() + 20
            while True:
                rc, doc = status(sock)
                (pull,) = doc["pulls"]
                if pull["state"] == "waiting_slot" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert pull["state"] == "waiting_slot" and pull["version"] == "v9", doc
            time.sleep(2)                                   # a few polls later
            rc, doc = status(sock)
            assert rc == 0 and doc["health"] == "healthy", doc
            assert "model:m" in [j["id"] for j in doc["daemon"]["jobs"]], doc["daemon"]
            stage(origin, "v2", time.time() - 3600, seed=2)  # a good version
            deadline = time.monotonic() + 30
            while True:
                rc, doc = status(sock)
                (pull,) = doc["pulls"]
                if (pull["state"], pull["version"]) == ("done", "v2") \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert (pull["state"], pull["version"]) == ("done", "v2"), doc
        finally:
            stop_daemon(proc)
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()
