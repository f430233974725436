"""Prometheus metrics, derived from the status values so they never disagree with status.

The daemon's metrics job hands its state (``agent.status.DaemonState``, the values
``agent.status.to_json`` renders as the status document) to :class:`Metrics`; a collector on
wagent's own ``CollectorRegistry`` (never the global one, which would mix in process metrics of
whatever imported us) turns the latest state into metric families at scrape time. Served on
``metrics.listen`` (``127.0.0.1:9464`` by default; by :class:`agent.metrics_http.ScrapeServer`,
which bounds the connections and the time each may take, and which we own, so a reload can move
it) and/or written atomically to a node_exporter textfile (``metrics.textfile``) every tick, and
removed when the daemon stops.

The names follow Prometheus' conventions as node_exporter does (every metric, its type, labels
and unit: ``docs/status.md``, "Metrics"):

- base units only: bytes and seconds. Status speaks bits per second (as ``tc``
  and the policy do); the metrics divide by 8, and RTTs in microseconds become seconds.
- a traffic rate is a counter of bytes (``*_bytes_total``) for ``rate()`` to derive, never a
  gauge beside it. A gauge in ``*_bytes_per_second`` exists only for what no counter can give:
  a configured or controlled limit (a cap, a ceil, the backoff's target) and the detectors'
  readings of other traffic, which wagent does not count itself.
- ``*_info`` gauges of value 1 carry strings as labels (``build_info{version}``,
  ``policy_info{sha256}``, ``model_current_info{model,version}``); moments are
  ``*_timestamp_seconds`` (Unix time).
- a labelled counter has every label value it can take from the start, at 0, so ``rate()`` and
  ``increase()`` see its first increment.
- the network interface label is ``device``, as node_exporter's, so the two join.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, make_wsgi_app, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__
from agent.metrics_http import MAX_CONNECTIONS, REQUEST_DEADLINE, ScrapeServer
from agent.policy.model import MetricsSettings
from agent.status import (
    ERROR_KINDS,
    PULL_STATES,
    BackoffInfo,
    DaemonState,
    PolicyInfo,
    PullInfo,
    ShapingInfo,
    problems,
)
from agent.store import Store
from agent.store.pointers import current as current_pointer
from agent.yielding.controller import SIGNAL_KINDS

log = logging.getLogger(__name__)

BACKOFF_STATES = ("off", "full", "backed_off", "ramping")
BITS_PER_BYTE = 8


class Reading(NamedTuple):
    name: str
    help: str
    scale: float            # from the status unit to the metric's base unit


# The backoff loop's readings (``BackoffInfo.readings``, status ``backoff.readings``), one
# metric each in its base unit: a single ``reading{name}`` gauge would mix bits/s,
# microseconds, bytes and counts in one family, which no query can sum or compare. A reading
# missing here is not exported: a new one needs its name and unit decided first (and a row in
# docs/status.md).
READINGS: dict[str, Reading] = {
    "other_bps": Reading(
        "wagent_backoff_other_traffic_bytes_per_second",
        "Traffic on the link that is not wagent's (any port), the busier direction, last tick",
        1 / BITS_PER_BYTE),
    "rdma_bps": Reading(
        "wagent_backoff_rdma_traffic_bytes_per_second",
        "RDMA traffic on the busiest RDMA port, last tick", 1 / BITS_PER_BYTE),
    "training_connections": Reading(
        "wagent_backoff_training_connections",
        "Connections on the policy's training ports, last tick", 1),
    "nccl_processes": Reading(
        "wagent_backoff_nccl_processes", "Processes that map libnccl, last scan", 1),
    "pull_streams": Reading(
        "wagent_backoff_pull_sockets",
        "Pull sockets whose receive window the backoff loop clamps", 1),
    "pull_min_rtt_us": Reading(
        "wagent_backoff_pull_min_rtt_seconds",
        "Smallest RTT any live pull socket has seen since it opened", 1e-6),
    "pull_rtt_us": Reading(
        "wagent_backoff_pull_rtt_seconds", "Median smoothed RTT of the pull sockets", 1e-6),
    "pull_window_bytes": Reading(
        "wagent_backoff_pull_window_bytes",
        "The largest receive window a pull socket is clamped to", 1),
}

CLASS_COUNTERS: dict[str, str] = {
    "bytes": "Bytes sent through wagent's HTB class",
    "packets": "Packets sent through wagent's HTB class",
    "drops": "Packets wagent's HTB class dropped",
    "overlimits": "Times wagent's HTB class was over its rate or ceil (tc's overlimits)",
}


class MetricsError(Exception):
    """The metrics endpoint can't be served as the policy asks."""


