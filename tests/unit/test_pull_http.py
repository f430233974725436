"""The bounded gzip decoder of small documents (agent.pull.small_body) and the deadlines'
defaults (no network here: the HTTP side is tested against real servers in
tests/integration/test_pull_hostile.py)."""

import gzip
import zlib

import pytest

from agent.pull.deadlines import Timeouts
from agent.pull.small_body import Inflater


def test_members_follow_one_another_and_both_headers_are_read():
    data = gzip.compress(b"abc") + gzip.compress(b"def")
    inf = Inflater()
    assert inf.feed(data[:7], 100) + inf.feed(data[7:], 100) == b"abcdef"
    assert not inf.truncated
    assert Inflater().feed(zlib.compress(b"deflate"), 100) == b"deflate"


def test_the_output_never_exceeds_the_room_asked_for():
    bomb = gzip.compress(bytes(50 * 2**20), 9)          # 50 KB that inflates to 50 MiB
    inf = Inflater()
    out = inf.feed(bomb, 1001)
    assert len(out) == 1001


def test_a_stream_cut_short_or_garbled_is_told():
    data = gzip.compress(b"x" * 1000)
    inf = Inflater()
    inf.feed(data[:-10], 10_000)
    assert inf.truncated
    with pytest.raises(zlib.error):
        Inflater().feed(b"\x1f\x8bnot gzip at all", 100)


def test_default_deadlines_follow_the_timeouts():
    t = Timeouts(connect=10, read=30)
    assert t.headers_deadline == 40
    assert t.small_body_deadline(2 * 2**20) == 38
    assert Timeouts(headers=1.5).headers_deadline == 1.5
