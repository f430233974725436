"""Paced detectors: run as often as their measured CPU cost allows."""

from agent.yielding.detect import Detectors, PortsDetector
from agent.yielding.detect.pacing import Paced, Pacer
from tests.backoff_helpers import write_tcp


def test_next_run_waits_cost_over_share_within_bounds():
    p = Pacer(share=0.003, least=0.1, most=2.0)
    assert p.due(0.0)
    assert p.ran(0.0, cost=0.0002) == 0.1                # cheap: every tick
    assert p.ran(1.0, cost=0.0100) - 1.0 > 0.1           # dear: less often (smoothed)
    p = Pacer(share=0.003, least=0.1, most=2.0)
    assert p.ran(0.0, cost=1.0) == 2.0                   # never staler than `most`


def test_paced_returns_the_last_readings_in_between():
    calls = []
    cpu = iter([0.0, 0.002, 0.002, 0.004])               # 2 ms of CPU per run

    def sample(now):
        calls.append(now)
        return (now,)

    paced = Paced(sample, Pacer(share=0.01, least=0.1, most=5.0), cpu=lambda: next(cpu))
    assert paced(0.0) == (0.0,)
    assert paced(0.1) == (0.0,)                          # due at 0.2 (2 ms / 1%)
    assert paced(0.2) == (0.2,)
    assert calls == [0.0, 0.2]


def test_detectors_from_a_policy_pace_the_dear_ones(tmp_path):
    write_tcp(tmp_path, [], [])
    dets = Detectors(ports=PortsDetector([(29500, 29500)], tmp_path), tick=0.1)
    assert dets.ports_paced is not None and dets.ports_paced.pacer.least == 0.1
    assert Detectors(ports=PortsDetector([(29500, 29500)], tmp_path)).ports_paced is None


def test_between_full_runs_what_was_found_is_checked_cheaply():
    seen = []
    paced = Paced(lambda now: ("conn",), Pacer(share=0.001, least=0.1, most=5.0),
                  cpu=iter([0.0, 0.003]).__next__, between=lambda now: seen.append(now) or ())
    assert paced(0.0) == ("conn",)
    assert paced(0.1) == () and seen == [0.1]       # the connection ended: seen at once
    assert paced(0.2) == () and seen == [0.1]       # nothing to check until the next scan
