"""Other traffic on the node's interfaces: link bytes minus the distribution class's bytes.

Reads ``{root}/sys/class/net/<if>/statistics/{rx,tx}_bytes``. The distribution class's bytes
come from the caller (only ``shaping/netlink.py`` may read tc statistics), as cumulative
``(rx, tx)`` per interface. Without them the interface's whole traffic would count as "other",
our own pulls included, so an interface with no distribution counter is not reported at all
unless ``count_all=True`` (a node that is not pulling).

    det = LinkDetector(interfaces=("eth0",))
    det.sample(now, {"eth0": (dist_rx_bytes, dist_tx_bytes)})  # -> (LinkReading, ...)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from shaping.detect.counters import CounterRates
from shaping.detect.readings import LinkReading

# Never ours to judge: loopback and IFB devices, which see ingress traffic a second time
# (wagent's own are named ``wg-<interface>``, see ``shaping.plan.ifb_name``).
DEFAULT_EXCLUDE = ("lo", "ifb*", "wg-*")
# Bytes of ACKs per byte of data received: one 66-byte ACK per one or two 1448-byte segments.
ACK_SHARE = 0.05

Distribution = Mapping[str, tuple[int, int]] | Callable[[], Mapping[str, tuple[int, int]] | None]


class LinkDetector:
    def __init__(self, root: str | Path = "/", interfaces: Sequence[str] = (),
                 exclude: Sequence[str] = DEFAULT_EXCLUDE, count_all: bool = False,
                 ack_share: float = ACK_SHARE, window: float = 0.0) -> None:
        self._net = Path(root) / "sys" / "class" / "net"
        self._interfaces = tuple(interfaces)
        self._exclude = tuple(exclude)
        self._count_all = count_all
        self._ack_share = ack_share
        # Rates are averaged over at least this long: one short tick is noisy (reads of the
        # link and of the classes a few ms apart), and a real flow crosses the threshold of
        # the average within a fraction of the window anyway.
        self._window = window
        self._history: dict[str, list[tuple[float, list[float]]]] = {}
        self._seen_at: dict[str, float] = {}
        self._counters = CounterRates()

    def interfaces(self) -> tuple[str, ...]:
        if self._interfaces:
            return self._interfaces
        try:
            names = sorted(p.name for p in self._net.iterdir())
        except OSError:
            return ()
        return tuple(n for n in names if not any(fnmatch.fnmatch(n, x) for x in self._exclude))

    def sample(self, now: float, distribution: Distribution | None = None,
               ) -> tuple[LinkReading, ...]:
        """Rates over the last ``window`` seconds. ``distribution`` is the distribution classes'
        cumulative ``{ifname: (rx, tx)}``, or a callable returning it: then the interface counters
        are read just before and just after it and averaged, so both are taken at one instant
        (at 1 Gbit/s, 10 ms between two reads is 100 Mbit/s of phantom traffic over a 100 ms
        tick)."""
        names = self.interfaces()
        before = {n: _read_stats(self._net / n) for n in names}
        if callable(distribution):
            dist_now = distribution() or {}
            after = {n: _read_stats(self._net / n) for n in names}
        else:
            dist_now, after = distribution or {}, before
        out: list[LinkReading] = []
        live: set[tuple[str, str]] = set()
        for ifname in names:
            stats = _midpoint(before[ifname], after[ifname])
            if stats is None:
                self._history.pop(ifname, None)
                continue  # vanished (or never there): a new one gets a fresh baseline
            ifindex, rx, tx = stats
            dist = dist_now.get(ifname)
            keys = [(ifname, "rx"), (ifname, "tx")]
            values = [rx, tx]
            if dist is not None:
                keys += [(ifname, "dist_rx"), (ifname, "dist_tx")]
                values += list(dist)
            live.update(keys)
            rates = [self._counters.rate(k, ifindex, v, now)
                     for k, v in zip(keys, values, strict=True)]
            if any(r is None for r in rates) or (dist is None and not self._count_all):
                self._history.pop(ifname, None)
                self._seen_at[ifname] = now
                continue
            out.append(self._windowed(ifname, now, [r * 8 for r in rates]))  # type: ignore
        for ifname in names:
            if after[ifname] is not None:
                self._seen_at[ifname] = now
        self._counters.forget_except(live)
        for gone in set(self._history) - {k[0] for k in live}:
            del self._history[gone]
        return tuple(out)

    def _windowed(self, ifname: str, now: float, bps: list[float]) -> LinkReading:
        prev_at = self._seen_at.get(ifname, now)
        hist = self._history.setdefault(ifname, [])
        hist.append((now - prev_at, bps))
        # Keep the fewest recent ticks that still span the window.
        while len(hist) > 1 and sum(dt for dt, _ in hist[1:]) >= self._window - 1e-9:
            hist.pop(0)
        total = sum(dt for dt, _ in hist) or 1.0
        mean = [sum(dt * b[i] for dt, b in hist) / total for i in range(len(bps))]
        rx_bps, tx_bps = mean[0], mean[1]
        if len(mean) == 2:
            return LinkReading(ifname, max(rx_bps, tx_bps), rx_bps, tx_bps, None)
        drx, dtx = mean[2], mean[3]
        # The pulls' own ACKs go out unshaped (and a serving class's come back in).
        other = max(rx_bps - drx - self._ack_share * dtx, tx_bps - dtx - self._ack_share * drx,
                    0.0)
        return LinkReading(ifname, other, rx_bps, tx_bps, drx + dtx)


def _midpoint(a: tuple[int, int, int] | None,
              b: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """Counters halfway between two reads of one device (None if it changed or vanished)."""
    if a is None or b is None or a[0] != b[0] or b[1] < a[1] or b[2] < a[2]:
        return b if a is None or b is None or a[0] != b[0] else a
    return a[0], (a[1] + b[1]) // 2, (a[2] + b[2]) // 2


def _read_stats(dev: Path) -> tuple[int, int, int] | None:
    try:
        ifindex = int((dev / "ifindex").read_text())
        rx = int((dev / "statistics" / "rx_bytes").read_text())
        tx = int((dev / "statistics" / "tx_bytes").read_text())
    except (OSError, ValueError):
        return None
    return ifindex, rx, tx
