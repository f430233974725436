"""Periodic bursts anticipated (agent/yielding/rhythm.py), and the gate that uses it."""

from __future__ import annotations

import struct

from agent.policy.model import Backoff
from agent.yielding.bursts import BurstGate, rhythm_for, settings_for
from agent.yielding.rhythm import AHEAD, KEEP, Rhythm
from shaping import bpf

MS = 1_000_000


def steady(period_ms: float, n: int = KEEP, jitter_ms: float = 0.0) -> Rhythm:
    r = Rhythm(lead_ns=3 * MS, grace_ns=2 * MS)
    for k in range(1, n + 1):
        r.see(int((k * period_ms + (jitter_ms if k % 2 else -jitter_ms)) * MS))
    return r


def test_a_steady_period_is_anticipated_from_lead_before_until_grace_after():
    r = steady(120)
    due = 6 * 120 * MS
    assert r.period_ns() == 120 * MS
    assert r.wait_ns(due - 3 * MS - 1) == 0
    assert r.wait_ns(due - 3 * MS) == 5 * MS
    assert r.wait_ns(due + 2 * MS) == 0                       # none came: undone
    assert r.anticipated == 1


def test_a_start_seen_many_times_counts_once_and_none_before_enough():
    r = Rhythm(lead_ns=MS, grace_ns=MS)
    for k in range(1, KEEP):
        for _ in range(3):
            r.see(k * 100 * MS)
    assert len(r.starts) == KEEP - 1 and r.period_ns() is None
    assert r.wait_ns(KEEP * 100 * MS) == 0


def test_irregular_bursts_are_not_anticipated():
    assert steady(120, jitter_ms=8).period_ns() is None       # 16 ms swings: > 10%
    assert steady(120, jitter_ms=3).period_ns() is not None   # within 10%: the spread widens
    r = steady(120, jitter_ms=3)
    due = 6 * 120 * MS + 3 * MS                               # the last start came 3 ms late
    assert r.wait_ns(due - 3 * MS - 6 * MS) > 0               # lead + the gaps' spread
    assert steady(2).period_ns() is None                      # faster than MIN_PERIOD


def test_bursts_that_stopped_cost_at_most_ahead_leads():
    r = steady(100)
    last = KEEP * 100 * MS
    held = [r.wait_ns(last + k * 100 * MS) for k in range(1, AHEAD + 3)]
    assert all(held[:AHEAD]) and not any(held[AHEAD:])


def test_the_gate_holds_for_a_due_burst_before_the_detector_sees_it():
    buf = bytearray(bpf.VALUE_SIZE)
    now = [0]
    gate = BurstGate(memoryview(buf), floor=lambda: 1, clock_ns=lambda: now[0],
                     rhythm=Rhythm(lead_ns=3 * MS, grace_ns=2 * MS))
    for k in range(1, KEEP + 1):                              # the detector's cuts, one by one
        struct.pack_into("=Q", buf, bpf.CUT_START, k * 120 * MS)
        struct.pack_into("=Q", buf, bpf.CUT_UNTIL, k * 120 * MS + 30 * MS)
        now[0] = k * 120 * MS + 10 * MS
        assert gate.hold(10**9) == 0.02                       # the cut itself
    now[0] = 6 * 120 * MS - 2 * MS
    assert gate.hold(10**9) == 0.004                          # due in 2 ms: held until +2 ms
    assert gate.rhythm.anticipated == 1


def test_the_lead_covers_the_bucket_filling_and_the_windows_draining():
    s = settings_for(Backoff().resolved(10**9))
    r = rhythm_for(s, 10**9, 120_000)
    assert r.lead_ns == 1_000_000 + 524_288 + 960_000         # 1 ms + 64 KiB + 120 kB at 1G
    assert rhythm_for(s, 100 * 10**9, 120_000).lead_ns < 1_100_000
