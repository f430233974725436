"""Prometheus metrics, derived from the status document so the two never disagree.

The daemon hands each tick's status document (``agent.status.to_json``) to :class:`Metrics`; a
collector on wagent's own ``CollectorRegistry`` (never the global one, which would mix in
process metrics of whatever imported us) turns the latest document into metric families at
scrape time. Served on ``metrics.listen`` (``127.0.0.1:9464`` by default; a threaded WSGI server
we own, so a reload can move it) and/or written atomically to a node_exporter textfile
(``metrics.textfile``) every tick.

Names (all prefixed ``wagent_``): ``up``, ``healthy``, ``pull_bytes_total{model}`` (bytes fetched
since start), ``pull_rate_bits_per_second{model}``, ``pull_done_bytes{model,version}``,
``pull_size_bytes{model,version}``, ``pull_streams{model}``, ``pull_state{model,state}``,
``shaping_cap_bits_per_second``, ``shaping_ceil_bits_per_second``,
``shaping_class_{bytes,packets,drops,overlimits}_total{interface,direction,class}``,
``backoff_state{state}``, ``backoff_rate_bits_per_second``, ``backoff_events_total``,
``backoff_signal_events_total{signal}``,
``detector_reading{name}``, ``store_used_bytes``, ``store_free_bytes``, ``store_versions``,
``errors_total{kind}``, ``policy_reloads_total``, ``policy_reload_refused``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.policy.model import MetricsSettings
from agent.status import PULL_STATES
from shaping.controller import SIGNAL_KINDS

log = logging.getLogger(__name__)

BACKOFF_STATES = ("off", "full", "backed_off", "ramping")


class MetricsError(Exception):
    """The metrics endpoint can't be served as the policy asks."""


