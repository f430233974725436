"""`wagent plan`: the simulation agrees with the schedule's formula and a brute-force count."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.waves import parse_shares, share_nodes
from agent.fleet.waves import simulate_waves as simulate
from agent.policy import load_policy
from agent.schedule import start_at

POLICIES = Path(__file__).resolve().parents[2] / "policies"
PUBLISHED = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()   # Wednesday noon


def test_plan_matches_the_formula_and_brute_force():
    policy = load_policy(POLICIES / "fleet.example.yaml")
    counts = {"cache": 3, "inference": 60, "evaluation": 20, "training": 117}
    plan = simulate(policy, counts, PUBLISHED, 600.0, "m", "v1")
    assert [w.role for w in plan.waves] == ["cache", "inference", "evaluation", "training"]
    serial, intervals = 0, []
    for w in plan.waves:
        starts = []
        for _ in range(counts[w.role]):
            starts.append(start_at(PUBLISHED, PUBLISHED, f"node-{serial:06d}", w.role, "m", "v1",
                                   policy))
            serial += 1
        assert w.nodes == counts[w.role]
        assert w.first_start == pytest.approx(min(starts))
        assert w.last_start == pytest.approx(max(starts))
        # no window closes within 10 minutes of these starts: one interval each
        wave = [(s, s + 600.0) for s in starts]
        assert w.peak == max(sum(a <= t < b for a, b in wave) for t, _ in wave)
        intervals += wave
    assert plan.peak == max(sum(a <= t < b for a, b in intervals) for t, _ in intervals)
    training = plan.waves[-1]
    night = datetime(2026, 12, 2, 22, 0, tzinfo=UTC).timestamp()
    assert night <= training.first_start and training.last_start < night + 1200


def test_a_pull_pauses_at_the_window_end():
    policy = load_policy(POLICIES / "fleet.example.yaml")
    # Published Thursday 05:00: training slots at ~06:10, after the night window closed;
    # they start Thursday 22:00 + offset. A 9 h pull runs into Friday 06:00, pauses, and
    # finishes after Friday 22:00, which then runs into the weekend.
    published = datetime(2026, 12, 3, 5, 0, tzinfo=UTC).timestamp()
    plan = simulate(policy, {"training": 50}, published, 9 * 3600.0, "m", "v1")
    w = plan.waves[0]
    assert w.first_start >= datetime(2026, 12, 3, 22, 0, tzinfo=UTC).timestamp()
    assert w.last_end > datetime(2026, 12, 4, 22, 0, tzinfo=UTC).timestamp()


def test_share_nodes_adds_up():
    counts = share_nodes(100_001, {"inference": 0.3, "evaluation": 0.1, "training": 0.6})
    assert sum(counts.values()) == 100_001
    assert counts["training"] in (60_000, 60_001)
    assert share_nodes(3, {"a": 1, "b": 1, "c": 0}) in ({"a": 2, "b": 1, "c": 0},
                                                         {"a": 1, "b": 2, "c": 0})


@pytest.mark.parametrize("text", ["inference", "a=x", "=0.3", "a=-1", "a=0"])
def test_parse_shares_errors(text):
    with pytest.raises(ValueError):
        parse_shares(text)


def test_plan_cli(capsys):
    argv = ["plan", "--policy", str(POLICIES / "fleet.example.yaml"), "--nodes", "1000",
            "--published", "2026-12-02T12:00:00Z"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "origin peak:" in out and "inference" in out and "training" in out
    assert main(argv + ["--json", "--roles", "cache=2,inference=8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan_version"] == 1 and [w["nodes"] for w in doc["waves"]] == [200, 800]
    assert main(argv + ["--roles", "inference"]) == 2
    capsys.readouterr()
    assert main(argv + ["--size", "16GB"]) == 0      # 16 GB at shaping.ceil 5 Gbit/s: 25.6 s
    out = capsys.readouterr().out
    assert "each pull takes 26s" in out and "+10h20m" in out


def test_plan_refuses_a_role_the_policy_does_not_know(capsys):
    # Issue 14 item 7: a typo would plan its nodes after the last wave, without a word.
    argv = ["plan", "--policy", str(POLICIES / "fleet.example.yaml"), "--nodes", "1000",
            "--published", "2026-12-02T12:00:00Z"]
    assert main(argv + ["--roles", "infrence=0.3,training=0.7"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("wagent plan: --roles: unknown role 'infrence' (did you mean "
                            "'inference'?); the policy's roles: cache, evaluation, inference, "
                            "training\n")
    assert main(argv + ["--roles", "gpu=1"]) == 2
    assert "unknown role 'gpu'; the policy's roles:" in capsys.readouterr().err
    assert main(argv + ["--roles", "cache=1,training=9"]) == 0
