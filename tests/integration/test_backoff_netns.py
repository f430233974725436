"""The backoff loop on a real node: real /proc and sock_diag in a namespace, a real iperf3 flow."""

import json
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.debian]

# Runs inside the node: the loop on its thread, as the daemon runs it; prints its history.
LOOP = """
import json, sys, time
from agent.policy_model import Backoff
from shaping.backoff import BackoffLoop
from shaping.controller import Controller
from shaping.detect import Detectors
b = Backoff(tick=0.1, floor=10**7, quiet=0.5, increase=10**9, nccl_processes=False)
loop = BackoffLoop(Controller(b, 10**9), Detectors.from_policy(b, link=False),
                   set_pull_rate=lambda bps: None, tick=0.1).start()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
loop.stop()
print(json.dumps([[a.at, a.state, a.rate_bps, a.reason] for a in loop.history]), flush=True)
"""


def test_training_connection_backs_off_within_a_tick_and_ramps_back(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="200mbit")
    testbed.iperf3_server(origin, port=29500)
    loop = node.popen([sys.executable, "-c", LOOP, "5"], stdout=subprocess.PIPE, text=True)
    assert loop.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    started = time.monotonic()
    flow = testbed.iperf3(node, server=link.a.ip4, port=29500, seconds=2, reverse=True)
    ended = time.monotonic()
    out, _ = loop.communicate(timeout=30)
    history = json.loads(out.strip().splitlines()[-1])
    assert flow.bps > 100e6
    assert all(state == "full" for at, state, _, _ in history if at < started)
    first = next(h for h in history if h[1] == "backed_off")
    assert first[0] - started < 0.5, "backed off more than half a second after the flow began"
    assert first[2] == 10**7
    assert "training " in first[3] and "port 29500" in first[3]
    assert f"{link.a.ip4}:29500" in first[3]
    # Quiet 0.5 s after the flow's connections closed, then one step back to the cap.
    back = next(h for h in history if h[0] > first[0] and h[1] == "full")
    assert back[2] == 10**9 and back[0] - ended < 1.5


# `wagent pull --policy P` glue: shaping applied for the pull's length, the loop moving both sides.
PULL_GLUE = """
import json, subprocess, sys, time
from agent.policy_model import Backoff, Policy, Shaping, Source
from agent.ratelimit import TokenBucket
from shaping.backoff import pull_backoff
ifname, state = sys.argv[1], sys.argv[2]
policy = Policy(shaping=Shaping(enabled=True, interfaces=(ifname,), link_rate=10**9,
                                ceil=5 * 10**8),
                backoff=Backoff(tick=0.1, nccl_processes=False), state_dir=state)
bucket = TokenBucket(None)
qdiscs = lambda: subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
with pull_backoff(policy, bucket, sources=[Source("http://10.9.9.9:8080")]) as loop:
    time.sleep(0.5)
    during = {"status": loop.status(), "rate": bucket.rate, "qdiscs": qdiscs()}
print(json.dumps({"during": during, "after": qdiscs()}))
"""


def test_pull_glue_applies_shaping_for_the_pull_and_clears_it(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node)
    state = testbed.tmpdir("state")
    before = node.run(["tc", "qdisc", "show"]).stdout
    out = node.run([sys.executable, "-c", PULL_GLUE, link.b.ifname, str(state)]).stdout
    res = json.loads(out.strip().splitlines()[-1])
    status = res["during"]["status"]
    assert status["state"] == "full" and status["rate_bps"] == 5 * 10**8
    assert res["during"]["rate"] == 5 * 10**8                      # the bucket got the cap
    assert "wg-" in res["during"]["qdiscs"] and "htb 5747:" in res["during"]["qdiscs"]
    assert res["after"] == before                                  # a tree it made: cleared