class _Collector:
    def __init__(self, owner: Metrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        doc, fetched = self.owner.latest()
        if doc is None:
            return
        yield from families(doc, fetched)


def families(doc: dict[str, Any], fetched: dict[str, int]) -> Iterator[Metric]:
    """Metric families from one status document (pure; tested without a registry)."""
    g = GaugeMetricFamily
    yield g("wagent_up", "1 while the daemon runs", value=1)
    yield g("wagent_healthy", "1 healthy, 0 degraded (see wagent status)",
            value=1 if doc["health"] == "healthy" else 0)
    c = CounterMetricFamily("wagent_pull_bytes", "Bytes fetched by pulls since the daemon "
                            "started", labels=["model"])
    for model, n in sorted(fetched.items()):
        c.add_metric([model], n)
    yield c
    rate = g("wagent_pull_rate_bits_per_second", "Recent pull goodput", labels=["model"])
    streams = g("wagent_pull_streams", "Connections in use", labels=["model"])
    done = g("wagent_pull_done_bytes", "Bytes of the version in the store or fetched",
             labels=["model", "version"])
    size = g("wagent_pull_size_bytes", "Size of the version being pulled",
             labels=["model", "version"])
    state = g("wagent_pull_state", "1 for the model's current pull state",
              labels=["model", "state"])
    for p in doc["pulls"]:
        rate.add_metric([p["model"]], p["rate_bps"])
        streams.add_metric([p["model"]], p["streams"])
        if p["version"]:
            done.add_metric([p["model"], p["version"]], p["bytes_done"])
            if p["bytes_total"] is not None:
                size.add_metric([p["model"], p["version"]], p["bytes_total"])
        for s in PULL_STATES:
            state.add_metric([p["model"], s], 1 if p["state"] == s else 0)
    yield from (rate, streams, done, size, state)
    sh = doc["shaping"]
    if sh["cap_bps"] is not None:
        yield g("wagent_shaping_cap_bits_per_second", "The policy's cap of distribution "
                "traffic", value=sh["cap_bps"])
    if sh["current_ceil_bps"] is not None:
        yield g("wagent_shaping_ceil_bits_per_second", "The distribution class's ceil now",
                value=sh["current_ceil_bps"])
    counters = {k: CounterMetricFamily(f"wagent_shaping_class_{k}", f"HTB class {k}",
                                       labels=["interface", "direction", "class"])
                for k in ("bytes", "packets", "drops", "overlimits")}
    for i in sh["interfaces"]:
        for cl in i["classes"]:
            for k, fam in counters.items():
                fam.add_metric([i["name"], i["direction"], cl["name"]], cl[k])
    yield from counters.values()
    b = doc["backoff"]
    st = g("wagent_backoff_state", "1 for the backoff controller's current state",
           labels=["state"])
    for s in BACKOFF_STATES:
        st.add_metric([s], 1 if b["state"] == s else 0)
    yield st
    if b["rate_bps"] is not None:
        yield g("wagent_backoff_rate_bits_per_second", "The controller's target rate",
                value=b["rate_bps"])
    yield CounterMetricFamily("wagent_backoff_events", "Times training traffic made wagent "
                              "back off", value=b["events_total"])
    by = CounterMetricFamily("wagent_backoff_signal_events", "Backoffs by the kind of signal "
                             "that caused them (one backoff may count for several)",
                             labels=["signal"])
    for kind in SIGNAL_KINDS:
        by.add_metric([kind], b.get("events_by_signal", {}).get(kind, 0))
    yield by
    r = g("wagent_detector_reading", "Detector readings (rates in bits/s, counts)",
          labels=["name"])
    for name, v in b["readings"].items():
        r.add_metric([name], float(v))
    yield r
    s = doc["store"]
    yield g("wagent_store_used_bytes", "Bytes in the store", value=s["used_bytes"])
    yield g("wagent_store_versions", "Complete versions in the store", value=s["versions"])
    if s["free_bytes"] is not None:
        yield g("wagent_store_free_bytes", "Free bytes on the store's file system",
                value=s["free_bytes"])
    e = CounterMetricFamily("wagent_errors", "Errors by kind since start", labels=["kind"])
    for kind, n in doc["daemon"]["error_counts"].items():
        e.add_metric([kind], n)
    yield e
    pol = doc["policy"]
    yield CounterMetricFamily("wagent_policy_reloads", "Successful reloads",
                              value=pol["reloads"])
    yield g("wagent_policy_reload_refused", "1 while the last reload was refused",
            value=1 if pol["last_error"] else 0)


class _QuietHandler(WSGIRequestHandler):
    # A scraper that connects and never sends (or never reads) is dropped after this many
    # seconds; without it each such connection holds a thread for ever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class Metrics:
    """Owns the registry, the HTTP endpoint and the textfile for one ``metrics`` policy."""

    def __init__(self, policy: MetricsSettings) -> None:
        self.policy = policy
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._doc: dict[str, Any] | None = None
        self._fetched: dict[str, int] = {}
        self._server: _ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def latest(self) -> tuple[dict[str, Any] | None, dict[str, int]]:
        with self._lock:
            return self._doc, dict(self._fetched)

    def start(self) -> None:
        if not self.policy.listen:
            return
        host, _, port = self.policy.listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            server = make_server(host, int(port), make_wsgi_app(self.registry),
                                 _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer,
                                 handler_class=_QuietHandler)
        except (OSError, ValueError) as e:
            raise MetricsError(f"can't serve metrics on {self.policy.listen}: {e}; change "
                               "metrics.listen in the policy (or set it to null)") from e
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="metrics",
                                        kwargs={"poll_interval": 0.5}, daemon=True)
        self._thread.start()
        log.info("metrics on http://%s/metrics", self.policy.listen)

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server is not None else None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def update(self, doc: dict[str, Any], fetched: dict[str, int]) -> None:
        with self._lock:
            self._doc, self._fetched = doc, dict(fetched)
        if self.policy.textfile:
            # write_to_textfile writes aside and renames: node_exporter never reads half a file
            os.makedirs(os.path.dirname(self.policy.textfile) or ".", exist_ok=True)
            write_to_textfile(self.policy.textfile, self.registry)
