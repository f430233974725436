"""`wagent pull` on the testbed: an nginx origin in one namespace, the node in another."""

import threading
import time

import pytest

from agent.policy.model import Source
from agent.pull.connections import Connections
from agent.pull.engine import PullOptions, PullStopped, pull_version
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket
from tests.pull_helpers import LoopbackNginx, publish
from tests.testbed import WAGENT

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()


@pytest.mark.netns
@pytest.mark.debian
def test_cli_pull_over_a_link_then_latest_again(testbed, tmp_path):
    publish(tmp_path / "origin", "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="200mbit")
    srv = testbed.nginx(origin, root=tmp_path / "origin", port=8080)
    store = testbed.tmpdir("store")
    url = f"{srv.url_for(link.a)}/m/latest"
    out = node.run([WAGENT, "pull", url, "--store", str(store), "--streams", "4"], timeout=120)
    assert "m/v1:" in out.stderr and "verified" in out.stderr     # one line per file, no TTY
    sent = srv.bytes_sent("/m/v1/")
    again = node.run([WAGENT, "pull", url, "--store", str(store)], timeout=120)
    assert "0 B fetched" in again.stderr
    assert srv.bytes_sent("/m/v1/") == sent            # installed: not even the manifest
    bad = node.run([WAGENT, "pull", f"{srv.url_for(link.a)}/m/v9", "--store", str(store)],
                   check=False, timeout=120)
    assert bad.returncode == 1 and "HTTP 404" in bad.stderr


@pytest.mark.debian
def test_rate_cap_and_stop_keep_partials_for_the_next_pull(tmp_path):
    origin = tmp_path / "origin"
    publish(origin, "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    store = Store(tmp_path / "store")
    bucket = TokenBucket(24_000_000)                        # 3 MB/s, shared by both streams
    stop = threading.Event()
    result = {}
    seen = []

    def run():
        try:
            pull_version([Source(ng.url)], "m", "v1", store, bucket=bucket, stop=stop,
                         options=PullOptions(streams=2), progress=seen.append,
                         connections=CONNECTIONS)
        except PullStopped as e:
            result["stopped"] = e

    with LoopbackNginx(origin) as ng:
        t = threading.Thread(target=run)
        started = time.monotonic()
        t.start()
        time.sleep(1.0)
        stop.set()
        t.join(5)
        assert "stopped" in result and not t.is_alive()
        sent = files_sent(ng)
        took = time.monotonic() - started
        received = max(p.bytes_fetched for p in seen)
        assert 2e6 < received / took < 3e6 * 1.1            # the cap held (plus a chunk each)
        assert list(store.partial.glob("*.journal"))
        bucket.set_rate(None)
        r = pull_version([Source(ng.url)], "m", "v1", store, bucket=bucket,
                         options=PullOptions(streams=2), connections=CONNECTIONS)
        assert r.bytes_fetched < r.bytes_total              # the first pull's pieces were kept
        assert files_sent(ng) - sent == r.bytes_fetched


def files_sent(ng):
    return ng.bytes_sent("/m/v1/") - ng.bytes_sent("/m/v1/manifest.json")
