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
from collections.abc import Mapping, Sequence
from pathlib import Path

from shaping.detect.counters import CounterRates
from shaping.detect.readings import LinkReading

# Never ours to judge: loopback and IFB devices, which see ingress traffic a second time
# (wagent's own are named ``wg-<interface>``, see ``shaping.plan.ifb_name``).
DEFAULT_EXCLUDE = ("lo", "ifb*", "wg-*")
# Bytes of ACKs per byte of data received: one 66-byte ACK per one or two 1448-byte segments.
ACK_SHARE = 0.05


class LinkDetector:
    def __init__(self, root: str | Path = "/", interfaces: Sequence[str] = (),
                 exclude: Sequence[str] = DEFAULT_EXCLUDE, count_all: bool = False,
                 ack_share: float = ACK_SHARE) -> None:
        self._net = Path(root) / "sys" / "class" / "net"
        self._interfaces = tuple(interfaces)
        self._exclude = tuple(exclude)
        self._count_all = count_all
        self._ack_share = ack_share
        self._counters = CounterRates()

    def interfaces(self) -> tuple[str, ...]:
        if self._interfaces:
            return self._interfaces
        try:
            names = sorted(p.name for p in self._net.iterdir())
        except OSError:
            return ()
        return tuple(n for n in names if not any(fnmatch.fnmatch(n, x) for x in self._exclude))

    def sample(self, now: float, distribution: Mapping[str, tuple[int, int]] | None = None,
               ) -> tuple[LinkReading, ...]:
        distribution = distribution or {}
        out: list[LinkReading] = []
        live: set[tuple[str, str]] = set()
        for ifname in self.interfaces():
            stats = _read_stats(self._net / ifname)
            if stats is None:
                continue  # vanished (or never there): a new one gets a fresh baseline
            ifindex, rx, tx = stats
            dist = distribution.get(ifname)
            keys = [(ifname, "rx"), (ifname, "tx")]
            values = [rx, tx]
            if dist is not None:
                keys += [(ifname, "dist_rx"), (ifname, "dist_tx")]
                values += list(dist)
            live.update(keys)
            rates = [self._counters.rate(k, ifindex, v, now)
                     for k, v in zip(keys, values, strict=True)]
            if any(r is None for r in rates):
                continue
            rx_bps, tx_bps = rates[0] * 8, rates[1] * 8
            if dist is None:
                if not self._count_all:
                    continue
                out.append(LinkReading(ifname, max(rx_bps, tx_bps), rx_bps, tx_bps, None))
                continue
            drx, dtx = rates[2] * 8, rates[3] * 8
            # The pulls' own ACKs go out unshaped (and a serving class's come back in).
            other = max(rx_bps - drx - self._ack_share * dtx,
                        tx_bps - dtx - self._ack_share * drx, 0.0)
            out.append(LinkReading(ifname, other, rx_bps, tx_bps, drx + dtx))
        self._counters.forget_except(live)
        return tuple(out)


def _read_stats(dev: Path) -> tuple[int, int, int] | None:
    try:
        ifindex = int((dev / "ifindex").read_text())
        rx = int((dev / "statistics" / "rx_bytes").read_text())
        tx = int((dev / "statistics" / "tx_bytes").read_text())
    except (OSError, ValueError):
        return None
    return ifindex, rx, tx
