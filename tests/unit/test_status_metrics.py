"""Metrics come from the status document; checked in the exposition format as scraped."""

from prometheus_client import generate_latest

from agent.metrics import Metrics
from agent.policy.model import MetricsSettings
from agent.status import to_json
from tests.unit.test_status import NOW, busy_state


def scrape(doc, fetched, tmp_path=None):
    m = Metrics(MetricsSettings(listen=None,
                              textfile=str(tmp_path / "wagent.prom") if tmp_path else None))
    m.update(doc, fetched)
    return generate_latest(m.registry).decode(), m


def test_exposition_has_every_family(tmp_path):
    text, _ = scrape(to_json(busy_state(), NOW), {"llama3-70b": 12345}, tmp_path)
    for line in (
        "wagent_up 1.0",
        "wagent_healthy 1.0",
        'wagent_pull_bytes_total{model="llama3-70b"} 12345.0',
        'wagent_pull_rate_bits_per_second{model="llama3-70b"} 4.8e+08',
        'wagent_pull_state{model="llama3-70b",state="pulling"} 1.0',
        "wagent_shaping_cap_bits_per_second 5e+08",
        "wagent_shaping_ceil_bits_per_second 1e+07",
        'wagent_shaping_class_drops_total{class="distribution",direction="ingress",'
        'interface="eth0"} 12.0',
        'wagent_backoff_state{state="backed_off"} 1.0',
        "wagent_backoff_rate_bits_per_second 1e+07",
        'wagent_detector_reading{name="link_other_bps"} 9.1e+08',
        "wagent_store_used_bytes 2.147483648e+09",
        "wagent_policy_reload_refused 0.0",
    ):
        assert line in text, line
    assert "wagent_backoff_events_total" in text
    assert (tmp_path / "wagent.prom").read_text().startswith("# HELP")


def test_nothing_before_the_first_tick():
    m = Metrics(MetricsSettings(listen=None))
    assert generate_latest(m.registry) == b""



def test_backoffs_by_signal_kind():
    import dataclasses

    state = busy_state()
    state = dataclasses.replace(state, backoff=dataclasses.replace(
        state.backoff, events_by_signal={"link": 3, "training_port": 1}))
    doc = to_json(state, NOW)
    assert doc["backoff"]["events_by_signal"] == {"link": 3, "training_port": 1}
    text, _ = scrape(doc, {})
    assert 'wagent_backoff_signal_events_total{signal="link"} 3.0' in text
    assert 'wagent_backoff_signal_events_total{signal="training_port"} 1.0' in text
    assert 'wagent_backoff_signal_events_total{signal="rdma"} 0.0' in text
