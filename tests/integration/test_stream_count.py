"""Adaptive stream count on the testbed (issue 25): behind a cap per connection the pull adds
streams while each carries its share; on a path that two streams fill it stays at two or
three. Counts asserted loosely: the scaling bench has the figures."""

from __future__ import annotations

import pytest

from tests import modelgen
from tests.bench.scaling import per_flow_classes
from tests.pull_helpers import publish_dir, pull_in

pytestmark = pytest.mark.netns

PER_CONN = 40_000_000            # bits/s: 5 MB/s per connection
LINK = 10 * PER_CONN             # ten connections fill the link


def _origin(testbed, size: int, capped: bool):
    d = testbed.tmpdir("origin")
    version = d / "m" / "v1"
    modelgen.generate_sized(version, size, shards=8)
    publish_dir(version, piece_size=1 << 20)
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate=LINK)
    if capped:
        node.sysctl(**{"net.ipv4.ip_local_port_range": "40000 40255"})
        origin.run(["tc", "-batch", "-"], input=per_flow_classes(link.a.ifname, PER_CONN, LINK))
    srv = testbed.nginx(origin, root=d, port=8080)
    return node, f"{srv.url_for(link.a)}/m/v1", size


def test_the_count_grows_behind_a_cap_per_connection(testbed):
    node, url, size = _origin(testbed, 192 << 20, capped=True)
    r = pull_in(node, url, testbed.tmpdir("store"), streams=8, adaptive=True)
    assert r["fetched"] == r["total"]
    print(r["streams"], r["streams_why"], f"{r['seconds']:.1f} s")
    assert r["streams"][0] == 2 and max(r["streams"]) >= 6, r


def test_the_count_stays_small_where_two_streams_fill_the_path(testbed):
    node, url, size = _origin(testbed, 96 << 20, capped=False)
    r = pull_in(node, url, testbed.tmpdir("store"), streams=8, adaptive=True)
    assert r["fetched"] == r["total"]
    print(r["streams"], r["streams_why"], f"{r['seconds']:.1f} s")
    assert max(r["streams"]) <= 4, r
