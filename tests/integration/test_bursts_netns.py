"""The burst generator between two testbed hosts: each burst acked and timed end to end."""

import pytest

pytestmark = pytest.mark.netns


def test_bursts_are_timed_from_first_byte_to_ack(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="200mbit")
    flow = testbed.bursts(origin, node, server=link.a.ip4, port=40123, size=5 * 10**6,
                          gap=0.2, count=4)
    bursts = flow.result()
    assert [b.index for b in bursts] == [0, 1, 2, 3]
    # 5 MB over 200 Mbit/s take at least 0.2 s; loosely, none takes more than a second.
    assert all(0.19 < b.seconds < 1.0 for b in bursts), bursts
    gaps = [b.started - (a.started + a.seconds) for a, b in zip(bursts[:-1], bursts[1:],
                                                                strict=True)]
    assert all(g >= 0.19 for g in gaps), gaps
