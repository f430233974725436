"""The policy as the rest of wagent sees it: frozen dataclasses, units already parsed.

Only ``agent.policy`` (the loader and validator) ever touches raw YAML; everything else takes a
``Policy``. Rates are bits per second, sizes bytes, durations seconds. Defaults here are the
defaults of the YAML keys, documented key by key in ``policies/fleet.example.yaml``.

The loader is driven by these classes: a YAML key is a field name, its type comes from the
annotation and its unit from the field's metadata. To add a key, add a field here, e.g.::

    burst: int = size_field(64 * 2**10)           # "64KiB" in YAML, bytes here
    settle: float = duration_field(2.0, min=0.1)  # "2s" in YAML, seconds; at least 100ms
    mode: str = "auto"                            # plain text, no unit

and document it in ``policies/fleet.example.yaml``; ``agent/policy/rules.py`` needs no change.
Metadata keys the loader understands: ``unit`` (rate, rate_share, size, duration, port,
port_range),
``min``/``max`` (bounds, in the field's own unit), ``choices`` (allowed values), ``yaml``
(False: not a YAML key), ``key`` (the field is the mapping key of a keyed list).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from agent.s3.address import ADDRESSING, http_base, is_s3
from agent.units import Share, resolve_rate

DEFAULT_WAVES = ("inference", "evaluation", "training")
SCHEMA_VERSION = 1


def rate_field(default: Any, **meta: Any) -> Any:
    """A rate field: YAML ``300mbit``/``200MB/s``, bits per second here."""
    return field(default=default, metadata={"unit": "rate", **meta})


def share_field(default: Any, **meta: Any) -> Any:
    """A rate that may be written as a share of the link: YAML ``300mbit`` or ``1%`` (of
    ``shaping.link_rate``); the ``Policy`` resolves shares to bits per second."""
    return field(default=default, metadata={"unit": "rate_share", **meta})


def size_field(default: Any, **meta: Any) -> Any:
    """A size field: YAML ``64MiB``, bytes here."""
    return field(default=default, metadata={"unit": "size", **meta})


def duration_field(default: Any, **meta: Any) -> Any:
    """A duration field: YAML ``15m``/``1h30m``/``100ms``, seconds here."""
    return field(default=default, metadata={"unit": "duration", **meta})


def ports_field(default: Any, **meta: Any) -> Any:
    """TCP ports, 1..65535: YAML ``8080`` or ``[80, 443]``."""
    return field(default=default, metadata={"unit": "port", **meta})


def port_ranges_field(default: Any, **meta: Any) -> Any:
    """Inclusive port ranges: YAML ``[29500, "40000-40100"]``, ``((29500, 29500), ...)`` here."""
    return field(default=default, metadata={"unit": "port_range", **meta})


@dataclass(frozen=True)
class Window:
    """A time window in which pulls may run: opens at each ``cron`` match, lasts ``duration``.

    ``cron`` is five fields (minute hour day-of-month month day-of-week), day-of-week in cron's
    numbering (0 or 7 = Sunday) or names (mon-fri). A window may run across midnight. Times are
    read on the wall clock of ``tz``: the policy's ``timezone``, which the policy sets here.
    """

    cron: str
    duration: float = field(metadata={"unit": "duration"})
    tz: str = field(default="UTC", metadata={"yaml": False})


@dataclass(frozen=True)
class Role:
    name: str = field(metadata={"key": True})  # the key under `roles:`
    hosts: tuple[str, ...] = ()      # fnmatch patterns against the node's hostname
    windows: tuple[Window, ...] = ()  # empty: pulls may run at any time


@dataclass(frozen=True)
class Waves:
    order: tuple[str, ...] = DEFAULT_WAVES
    gap: float = duration_field(1800.0)     # between the start of one wave and the next
    spread: float = duration_field(1200.0)  # per-node offsets are uniform in [0, spread)
    # wave 0 starts this long after publication, so the cache role (which starts at once) fills
    # first
    cache_lead: float = duration_field(0.0)


@dataclass(frozen=True)
class Source:
    # http(s) base URL, or s3://BUCKET/PREFIX; a version is at {url}/{model}/{version}/
    url: str
    proxy: str | None = None        # HTTP proxy for this source (e.g. a Dragonfly dfdaemon)
    ca_bundle: str | None = None    # PEM file; TLS verification is always on
    # file, never logged: "bearer TOKEN" or "basic USER:PASSWORD"; for s3:// an AWS shared
    # credentials file (readable by root and the service user only)
    credentials: str | None = None
    # The cluster's cache tier (cache nodes' stores served by nginx): cache nodes don't poll its
    # `latest`, which names what the tier already holds (agent.announce), they fill it.
    cache: bool = False
    # s3:// sources (agent.s3): the S3 API's URL (MinIO, Ceph RGW, SeaweedFS); none: AWS's
    endpoint: str | None = None
    # SigV4's region; none: the AWS chain's (AWS_REGION, the config file), else us-east-1
    region: str | None = None
    addressing: str = field(default="auto", metadata={"choices": ADDRESSING})
    profile: str | None = None      # the profile of the AWS shared files (none: the chain's)

    @property
    def is_s3(self) -> bool:
        return is_s3(self.url)

    @property
    def base(self) -> str:
        """The HTTP(S) URL the source's objects are under (an s3:// source's, addressed)."""
        if not self.is_s3:
            return self.url
        return http_base(self.url, self.endpoint, self.region, self.addressing)


@dataclass(frozen=True)
class Model:
    name: str
    version: str = "latest"         # "latest": resolved by polling {source}/{model}/latest
    pin: tuple[str, ...] = ()       # versions eviction never removes
    # run (by /bin/sh) when a version becomes current: env WAGENT_MODEL, WAGENT_VERSION,
    # WAGENT_PATH; killed after on_ready_timeout
    on_ready: str | None = None
    on_ready_timeout: float = duration_field(300.0)


@dataclass(frozen=True)
class StoreSettings:
    path: str = "/var/cache/wagent"
    # per model, newest first, pins on top
    keep_versions: int = field(default=2, metadata={"min": 1})
    max_size: int | None = size_field(None)           # bytes; evict LRU beyond it
    evict_after: float | None = duration_field(None)  # unused this long, a version not kept may go


@dataclass(frozen=True)
class Pulls:
    # the most streams a pull runs (exactly, with adaptive_streams off): a path behind a cap per
    # connection wants link / per-connection rate of them, 24 on the scaling bench's 24 R path,
    # about 28 on a 200 Gbit/s ring where one stream carried 7.25 Gbit/s
    streams: int = field(default=32, metadata={"min": 1, "max": 256})
    # true: start with 2, add while each added stream carries its share, at most ``streams``
    # (agent.pull.stream_count); false: ``streams`` always
    adaptive_streams: bool = True
    piece_size: int = size_field(64 * 2**20)  # pieces of non-safetensors files; big tensors split
    connect_timeout: float = duration_field(10.0)
    read_timeout: float = duration_field(30.0)
    retries: int = field(default=5, metadata={"min": 0})
    rate: int | None = rate_field(None)       # static cap of the pulls' token bucket, bits/s
    # models pulling at once (they share the streams and the token bucket); others queue
    concurrent_models: int = field(default=2, metadata={"min": 1, "max": 64})


LEAST_HTB_RATE = 8          # bits/s: HTB's classes take a byte a second at least


@dataclass(frozen=True)
class Shaping:
    # None: on when interfaces are named (naming them is the opt-in); false turns it off
    enabled: bool | None = None
    interfaces: tuple[str, ...] = ()     # wagent never touches an interface not named here
    link_rate: int = rate_field(10**9)   # the interface's rate (HTB root and default class ceil)
    # sources' ports, matched as source port on ingress (IFB); empty: taken from the sources' URLs
    pull_ports: tuple[int, ...] = ports_field(())
    # matched as source port on egress; empty: no egress tree
    serve_ports: tuple[int, ...] = ports_field(())
    # the distribution class's guaranteed rate: on egress, all that training can't take from
    # an upload (HTB lends the rest to the default class first, within a packet's time), so
    # a share as small as the backoff's floor; 10 Mbit/s was 25% of a 40 Mbit/s link
    rate: int | Share = share_field(Share(0.2))
    # the distribution class's cap: by default the whole link, the backoff keeps it off training
    ceil: int | Share = share_field(Share(100.0))
    # HTB prio of the distribution class (0 highest, 7 lowest)
    priority: int = field(default=7, metadata={"min": 0, "max": 7})
    take_over: bool = False              # replace a root qdisc wagent didn't make

    def __post_init__(self) -> None:
        if self.enabled is None:
            object.__setattr__(self, "enabled", bool(self.interfaces))
        # Shares of the link become bits/s here, so the rest of wagent only sees rates.
        for name in ("rate", "ceil"):
            value = getattr(self, name)
            bps = resolve_rate(value, self.link_rate)
            # a share of a very slow link still makes a class
            object.__setattr__(self, name,
                               max(bps, LEAST_HTB_RATE) if isinstance(value, Share) else bps)


@dataclass(frozen=True)
class Backoff:
    """Defaults that protect at any link speed: rates are shares of ``shaping.link_rate``
    (resolved by the ``Policy``; a ``Backoff`` on its own is resolved with ``resolved``)."""

    enabled: bool = True
    tick: float = duration_field(0.1, min=0.01)  # how often the detectors run
    floor: int | Share = share_field(Share(0.2))  # rate while training traffic is present
    cap: int | Share | None = share_field(None)   # None: shaping.ceil
    # multiplier on a detection: 0 = straight to the floor
    decrease: float = field(default=0.0, metadata={"min": 0.0, "max": 0.99})
    increase: int | Share = share_field(Share(10.0))  # additive step per tick once quiet
    quiet: float = duration_field(3.0)   # seconds with no training traffic before ramping up
    # other (non-distribution) traffic on the link, over one tick, that counts as training
    link_threshold: int | Share = share_field(Share(5.0))
    rdma_threshold: int = rate_field(10**6)  # RDMA traffic that counts
    # inclusive port ranges
    training_ports: tuple[tuple[int, int], ...] = port_ranges_field(((29500, 29500),))
    nccl_processes: bool = True          # a process mapping libnccl counts as training present
    # the standing queue (as time at the allowed rate) the pull's receive windows allow it at
    # the bottleneck, besides one round trip in flight
    queue_budget: float = duration_field(0.001, min=0.0, max=1.0)
    # the smallest training burst to protect (bytes): while the node trains, the pull's windows
    # together never hold more than BURST_SHARE (3%) of it, whatever the link's rate (what a
    # window granted still arrives after a cut: agent/yielding/sockets.py); null: no bound
    smallest_burst: int | None = size_field(4 * 10**6)
    # the fast path (agent/yielding/bursts.py): a burst the kernel's detector sees holds the
    # pull's readers until this long after its last packet; null: no fast path (ticks only)
    burst_hold: float | None = duration_field(0.005, min=0.0001, max=1.0)
    roots: tuple[tuple[str, str], ...] = ()  # detector roots (proc, sys) overridden for tests

    def resolved(self, link_bps: int) -> Backoff:
        """The same, with every share of the link turned into bits/s."""
        shares = {n: resolve_rate(getattr(self, n), link_bps)
                  for n in ("floor", "cap", "increase", "link_threshold")
                  if isinstance(getattr(self, n), Share)}
        return replace(self, **shares) if shares else self


@dataclass(frozen=True)
class MetricsSettings:
    listen: str | None = "127.0.0.1:9464"  # host:port for Prometheus, or None
    textfile: str | None = None            # node_exporter textfile path, or None


@dataclass(frozen=True)
class Mounts:
    """Lazy mounts (``wagent mount``, ``agent.mount``)."""

    # A read of a piece not verified yet waits this long for it (its pull fetches it first),
    # then fails with EIO. Long: an engine dies on a read error (a bus error for mmap), while
    # a wait costs it only time, so EIO is for a version no source can serve at all.
    read_deadline: float = duration_field(600.0, min=1.0, max=86400.0)
    # While a reader waits for bytes, the pull runs at least this fast whatever the backoff
    # says (never above its cap), unless training is identified on the node (a training port,
    # RDMA, NCCL): then it yields as ever. A share is of shaping.link_rate (the Policy resolves
    # it to bits/s, as the backoff's); null keeps readers inside the backoff. Half: an engine
    # starting serves nothing until its bytes come, and the link's other traffic (another
    # engine's requests, say) keeps the other half.
    read_floor: int | Share | None = share_field(Share(50.0))


@dataclass(frozen=True)
class Peers:
    """A cluster's nodes serve each other the pieces they have verified (``agent.peers``)."""

    enabled: bool = False
    # every node's piece server (``agent.peers.server``); its traffic is shaped both ways as
    # distribution traffic (a serve port on egress, a pulled port on ingress)
    port: int = field(default=8090, metadata={"unit": "port"})
    listen: str = "0.0.0.0"
    # the cluster's nodes (addresses or names; a name stands for every address it resolves to):
    # the same list on every node, which finds itself in it by its own addresses
    hosts: tuple[str, ...] = ()
    # the peers each node exchanges with (agent.peers.swarm): it learns what they hold and
    # fetches from them; more spread a piece in fewer hops, each costs a have-map stream
    neighbors: int = field(default=6, metadata={"min": 1, "max": 64})
    # what serving peers may send, at most (a share of shaping.link_rate); the HTB egress class
    # and the backoff cap it further
    upload: int | Share = share_field(Share(100.0))
    # a parent (or the cache) holds a request this long for a piece it is fetching itself;
    # then the child asks the next one up
    wait: float = duration_field(10.0, min=0.1, max=600.0)
    connections: int = field(default=64, metadata={"min": 1, "max": 4096})


