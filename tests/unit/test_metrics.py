"""Metrics come from the status document; checked in the exposition format as scraped."""

import dataclasses
import re

from prometheus_client import generate_latest

from agent import __version__
from agent.metrics import READINGS, Metrics, families
from agent.policy.model import MetricsSettings
from agent.status import ERROR_KINDS, PolicyInfo, PullInfo, StoreInfo, to_json
from agent.store import Store
from agent.store.pointers import set_current
from tests.unit.test_status import NOW, busy_state
from tests.unit.test_store import put_version


def scrape(doc, fetched, tmp_path=None):
    m = Metrics(MetricsSettings(listen=None,
                              textfile=str(tmp_path / "wagent.prom") if tmp_path else None))
    m.update(doc, fetched)
    return generate_latest(m.registry).decode(), m


def state_with(tmp_path, **over):
    """busy_state() with its store on tmp_path (the metrics read the current pointers there)."""
    return busy_state(store=StoreInfo(str(tmp_path / "store"), used_bytes=2 * 2**30,
                                      versions=2, free_bytes=10 * 2**30), **over)


def samples(text):
    """name{labels} -> value of every sample in an exposition."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^((?!#)\S+) (\S+)$", text, re.M)}


def test_exposition_has_every_family(tmp_path):
    text, _ = scrape(to_json(state_with(tmp_path), NOW), {"llama3-70b": 12345}, tmp_path)
    for line in (
        "wagent_up 1.0",
        "wagent_healthy 1.0",
        'wagent_pull_bytes_total{model="llama3-70b"} 12345.0',
        'wagent_pull_state{model="llama3-70b",state="pulling"} 1.0',
        'wagent_pull_done_bytes{model="llama3-70b",version="v3"} 41.0',
        "wagent_shaping_cap_bytes_per_second 6.25e+07",
        "wagent_shaping_ceil_bytes_per_second 1.25e+06",
        'wagent_shaping_class_drops_total{class="distribution",device="eth0",'
        'direction="ingress"} 12.0',
        'wagent_backoff_state{state="backed_off"} 1.0',
        "wagent_backoff_rate_bytes_per_second 1.25e+06",
        "wagent_store_used_bytes 2.147483648e+09",
        "wagent_policy_reload_refused 0.0",
        "wagent_start_timestamp_seconds 996400.0",
    ):
        assert line in text, line
    assert "wagent_backoff_events_total" in text
    assert (tmp_path / "wagent.prom").read_text().startswith("# HELP")


def test_base_units_only(tmp_path):
    """Bytes and seconds: no bits, no microseconds, and no rate gauge where a counter exists."""
    text, _ = scrape(to_json(state_with(tmp_path), NOW), {"llama3-70b": 1}, tmp_path)
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert not [n for n in names if re.search(r"bits|_bps|_us$|_reading", n)], names
    assert "wagent_pull_rate_bytes_per_second" not in names      # rate(wagent_pull_bytes_total)
    for n in names:
        if "bytes_per_second" in n:
            assert n.endswith("_bytes_per_second"), n


def test_every_error_kind_is_there_from_the_start(tmp_path):
    text, _ = scrape(to_json(state_with(tmp_path), NOW), {})
    got = samples(text)
    for kind in ERROR_KINDS:
        assert got[f'wagent_errors_total{{kind="{kind}"}}'] == 0, kind
    # a kind the daemon counts that the list does not know yet is exported all the same
    text, _ = scrape(to_json(state_with(tmp_path, error_counts={"pull": 2, "new_kind": 1}),
                             NOW), {})
    got = samples(text)
    assert got['wagent_errors_total{kind="pull"}'] == 2
    assert got['wagent_errors_total{kind="new_kind"}'] == 1
    assert got['wagent_errors_total{kind="reload"}'] == 0


def test_build_info_names_the_package_version(tmp_path):
    text, _ = scrape(to_json(state_with(tmp_path), NOW), {})
    assert samples(text)[f'wagent_build_info{{version="{__version__}"}}'] == 1
    assert "# TYPE wagent_build_info gauge" in text


def test_policy_info_and_load_time(tmp_path):
    st = state_with(tmp_path, policy=PolicyInfo(path="/etc/wagent/policy.yaml",
                                                sha256="cd" * 32, loaded_at=NOW - 60))
    got = samples(scrape(to_json(st, NOW), {})[0])
    assert got[f'wagent_policy_info{{sha256="{"cd" * 32}"}}'] == 1
    assert got["wagent_policy_loaded_timestamp_seconds"] == NOW - 60
    assert len([k for k in got if k.startswith("wagent_policy_info")]) == 1


def test_last_finished_pull_outlives_the_next_pull(tmp_path):
    m = Metrics(MetricsSettings(listen=None))
    done = PullInfo("llama3-70b", "v3", "done", bytes_done=100, bytes_total=100,
                    started_at=NOW - 90, finished_at=NOW - 10)
    m.update(to_json(state_with(tmp_path, pulls=(done,)), NOW), {})
    key = 'wagent_pull_last_finished_timestamp_seconds{model="llama3-70b"}'
    assert samples(generate_latest(m.registry).decode())[key] == NOW - 10
    # the worker clears finished_at when v4 starts; the metric still says when v3 landed
    pulling = PullInfo("llama3-70b", "v4", "pulling", bytes_done=1, bytes_total=100,
                       started_at=NOW)
    m.update(to_json(state_with(tmp_path, pulls=(pulling,)), NOW + 5), {})
    assert samples(generate_latest(m.registry).decode())[key] == NOW - 10
    # a model dropped from the policy drops its timestamp
    m.update(to_json(state_with(tmp_path, pulls=()), NOW + 10), {})
    assert key not in samples(generate_latest(m.registry).decode())


def test_current_info_follows_the_store_pointer(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    put_version(store, "llama3-70b", "v2", {"a.safetensors": b"two"})
    put_version(store, "llama3-70b", "v3", {"a.safetensors": b"three"})
    put_version(store, "bert", "v1", {"b.bin": b"one"})       # no current pointer: not listed
    doc = to_json(state_with(tmp_path), NOW)
    got = samples(scrape(doc, {})[0])
    assert not [k for k in got if k.startswith("wagent_model_current_info")]
    set_current(store, "llama3-70b", "v2")
    got = samples(scrape(doc, {})[0])
    assert got['wagent_model_current_info{model="llama3-70b",version="v2"}'] == 1
    set_current(store, "llama3-70b", "v3")
    m = scrape(doc, {})[1]
    got = samples(generate_latest(m.registry).decode())
    assert got['wagent_model_current_info{model="llama3-70b",version="v3"}'] == 1
    assert [k for k in got if k.startswith("wagent_model_current_info")] == \
        ['wagent_model_current_info{model="llama3-70b",version="v3"}']
    # families() without the pointers given reads them itself
    assert any(f.name == "wagent_model_current_info" and f.samples
               for f in families(doc, {}))


def test_interface_label_is_device_as_node_exporters(tmp_path):
    text, _ = scrape(to_json(state_with(tmp_path), NOW), {})
    assert "interface=" not in text
    got = samples(text)
    for k in ("bytes", "packets", "drops", "overlimits"):
        assert got[f'wagent_shaping_class_{k}_total{{class="default",device="eth0",'
                   'direction="ingress"}'] >= 0


def test_one_metric_per_reading_in_its_base_unit(tmp_path):
    readings = {"other_bps": 8e8, "rdma_bps": 16.0, "training_connections": 2.0,
                "nccl_processes": 1.0, "pull_streams": 8.0, "pull_min_rtt_us": 40_000.0,
                "pull_rtt_us": 55_000.0, "pull_window_bytes": 65_536.0}
    # every reading the backoff loop reports (docs/status.md, backoff.readings) has a metric
    assert set(READINGS) == set(readings)
    st = state_with(tmp_path)
    st = dataclasses.replace(st, backoff=dataclasses.replace(st.backoff, readings=readings))
    got = samples(scrape(to_json(st, NOW), {})[0])
    assert got["wagent_backoff_other_traffic_bytes_per_second"] == 1e8
    assert got["wagent_backoff_rdma_traffic_bytes_per_second"] == 2
    assert got["wagent_backoff_training_connections"] == 2
    assert got["wagent_backoff_nccl_processes"] == 1
    assert got["wagent_backoff_pull_sockets"] == 8
    assert got["wagent_backoff_pull_min_rtt_seconds"] == 0.04
    assert got["wagent_backoff_pull_rtt_seconds"] == 0.055
    assert got["wagent_backoff_pull_window_bytes"] == 65_536
    # a reading absent from the document (no pull socket yet) is absent here too
    st = dataclasses.replace(st, backoff=dataclasses.replace(st.backoff,
                                                             readings={"other_bps": 0.0}))
    got = samples(scrape(to_json(st, NOW), {})[0])
    assert got["wagent_backoff_other_traffic_bytes_per_second"] == 0
    assert "wagent_backoff_pull_rtt_seconds" not in got


def test_stop_removes_the_textfile_and_a_late_tick_does_not_bring_it_back(tmp_path):
    doc = to_json(state_with(tmp_path), NOW)
    _, m = scrape(doc, {}, tmp_path)
    textfile = tmp_path / "wagent.prom"
    assert "wagent_up 1.0" in textfile.read_text()
    m.stop()
    assert not textfile.exists()
    m.update(doc, {})               # the metrics job's last run, racing the stop
    assert not textfile.exists()
    m.stop()                        # twice is harmless


def test_nothing_before_the_first_tick():
    m = Metrics(MetricsSettings(listen=None))
    assert generate_latest(m.registry) == b""


def test_backoffs_by_signal_kind():
    state = busy_state()
    state = dataclasses.replace(state, backoff=dataclasses.replace(
        state.backoff, events_by_signal={"link": 3, "training_port": 1}))
    doc = to_json(state, NOW)
    assert doc["backoff"]["events_by_signal"] == {"link": 3, "training_port": 1}
    text, _ = scrape(doc, {})
    assert 'wagent_backoff_signal_events_total{signal="link"} 3.0' in text
    assert 'wagent_backoff_signal_events_total{signal="training_port"} 1.0' in text
    assert 'wagent_backoff_signal_events_total{signal="rdma"} 0.0' in text
