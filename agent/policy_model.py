"""The policy as the rest of wagent sees it: frozen dataclasses, units already parsed.

Only ``agent.policy`` (the loader and validator) ever touches raw YAML; everything else takes a
``Policy``. Rates are bits per second, sizes bytes, durations seconds. Defaults here are the
defaults of the YAML keys, documented key by key in ``policies/fleet.example.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_WAVES = ("inference", "evaluation", "training")
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Window:
    """A time window in which pulls may run: opens at each ``cron`` match, lasts ``duration``.

    ``cron`` is five fields (minute hour day-of-month month day-of-week), day-of-week in cron's
    numbering (0 or 7 = Sunday) or names (mon-fri). A window may run across midnight.
    """

    cron: str
    duration: float


@dataclass(frozen=True)
class Role:
    name: str
    hosts: tuple[str, ...] = ()          # fnmatch patterns against the node's hostname
    windows: tuple[Window, ...] = ()     # empty: pulls may run at any time


@dataclass(frozen=True)
class Waves:
    order: tuple[str, ...] = DEFAULT_WAVES
    gap: float = 1800.0                  # between the start of one wave and the next
    spread: float = 1200.0               # per-node offsets are uniform in [0, spread)


@dataclass(frozen=True)
class Source:
    url: str                             # http(s) base URL; a version is at {url}/{model}/{version}/
    proxy: str | None = None             # HTTP proxy for this source (e.g. a Dragonfly dfdaemon)
    ca_bundle: str | None = None         # PEM file; TLS verification is always on
    credentials: str | None = None       # file: "bearer TOKEN" or "basic USER:PASSWORD"; never logged


@dataclass(frozen=True)
class Model:
    name: str
    version: str = "latest"              # "latest": resolved by polling {source}/{model}/latest
    pin: tuple[str, ...] = ()            # versions eviction never removes


@dataclass(frozen=True)
class Store:
    path: str = "/var/cache/wagent"
    keep_versions: int = 2               # per model, newest first, pins on top
    max_size: int | None = None          # bytes; evict least recently used beyond it
    evict_after: float | None = None     # seconds unused before a version not kept may go


@dataclass(frozen=True)
class Pulls:
    streams: int = 8
    piece_size: int = 64 * 2**20         # fixed pieces of non-safetensors files; split of big tensors
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    retries: int = 5
    rate: int | None = None              # static cap of the pulls' token bucket, bits/s


@dataclass(frozen=True)
class Shaping:
    enabled: bool = False
    interfaces: tuple[str, ...] = ()     # wagent never touches an interface not named here
    link_rate: int = 10**9               # the interface's rate (HTB root and default class ceil)
    pull_ports: tuple[int, ...] = ()     # sources' ports, matched as source port on ingress (IFB);
                                         # empty: taken from the sources' URLs
    serve_ports: tuple[int, ...] = ()    # matched as source port on egress; empty: no egress tree
    rate: int = 10**7                    # the distribution class's guaranteed rate
    ceil: int = 5 * 10**8                # the distribution class's cap
    priority: int = 7                    # HTB prio of the distribution class (0 highest, 7 lowest)
    take_over: bool = False              # replace a root qdisc wagent didn't make


@dataclass(frozen=True)
class Backoff:
    enabled: bool = True
    tick: float = 1.0                    # 0.1 s at the least
    floor: int = 10**7                   # rate while training traffic is present
    cap: int | None = None               # None: shaping.ceil
    decrease: float = 0.0                # multiplier on a detection: 0 = straight to the floor
    increase: int = 10**8                # additive step per tick once quiet
    quiet: float = 5.0                   # seconds with no training traffic before ramping up
    link_threshold: int = 5 * 10**7      # other (non-distribution) traffic on the link that counts
    rdma_threshold: int = 10**6          # RDMA traffic that counts
    training_ports: tuple[tuple[int, int], ...] = ((29500, 29500),)  # inclusive port ranges
    nccl_processes: bool = True          # a process mapping libnccl counts as training present
    roots: tuple[tuple[str, str], ...] = ()  # detector roots (proc, sys) overridden for tests


@dataclass(frozen=True)
class Metrics:
    listen: str | None = "127.0.0.1:9464"  # host:port for Prometheus, or None
    textfile: str | None = None            # node_exporter textfile path, or None


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
    poll_interval: float = 300.0         # how often "latest" is polled
    store: Store = field(default_factory=Store)
    pulls: Pulls = field(default_factory=Pulls)
    shaping: Shaping = field(default_factory=Shaping)
    backoff: Backoff = field(default_factory=Backoff)
    metrics: Metrics = field(default_factory=Metrics)
    control: Control = field(default_factory=Control)
    state_dir: str = "/var/lib/wagent"
    path: str = ""                       # file it was loaded from
    sha256: str = ""                     # of the file's bytes, shown by status

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)