@dataclass(frozen=True)
class Control:
    socket: str = "/run/wagent/control.sock"
    group: str = "wagent"


@dataclass(frozen=True)
class Policy:
    version: int = SCHEMA_VERSION
    roles: tuple[Role, ...] = ()
    default_role: str = "training"       # role of a node no pattern matches
    cache_role: str | None = "cache"     # pulls ahead of every wave (offset 0, no wave delay)
    waves: Waves = field(default_factory=Waves)
    sources: tuple[Source, ...] = ()
    models: tuple[Model, ...] = ()
    poll_interval: float = duration_field(300.0)  # how often "latest" is polled
    store: StoreSettings = field(default_factory=StoreSettings)
    pulls: Pulls = field(default_factory=Pulls)
    shaping: Shaping = field(default_factory=Shaping)
    backoff: Backoff = field(default_factory=Backoff)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    control: Control = field(default_factory=Control)
    mounts: Mounts = field(default_factory=Mounts)
    peers: Peers = field(default_factory=Peers)
    state_dir: str = "/var/lib/wagent"
    # IANA name (Europe/Berlin) of the clock the role windows' cron fields are read on
    timezone: str = "UTC"
    path: str = field(default="", metadata={"yaml": False})    # file it was loaded from
    sha256: str = field(default="", metadata={"yaml": False})  # of the file's bytes, for status

    def __post_init__(self) -> None:
        object.__setattr__(self, "backoff", self.backoff.resolved(self.shaping.link_rate))
        if isinstance(self.mounts.read_floor, Share):
            object.__setattr__(self, "mounts", replace(
                self.mounts, read_floor=resolve_rate(self.mounts.read_floor,
                                                     self.shaping.link_rate)))
        if isinstance(self.peers.upload, Share):
            object.__setattr__(self, "peers", replace(
                self.peers, upload=resolve_rate(self.peers.upload, self.shaping.link_rate)))
        if self.peers.enabled and self.shaping.enabled:
            # Serving peers is distribution traffic on egress, and fetching from them on
            # ingress: the same HTB classes, the same backoff.
            sh = self.shaping
            object.__setattr__(self, "shaping", replace(
                sh, serve_ports=tuple(sorted({*sh.serve_ports, self.peers.port})),
                pull_ports=tuple(sorted({*sh.pull_ports, self.peers.port})) if sh.pull_ports
                else ()))
        if any(w.tz != self.timezone for r in self.roles for w in r.windows):
            # Every window reads its cron on the policy's clock: one place says which.
            object.__setattr__(self, "roles", tuple(
                replace(r, windows=tuple(replace(w, tz=self.timezone) for w in r.windows))
                for r in self.roles))

    @property
    def shaped_sources(self) -> tuple[Source, ...]:
        """The sources whose ports the ingress tree matches: the policy's, and the peers'."""
        if not self.peers.enabled:
            return self.sources
        return (*self.sources, Source(f"http://peers:{self.peers.port}"))

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)
