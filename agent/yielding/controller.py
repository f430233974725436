"""The backoff controller: readings in, the distribution rate out. Pure: no I/O, no clock.

AIMD with hysteresis. Each tick the readings are judged (``assess``):

- *training*: a TCP connection on a training port (its presence alone: a flow that distribution
  starves carries little at first), a process mapping libnccl, RDMA at or above
  ``rdma_threshold``, or other link traffic at or above ``link_threshold`` (any port: the
  pull's receive windows keep its share of the bottleneck's queue small, so a new flow is not
  starved and shows up in the link's counters within the tick it starts);
- *quiet*: none of those, and RDMA and other traffic below half their thresholds;
- in between (the hysteresis band): neither; nothing changes.

Training cuts the rate at once, to ``floor`` (``decrease`` = 0) or by the factor ``decrease``
every tick it lasts, never below the floor. After ``quiet`` seconds of uninterrupted quiet (and
at least ``min_hold`` in the backed-off state) the rate climbs by ``increase`` per tick up to
the cap, where the state is "full" again.

>>> from agent.policy.model import Backoff
>>> from agent.yielding.detect.readings import PortReading, Readings
>>> c = Controller(Backoff(floor=10**7, quiet=2.0, increase=4 * 10**8), cap_bps=10**9)
>>> c.step(Readings(at=0.0), now=0.0).state
'full'
>>> d = c.step(Readings(at=1.0, ports=(PortReading(29500, 1, None, ("10.0.0.1:29500",)),)), 1.0)
>>> d.rate_bps, d.state, d.reason
(10000000, 'backed_off', 'a TCP connection on training port 29500 (10.0.0.1:29500)')
>>> d.signals
('training_port',)
>>> [c.step(Readings(at=t), t).rate_bps for t in (2.0, 3.0, 4.0, 5.0, 6.0)]
[10000000, 410000000, 810000000, 1000000000, 1000000000]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent.policy.model import Backoff
from agent.units import format_rate
from agent.yielding.detect.readings import Readings

FULL, BACKED_OFF, RAMPING = "full", "backed_off", "ramping"
# The kinds of signal that make the controller back off (metrics label them by these names).
TRAINING_PORT, LINK, RDMA, NCCL = "training_port", "link", "rdma", "nccl"
SIGNAL_KINDS = (TRAINING_PORT, LINK, RDMA, NCCL)
# The signals that name training (a port, the RDMA counters, a process): the link's other
# traffic is anything, an inference engine's requests as much as a training step.
IDENTIFIED = (TRAINING_PORT, RDMA, NCCL)
QUIET_FRACTION = 0.5          # quiet means below half the trigger thresholds
RDMA_OPS_THRESHOLD = 1000.0   # RDMA requests/s that count when no byte counter is readable
MAX_REASONS = 2
EPSILON = 1e-6                # ticks at 0.1 s add up to 0.9999999 s


@dataclass(frozen=True)
class Signal:
    level: str                # "training" | "band" | "quiet"
    reason: str
    kinds: tuple[str, ...] = ()   # the SIGNAL_KINDS that said "training"


@dataclass(frozen=True)
class Decision:
    rate_bps: int
    state: str                # "full" | "backed_off" | "ramping"
    reason: str
    changed: bool             # rate or state differs from the previous tick's
    since: float              # when the current state began
    signals: tuple[str, ...] = ()  # kinds behind a backoff this tick (empty when not training)
    # training an IDENTIFIED signal named, this tick or within ``quiet`` before it
    identified: bool = False
    lifted: bool = False           # raised to ``mounts.read_floor`` for a waiting reader


def assess(readings: Readings, backoff: Backoff, link_bps: int | None = None) -> Signal:
    """Judge one tick's readings: training present, quiet, or in the band between.

    ``backoff``'s rates must be absolute (``Backoff.resolved``); ``link_bps``, when known, puts
    other traffic in proportion to the link in the reason."""
    causes: list[tuple[str, str]] = []
    band: list[str] = []
    other = max(readings.links, key=lambda r: r.other_bps, default=None)
    worded = None  # the link whose traffic a port's reason already names
    for p in readings.ports:
        if p.connections <= 0:
            continue
        if p.bps:
            peers = f" ({', '.join(p.peers)})" if p.peers else ""
            causes.append((TRAINING_PORT, f"training traffic {format_rate(p.bps)} on port "
                                          f"{p.port}{peers}"))
        else:
            peers = ", ".join(p.peers) or f"{p.connections} connections"
            extra = ""
            if other is not None and other.other_bps >= backoff.link_threshold * QUIET_FRACTION:
                extra = f"; {_other(other.other_bps, other.ifname, link_bps)}"
                worded = other
            what = "a TCP connection" if p.connections == 1 else f"{p.connections} TCP connections"
            causes.append((TRAINING_PORT, f"{what} on training port {p.port} ({peers}{extra})"))
    for r in readings.rdma:
        if r.bps >= backoff.rdma_threshold:
            causes.append((RDMA, f"RDMA traffic {format_rate(r.bps)} on {r.name}"))
        elif r.ops_per_s >= RDMA_OPS_THRESHOLD:
            causes.append((RDMA, f"RDMA {r.ops_per_s:.0f} requests/s on {r.name}"))
        elif (r.bps >= backoff.rdma_threshold * QUIET_FRACTION
              or r.ops_per_s >= RDMA_OPS_THRESHOLD * QUIET_FRACTION):
            band.append(f"some RDMA traffic on {r.name}")
    if backoff.nccl_processes:
        causes += [(NCCL, f"NCCL process {n.pid} ({n.comm})") for n in readings.nccl]
    for link in sorted(readings.links, key=lambda r: -r.other_bps):
        if link is worded:
            continue
        if link.other_bps >= backoff.link_threshold:
            causes.append((LINK, _other(link.other_bps, link.ifname, link_bps)))
        elif link.other_bps >= backoff.link_threshold * QUIET_FRACTION:
            band.append(_other(link.other_bps, link.ifname, link_bps))
    if causes:
        more = len(causes) - MAX_REASONS
        text = "; ".join(c for _, c in causes[:MAX_REASONS]) + (f" (+{more} more)" if more > 0
                                                                 else "")
        return Signal("training", text, tuple(dict.fromkeys(k for k, _ in causes)))
    if band:
        return Signal("band", band[0])
    return Signal("quiet", "no training traffic")


def _other(bps: float, ifname: str, link_bps: int | None) -> str:
    share = f", {100 * bps / link_bps:.0f}% of the link" if link_bps else ""
    return f"other traffic {format_rate(bps)} on {ifname} (not wagent's, any port{share})"


class Controller:
    """Holds the AIMD state between ticks; ``step`` is deterministic in (readings, now).

    ``link_bps``: the link's rate, which shares of the link in ``backoff`` are taken of (a
    policy's ``backoff`` is already resolved); the cap when not given."""

    def __init__(self, backoff: Backoff, cap_bps: int, min_hold: float | None = None,
                 link_bps: int | None = None) -> None:
        self.link = link_bps
        self.cap = int(cap_bps)
        self.backoff = backoff
        self.min_hold = backoff.quiet if min_hold is None else min_hold
        self._rate = self.cap
        self._state = FULL
        self._since: float | None = None
        self._busy_at: float | None = None     # last tick that was not quiet
        self._reason = "no training traffic"
        self._cause = ""                       # the last training reason, kept while quiet
        self._identified_at: float | None = None   # last tick an IDENTIFIED signal fired
        self.events = 0                        # times training cut the rate from full/ramping
        self.events_by_signal: dict[str, int] = {}   # the same, counted per signal kind

    @property
    def backoff(self) -> Backoff:
        return self._backoff

    @backoff.setter
    def backoff(self, value: Backoff) -> None:
        self._backoff = value.resolved(self.link or self.cap)

    @property
    def floor(self) -> int:
        return min(self.backoff.floor, self.cap)

    def set_cap(self, cap_bps: int) -> None:
        """A new cap (policy reload): takes effect now when full, else bounds the ramp."""
        self.cap = int(cap_bps)
        if self._state == FULL or self._rate > self.cap:
            self._rate = self.cap if self._state == FULL else max(self.floor, self.cap)

    def step(self, readings: Readings, now: float) -> Decision:
        prev = (self._rate, self._state)
        if self._since is None:
            self._since = now
        if not self.backoff.enabled:
            self._rate, self._reason = self.cap, "backoff disabled"
            return self._decide(prev, FULL, now)
        signal = assess(readings, self.backoff, self.link)
        if signal.level != "quiet":
            self._busy_at = now
        if signal.level == "training":
            if self._state != BACKED_OFF:
                self.events += 1
                for kind in signal.kinds:
                    self.events_by_signal[kind] = self.events_by_signal.get(kind, 0) + 1
            if any(k in IDENTIFIED for k in signal.kinds):
                self._identified_at = now
            self._rate = self._cut(self._rate)
            self._reason = self._cause = signal.reason
            return self._decide(prev, BACKED_OFF, now, signal.kinds)
        if self._state == FULL:
            self._rate = self.cap
            self._reason = signal.reason
            return self._decide(prev, FULL, now)
        if signal.level == "band":
            # Something moderate: neither cut further nor climb (hysteresis).
            self._reason = f"holding: {signal.reason}"
            return self._decide(prev, self._state, now)
        quiet_for = now - (self._busy_at if self._busy_at is not None else self._since)
        if self._state == BACKED_OFF and (quiet_for + EPSILON < self.backoff.quiet
                                          or now - self._since + EPSILON < self.min_hold):
            self._reason = f"quiet for {quiet_for:.1f}s of {self.backoff.quiet:g}s, " \
                f"then ramping up (was: {self._cause})"
            return self._decide(prev, BACKED_OFF, now)
        self._rate = min(self.cap, self._rate + self.backoff.increase)
        if self._rate >= self.cap:
            self._reason = "no training traffic"
            return self._decide(prev, FULL, now)
        self._reason = f"quiet for {quiet_for:.1f}s: ramping up by " \
            f"{format_rate(self.backoff.increase)} per tick"
        return self._decide(prev, RAMPING, now)

    def _cut(self, rate: int) -> int:
        if self.backoff.decrease <= 0:
            return self.floor
        return max(self.floor, int(rate * self.backoff.decrease))

    def _decide(self, prev: tuple[int, str], state: str, now: float,
                signals: tuple[str, ...] = ()) -> Decision:
        if state != self._state:
            self._since = now
        self._state = state
        assert self._since is not None
        identified = self._identified_at is not None \
            and now - self._identified_at < self.backoff.quiet + EPSILON
        return Decision(self._rate, state, self._reason, (self._rate, state) != prev, self._since,
                        signals, identified)


def for_readers(decision: Decision, read_floor: int, cap: int) -> Decision:
    """The decision while a reader of a lazy mount waits for its bytes: at least ``read_floor``
    (``mounts.read_floor``, never above ``cap``), unless training was identified (a training
    port, RDMA, NCCL: the yield is for it, and it keeps it). The link's other traffic alone
    doesn't hold a waiting reader at the floor: an inference node starting its engine serves
    nothing until its bytes come, and the rest of the link is that traffic's still.

    >>> d = Decision(2_000_000, BACKED_OFF, "other traffic 600 Mbit/s", True, 0.0, (LINK,))
    >>> for_readers(d, 500_000_000, 1_000_000_000).rate_bps
    500000000
    >>> for_readers(replace(d, identified=True), 500_000_000, 10**9).rate_bps
    2000000
    """
    rate = min(read_floor, cap)
    if decision.identified or rate <= decision.rate_bps:
        return decision
    return replace(decision, rate_bps=rate, lifted=True,
                   reason=f"{decision.reason}; a reader of a mount waits: "
                   f"{format_rate(rate)} (mounts.read_floor)")