class _Collector:
    def __init__(self, owner: Metrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        state, fetched, current, finished = self.owner.latest()
        if state is None:
            return
        yield from families(state, fetched, current, finished)


def current_versions(state: DaemonState) -> dict[str, str]:
    """model -> the version ``{store}/models/{model}/current`` names, for every model in the
    daemon's store. Read from the store, not reported by the daemon: the pointer is what
    inference servers load, whoever moved it (``wagent store`` by hand too)."""
    path = state.store.path
    if not path:
        return {}
    store = Store(path)
    try:
        models = store.model_names()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for model in models:
        with contextlib.suppress(OSError):
            version = current_pointer(store, model)
            if version is not None:
                out[model] = version
    return out


def families(state: DaemonState, fetched: Mapping[str, int],
             current: Mapping[str, str] | None = None,
             finished: Mapping[str, float] | None = None) -> Iterator[Metric]:
    """Metric families from the daemon's state (pure but for ``current``, which is read from
    the store when not given: see :func:`current_versions`). ``finished``: model -> when its
    last pull finished, as :class:`Metrics` remembers it across states; by default the
    state's ``finished_at``."""
    if current is None:
        current = current_versions(state)
    if finished is None:
        finished = last_finished(state.pulls, {})
    g = GaugeMetricFamily
    yield g("wagent_up", "1 while the daemon runs; the textfile is removed when it stops",
            value=1)
    yield g("wagent_healthy", "1 healthy, 0 degraded (see wagent status)",
            value=0 if problems(state) else 1)
    build = g("wagent_build_info", "1; version: the wagent version running (wagent --version)",
              labels=["version"])
    build.add_metric([__version__], 1)
    yield build
    yield g("wagent_start_timestamp_seconds", "When the daemon started, Unix time",
            value=state.started_at)
    yield from _pulls(state.pulls, fetched, current, finished)
    yield from _shaping(state.shaping)
    yield from _backoff(state.backoff)
    yield from _peers(state.peers)
    s = state.store
    yield g("wagent_store_used_bytes", "Bytes on disk in the store's blobs and partial files",
            value=s.used_bytes)
    yield g("wagent_store_versions", "Version directories in the store", value=s.versions)
    if s.free_bytes is not None:
        yield g("wagent_store_free_bytes", "Free bytes on the store's file system",
                value=s.free_bytes)
    e = CounterMetricFamily("wagent_errors", "Errors by kind since the daemon started",
                            labels=["kind"])
    counts = state.error_counts
    for kind in sorted(set(ERROR_KINDS) | set(counts)):
        e.add_metric([kind], counts.get(kind, 0))
    yield e
    yield from _policy(state.policy)


def last_finished(pulls: tuple[PullInfo, ...], before: Mapping[str, float]
                  ) -> dict[str, float]:
    """model -> when its last pull finished: the pull's ``finished_at``, else what an earlier
    state said. The worker clears ``finished_at`` when the model's next pull starts, and a
    timestamp that vanished for the hours a pull lasts would end any "no pull finished for a
    day" alert. A model gone from the policy goes from here too."""
    models = {p.model for p in pulls}
    out = {m: at for m, at in before.items() if m in models}
    for p in pulls:
        at = p.finished_at
        if at is not None:
            out[p.model] = max(at, out.get(p.model, at))
    return out


def _pulls(pulls: tuple[PullInfo, ...], fetched: Mapping[str, int],
           current: Mapping[str, str], finished: Mapping[str, float]) -> Iterator[Metric]:
    g = GaugeMetricFamily
    c = CounterMetricFamily("wagent_pull_bytes", "Bytes pulls fetched over the network since "
                            "the daemon started (its rate() is the pull goodput)",
                            labels=["model"])
    for model in sorted(set(fetched) | {p.model for p in pulls}):
        c.add_metric([model], fetched.get(model, 0))
    yield c
    streams = g("wagent_pull_streams", "Connections of the model's pull with a request in "
                "flight", labels=["model"])
    chosen = g("wagent_pull_streams_chosen", "Streams the model's pull runs now (chosen by "
               "measuring what each adds, or pulls.streams)", labels=["model"])
    done = g("wagent_pull_done_bytes", "Bytes of the version in the store or fetched",
             labels=["model", "version"])
    size = g("wagent_pull_size_bytes", "Distinct bytes of the version being pulled",
             labels=["model", "version"])
    state = g("wagent_pull_state", "1 for the model's current pull state",
              labels=["model", "state"])
    last = g("wagent_pull_last_finished_timestamp_seconds", "When the model's last pull "
             "published its version, Unix time", labels=["model"])
    by_source = g("wagent_pull_source_bytes", "Bytes the model's current (or last) pull "
                  "received, by kind of source: peer, cache, origin", labels=["model", "kind"])
    for p in pulls:
        for kind in SOURCE_KINDS:
            by_source.add_metric([p.model, kind], p.bytes_by_source.get(kind, 0))
        streams.add_metric([p.model], p.streams)
        chosen.add_metric([p.model], p.streams_chosen)
        if p.version:
            done.add_metric([p.model, p.version], p.bytes_done)
            if p.bytes_total is not None:
                size.add_metric([p.model, p.version], p.bytes_total)
        for s in PULL_STATES:
            state.add_metric([p.model, s], 1 if p.state == s else 0)
    for model, at in sorted(finished.items()):
        last.add_metric([model], at)
    cur = g("wagent_model_current_info", "1; version: the version the store's current pointer "
            "names, the one inference servers load", labels=["model", "version"])
    for model, version in sorted(current.items()):
        cur.add_metric([model, version], 1)
    yield from (streams, chosen, by_source, done, size, state, last, cur)


SOURCE_KINDS = ("peer", "cache", "origin")     # agent.pull.transfer's kinds of source


def _peers(p: Mapping[str, Any]) -> Iterator[Metric]:
    """What this node served its peers (agent.peers), since the daemon started."""
    if not p.get("enabled"):
        return
    yield CounterMetricFamily("wagent_peer_served_bytes", "Bytes this node's piece server "
                              "sent to its peers (and, on a cache node, to its cluster)",
                              value=p.get("served_bytes", 0))
    yield CounterMetricFamily("wagent_peer_served_requests", "Requests the piece server "
                              "answered", value=p.get("served_requests", 0))
    yield CounterMetricFamily("wagent_peer_refused", "Requests the piece server refused (a "
                              "piece not verified in time, a version it doesn't hold, a "
                              "connection over peers.connections)", value=p.get("refused", 0))
    yield GaugeMetricFamily("wagent_peers", "Peers in this node's swarm (0: not among them)",
                            value=p.get("peers", 0))


def _shaping(sh: ShapingInfo) -> Iterator[Metric]:
    g = GaugeMetricFamily
    if sh.policy_ceil_bps is not None:
        yield g("wagent_shaping_cap_bytes_per_second", "The policy's cap (shaping.ceil) of "
                "distribution traffic", value=sh.policy_ceil_bps / BITS_PER_BYTE)
    if sh.current_ceil_bps is not None:
        yield g("wagent_shaping_ceil_bytes_per_second", "The distribution class's ceil now "
                "(the backoff loop moves it)", value=sh.current_ceil_bps / BITS_PER_BYTE)
    # device: the interface the policy names, as node_exporter's node_network_* label it (for
    # ingress the tree itself is on an IFB device, which no one queries by name)
    counters = {k: CounterMetricFamily(f"wagent_shaping_class_{k}", text,
                                       labels=["device", "direction", "class"])
                for k, text in CLASS_COUNTERS.items()}
    for i in sh.interfaces:
        for cl in i.classes:
            for k, fam in counters.items():
                fam.add_metric([i.name, i.direction, cl.name], getattr(cl, k))
    yield from counters.values()


def _backoff(b: BackoffInfo) -> Iterator[Metric]:
    g = GaugeMetricFamily
    st = g("wagent_backoff_state", "1 for the backoff controller's current state",
           labels=["state"])
    for s in BACKOFF_STATES:
        st.add_metric([s], 1 if b.state == s else 0)
    yield st
    if b.rate_bps is not None:
        yield g("wagent_backoff_rate_bytes_per_second", "The distribution rate the backoff "
                "controller set (HTB ceil and the pulls' token bucket)",
                value=b.rate_bps / BITS_PER_BYTE)
    yield CounterMetricFamily("wagent_backoff_events", "Times training traffic made wagent "
                              "back off", value=b.events_total)
    by = CounterMetricFamily("wagent_backoff_signal_events", "Backoffs by the kind of signal "
                             "that caused them (one backoff may count for several)",
                             labels=["signal"])
    for kind in SIGNAL_KINDS:
        by.add_metric([kind], b.events_by_signal.get(kind, 0))
    yield by
    c = CounterMetricFamily
    yield c("wagent_backoff_yielded_seconds", "Time distribution was held under its cap "
            "(backed off or ramping)", value=b.yielded_s)
    yield c("wagent_backoff_idle_bytes", "Link capacity other traffic left free while "
            "training was on the node", value=b.idle_bytes)
    yield c("wagent_backoff_pulled_bytes", "What distribution carried while training was on "
            "the node (over wagent_backoff_idle_bytes: the share of the gaps between "
            "training's bursts it used)", value=b.pulled_bytes)
    yield c("wagent_backoff_bursts", "Training bursts seen: by the fast path's detector when "
            "it is on (wagent_backoff_fast_path), else rises over the threshold from one tick "
            "to the next (bursts shorter than a tick may go unseen)", value=b.bursts)
    yield c("wagent_backoff_cut_seconds", "Time the fast path held the pull's readers for "
            "bursts", value=b.cut_s)
    yield c("wagent_backoff_anticipated", "Periodic bursts the fast path stopped the pull for "
            "before they came (agent/yielding/rhythm.py)", value=b.anticipated)
    yield g("wagent_backoff_fast_path", "1: the kernel's burst detector is on (status says "
            "where, or why not)", value=1.0 if b.fast_path.startswith("on") else 0.0)
    for key, value in sorted(b.readings.items()):
        r = READINGS.get(key)
        if r is not None and value is not None:
            yield g(r.name, r.help, value=float(value) * r.scale)


def _policy(pol: PolicyInfo) -> Iterator[Metric]:
    g = GaugeMetricFamily
    info = g("wagent_policy_info", "1; sha256: of the policy file in force",
             labels=["sha256"])
    if pol.sha256:
        info.add_metric([pol.sha256], 1)
    yield info
    if pol.loaded_at is not None:
        yield g("wagent_policy_loaded_timestamp_seconds", "When the policy in force was loaded "
                "(start or last successful reload), Unix time", value=pol.loaded_at)
    yield CounterMetricFamily("wagent_policy_reloads", "Successful reloads since the daemon "
                              "started", value=pol.reloads)
    yield g("wagent_policy_reload_refused", "1 while the last reload was refused",
            value=1 if pol.last_error else 0)


class Metrics:
    """Owns the registry, the HTTP endpoint and the textfile for one ``metrics`` policy."""

    def __init__(self, policy: MetricsSettings, *, deadline: float = REQUEST_DEADLINE,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.policy = policy
        self.deadline = deadline                # for a scrape's request and answer together
        self.max_connections = max_connections
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._state: DaemonState | None = None
        self._fetched: dict[str, int] = {}
        self._current: dict[str, str] = {}
        self._finished: dict[str, float] = {}
        self._server: ScrapeServer | None = None
        # held by a textfile write and by stop()'s removal, so a last tick racing the daemon's
        # stop can't bring the file back
        self._textfile_lock = threading.Lock()
        self._stopped = False

    def latest(self) -> tuple[DaemonState | None, dict[str, int], dict[str, str],
                              dict[str, float]]:
        with self._lock:
            return self._state, dict(self._fetched), dict(self._current), dict(self._finished)

    def start(self) -> None:
        if not self.policy.listen:
            return
        host, _, port = self.policy.listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            server = ScrapeServer(host, int(port), make_wsgi_app(self.registry),
                                  deadline=self.deadline, max_connections=self.max_connections)
        except (OSError, ValueError) as e:
            raise MetricsError(f"can't serve metrics on {self.policy.listen}: {e}; change "
                               "metrics.listen in the policy (or set it to null)") from e
        self._server = server
        server.start()
        log.info("metrics on http://%s/metrics", self.policy.listen)

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    def stop(self) -> None:
        """Stops serving and removes the textfile. Left behind, node_exporter would go on
        exporting the last values (``wagent_up 1``, a pull rate) of a daemon that is gone;
        removed, every series goes stale at the next scrape, as the endpoint's do. The same
        holds on a reload that moves or drops the textfile. A daemon killed without stopping
        leaves the file: ``node_textfile_mtime_seconds`` then stops moving."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        with self._textfile_lock:
            self._stopped = True
            if self.policy.textfile:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.policy.textfile)

    def update(self, state: DaemonState, fetched: dict[str, int]) -> None:
        """``state``: the daemon's, as status renders it; ``fetched``: model -> bytes its
        pulls fetched since start (the worker's counters)."""
        # The store is read here, once a tick, not at each scrape: scrapers set the pace there.
        current = current_versions(state)
        with self._lock:
            self._state, self._fetched, self._current = state, dict(fetched), current
            self._finished = last_finished(state.pulls, self._finished)
        if not self.policy.textfile:
            return
        with self._textfile_lock:
            if self._stopped:
                return
            # write_to_textfile writes aside and renames: node_exporter never reads half a file
            os.makedirs(os.path.dirname(self.policy.textfile) or ".", exist_ok=True)
            write_to_textfile(self.policy.textfile, self.registry)
