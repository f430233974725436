"""Other traffic on the node's interfaces: what arrived or left that is not distribution traffic.

The distribution's counters come from the caller (only ``shaping/netlink.py`` may read tc
statistics), cumulative per interface, as ``shaping.observed.LinkCounters``. Without them the
interface's whole traffic would count as "other", our own pulls included, so an interface with
no distribution counter is not reported at all unless ``count_all=True`` (a node that is not
pulling).

Received: when the counters carry ``rx_seen`` (every byte the ingress hook counted; the
redirects to the IFB count ``rx_dist`` at the same hook with the same accounting) the other
traffic is exactly their difference. Otherwise it is ``{root}/sys/class/net/<if>/statistics/
rx_bytes`` minus ``rx_dist``, which is only as good as the two agree: a veth counts a GSO packet
once, a NIC every frame with its headers, an HTB class every segment's headers (up to 4.5% of
the pull's rate apart: enough to hide, or to invent, a small flow). Sent: ``tx_bytes`` minus
the egress class's bytes, and the pulls' own ACKs (``ack_share`` of what they receive).

The rates are those of the last tick, not an average: a flow is judged in the tick it starts.

    det = LinkDetector(interfaces=("eth0",))
    det.sample(now, {"eth0": LinkCounters(rx_dist, tx_dist, rx_seen)})  # -> (LinkReading, ...)
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agent.yielding.detect.counters import CounterRates
from agent.yielding.detect.readings import LinkReading
from shaping.observed import LinkCounters

# Never ours to judge: loopback and IFB devices, which see ingress traffic a second time
# (wagent's own are named ``wg-<interface>``, see ``shaping.plan.ifb_name``).
DEFAULT_EXCLUDE = ("lo", "ifb*", "wg-*")
# Bytes of ACKs per byte of data received: one 66-byte ACK per one or two 1448-byte segments.
ACK_SHARE = 0.05

Distribution = (Mapping[str, LinkCounters]
                | Callable[[], Mapping[str, LinkCounters] | None])


class LinkDetector:
    def __init__(self, root: str | Path = "/", interfaces: Sequence[str] = (),
                 exclude: Sequence[str] = DEFAULT_EXCLUDE, count_all: bool = False,
                 ack_share: float = ACK_SHARE, average_over: float = 0.0) -> None:
        self._net = Path(root) / "sys" / "class" / "net"
        self._interfaces = tuple(interfaces)
        self._exclude = tuple(exclude)
        self._count_all = count_all
        self._ack_share = ack_share
        # Rates are averaged over at least this long: one short tick is noisy (reads of the
        # link and of the classes a few ms apart), and a real flow crosses the threshold of
        # the average within a fraction of that time anyway.
        self._average_over = average_over
        self._history: dict[str, list[tuple[float, list[float]]]] = {}
        self._seen_at: dict[str, float] = {}
        self._counters = CounterRates()
        # sysfs files stay open and are read with pread: opening them cost more than the rest
        # of a tick on a busy host (measured). A fixture tree is read afresh each time: a file
        # removed there would still read through an open descriptor.
        self._files = _OpenFiles() if Path(root) == Path("/") else None

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
        """Rates over the last ``average_over`` seconds. ``distribution`` is the distribution
        classes' cumulative ``{ifname: LinkCounters}``, or a callable returning it: then the link's
        counters are read just before and just after it and averaged, so both are taken at one
        instant (at 1 Gbit/s, 10 ms between two reads is 100 Mbit/s of phantom traffic over a
        100 ms tick)."""
        names = self.interfaces()
        read = self._files.stats if self._files is not None else _read_stats
        if callable(distribution):
            before = {n: read(self._net / n) for n in names}
            dist_now = distribution() or {}
            if all(isinstance(dist_now.get(n), LinkCounters) and dist_now[n].rx_seen is not None
                   for n in names):
                after = before   # received traffic is exact: tx alone needs no midpoint
            else:
                after = {n: read(self._net / n) for n in names}
        else:
            dist_now = distribution or {}
            before = after = {n: read(self._net / n) for n in names}
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
                values += [dist.rx_dist, dist.tx_dist]
                if dist.rx_seen is not None:
                    keys.append((ifname, "seen_rx"))
                    values.append(dist.rx_seen)
            live.update(keys)
            rates = [self._counters.rate(k, ifindex, v, now)
                     for k, v in zip(keys, values, strict=True)]
            if any(r is None for r in rates) or (dist is None and not self._count_all):
                self._history.pop(ifname, None)
                self._seen_at[ifname] = now
                continue
            out.append(self._averaged(ifname, now, [r * 8 for r in rates]))  # type: ignore
        for ifname in names:
            if after[ifname] is not None:
                self._seen_at[ifname] = now
        self._counters.forget_except(live)
        for gone in set(self._history) - {k[0] for k in live}:
            del self._history[gone]
        return tuple(out)

    def _averaged(self, ifname: str, now: float, bps: list[float]) -> LinkReading:
        if self._average_over <= 0:
            mean = bps                   # the last tick's rates (the backoff loop's case)
        else:
            prev_at = self._seen_at.get(ifname, now)
            hist = self._history.setdefault(ifname, [])
            hist.append((now - prev_at, bps))
            # Keep the fewest recent ticks that still cover ``average_over``.
            while len(hist) > 1 and sum(dt for dt, _ in hist[1:]) >= self._average_over - 1e-9:
                hist.pop(0)
            total = sum(dt for dt, _ in hist) or 1.0
            mean = [sum(dt * b[i] for dt, b in hist) / total for i in range(len(bps))]
        rx_bps, tx_bps = mean[0], mean[1]
        if len(mean) == 2:
            return LinkReading(ifname, max(rx_bps, tx_bps), rx_bps, tx_bps, None)
        drx, dtx = mean[2], mean[3]
        if len(mean) == 5:
            # Both from the ingress hook: exact. (A serving class's ACKs come back in here too,
            # but serving and pulling on one link is a cache node's business.)
            other_rx = mean[4] - drx
        else:
            other_rx = rx_bps - drx - self._ack_share * dtx
        # The pulls' own ACKs go out unshaped.
        other = max(other_rx, tx_bps - dtx - self._ack_share * drx, 0.0)
        return LinkReading(ifname, other, rx_bps, tx_bps, drx + dtx)




def _midpoint(a: tuple[int, int, int] | None,
              b: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """Counters halfway between two reads of one device (None if it changed or vanished)."""
    if a is None or b is None or a[0] != b[0] or b[1] < a[1] or b[2] < a[2]:
        return b if a is None or b is None or a[0] != b[0] else a
    return a[0], (a[1] + b[1]) // 2, (a[2] + b[2]) // 2


class _OpenFiles:
    """An interface's ifindex, rx_bytes and tx_bytes, kept open; a read that fails (the device
    is gone: sysfs answers ENODEV) closes them, and the next read opens the new device's."""

    NAMES = ("ifindex", "statistics/rx_bytes", "statistics/tx_bytes")

    def __init__(self) -> None:
        self._fds: dict[Path, list[int]] = {}

    def stats(self, dev: Path) -> tuple[int, int, int] | None:
        for _ in (0, 1):
            fds = self._fds.get(dev)
            if fds is None:
                fds = self._fds[dev] = []
                try:
                    for n in self.NAMES:
                        fds.append(os.open(dev / n, os.O_RDONLY))
                except OSError:
                    self.close(dev)
                    return None
            try:
                ifindex, rx, tx = (int(os.pread(fd, 32, 0)) for fd in fds)
            except (OSError, ValueError):
                self.close(dev)
                continue
            return ifindex, rx, tx
        return None

    def close(self, dev: Path) -> None:
        for fd in self._fds.pop(dev, []):
            os.close(fd)

    def __del__(self) -> None:
        for dev in list(self._fds):
            self.close(dev)


def _read_stats(dev: Path) -> tuple[int, int, int] | None:
    try:
        ifindex = int((dev / "ifindex").read_text())
        rx = int((dev / "statistics" / "rx_bytes").read_text())
        tx = int((dev / "statistics" / "tx_bytes").read_text())
    except (OSError, ValueError):
        return None
    return ifindex, rx, tx
