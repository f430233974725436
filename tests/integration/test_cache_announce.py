"""A cache node's daemon names what it holds in `latest` as it starts, not only after a pull: a
`latest` lost (or naming a version gone since) must not send its cluster to the origin."""

from __future__ import annotations

import time

import pytest

from agent.store import Store
from tests.daemon_helpers import start_daemon, stop_daemon, wait_for_socket, write_policy
from tests.unit.test_announce import announced, put_version

pytestmark = pytest.mark.debian


@pytest.mark.parametrize("hostname, expected", [("cache-1", "v2"), ("gpu-1", None)])
def test_a_cache_node_announces_the_newest_version_it_holds_at_start(tmp_path, hostname,
                                                                     expected):
    store = Store(tmp_path / "store")
    store.ensure()
    put_version(store, "m", "v1", b"one", "2026-12-01T00:00:00Z")
    put_version(store, "m", "v2", b"two", "2026-12-02T00:00:00Z")
    policy = write_policy(tmp_path / "policy.yaml", tmp_path,
                          roles={"cache": {"hosts": ["cache-*"]}, "training": {"hosts": ["*"]}},
                          cache_role="cache", models=[{"name": "m"}])
    proc = start_daemon(policy, "--hostname", hostname, log=tmp_path / "daemon.log")
    try:
        wait_for_socket(tmp_path / "control.sock", proc)
        deadline = time.monotonic() + 5
        while expected and announced(store.root, "m") != expected \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert announced(store.root, "m") == expected
    finally:
        stop_daemon(proc)


def test_a_cache_listed_as_an_ordinary_source_polls_past_its_own_announcement(tmp_path):
    """Issue 21 item 8: a cluster policy that lists its cache before the origin without
    `cache: true` (as policies were written before the key existed). The cache node polls its
    own store first, served by its nginx; before, it read its own `latest` there, saw the
    version it held, never asked the origin, and the whole cluster stalled."""
    from tests.pull_helpers import LoopbackNginx, publish

    origin_root = tmp_path / "origin"
    publish(origin_root, "m", "v1", layers=2, hidden=32, shards=1)
    store = Store(tmp_path / "store")
    store.ensure()
    with LoopbackNginx(origin_root) as origin, LoopbackNginx(store.models) as own:
        policy = write_policy(
            tmp_path / "policy.yaml", tmp_path,
            sources=[{"url": own.url}, {"url": origin.url}],
            roles={"cache": {"hosts": ["cache-*"]}, "training": {"hosts": ["*"]}},
            cache_role="cache", models=[{"name": "m"}], poll_interval="1s",
            waves={"spread": "1s", "gap": "1s"})
        log = tmp_path / "daemon.log"
        proc = start_daemon(policy, "--hostname", "cache-1", log=log)
        try:
            wait_for_socket(tmp_path / "control.sock", proc)
            deadline = time.monotonic() + 30
            while announced(store.root, "m") != "v1" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert announced(store.root, "m") == "v1"
            publish(origin_root, "m", "v2", layers=2, hidden=32, shards=1, seed=1)
            deadline = time.monotonic() + 30
            while announced(store.root, "m") != "v2" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert announced(store.root, "m") == "v2"
            text = log.read_text()
            assert "is this node's own announcement" in text
            assert text.count("is this node's own announcement") == 1   # said once, not per poll
        finally:
            stop_daemon(proc)
