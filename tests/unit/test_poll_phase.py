"""When a node polls a model's `latest`: at a phase of the poll interval hashed from its id, so
that the plan (and an operator) knows it, and a fleet restarted at once spreads its polls."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from agent.schedule import first_poll, next_poll, poll_after, poll_fraction, poll_phase

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()


def test_the_phase_is_the_hash_of_the_node_and_the_model():
    digest = hashlib.sha256(b"poll|node-1|llama").digest()
    frac = int.from_bytes(digest[:8], "big") / 2**64
    assert poll_fraction("node-1", "llama") == frac
    assert poll_phase("node-1", "llama", 60.0) == 60.0 * frac
    assert poll_phase("node-1", "llama", 60.0) != poll_phase("node-1", "mistral", 60.0)
    assert poll_phase("node-1", "llama", 60.0) != poll_phase("node-2", "llama", 60.0)


def test_a_fleet_restarted_at_once_spreads_its_polls_over_the_interval():
    fracs = sorted(poll_fraction(f"gpu-{i}", "llama") for i in range(10_000))
    assert 0.0 <= fracs[0] and fracs[-1] < 1.0
    assert sum(fracs) / len(fracs) == pytest.approx(0.5, abs=0.01)
    # no tenth of the interval holds much more than a tenth of the fleet
    tenths = [sum(1 for f in fracs if k / 10 <= f < (k + 1) / 10) for k in range(10)]
    assert max(tenths) < 1100


def test_the_next_poll_is_on_the_nodes_phase():
    interval = 300.0
    phase = poll_phase("node-1", "llama", interval)
    for after in (T0, T0 + 17.5, T0 + 299.9, T0 + 3600.0):
        at = next_poll(after, "node-1", "llama", interval)
        assert after <= at < after + interval
        k = (at - phase) / interval
        assert k == pytest.approx(round(k), abs=1e-9)


def test_a_time_on_a_poll_time_is_that_poll():
    interval = 1.0
    phase = poll_phase("node-1", "llama", interval)
    on = phase + 1_790_000_000 * interval          # a poll time at an epoch-scale time
    assert next_poll(on, "node-1", "llama", interval) == on
    assert next_poll(on + 1e-3, "node-1", "llama", interval) == pytest.approx(on + 1.0)
    assert next_poll(on - 1e-3, "node-1", "llama", interval) == pytest.approx(on)
    # once polled at a poll time, the next poll is the one after it
    assert poll_after(on, "node-1", "llama", interval) == pytest.approx(on + 1.0)
    assert poll_after(on - 1e-3, "node-1", "llama", interval) == pytest.approx(on)
    # float rounding of the poll time itself doesn't make it the previous or the next one
    for nudge in (-2e-7, 2e-7):
        assert first_poll(on + nudge, phase, interval) == pytest.approx(on, abs=1e-6)


def test_an_interval_of_zero_polls_at_every_moment():
    assert poll_phase("node-1", "llama", 0.0) == 0.0
    assert next_poll(T0 + 0.25, "node-1", "llama", 0.0) == T0 + 0.25
    assert poll_after(T0 + 0.25, "node-1", "llama", 0.0) == T0 + 0.25
    assert first_poll(5.0, 0.0, 0.0) == 5.0


def test_a_tiny_interval_still_moves_forward():
    interval = 1e-3
    at = next_poll(T0, "node-1", "llama", interval)
    assert T0 <= at < T0 + interval + 1e-6
    assert poll_after(at, "node-1", "llama", interval) > at
