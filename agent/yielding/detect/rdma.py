"""RDMA traffic from the InfiniBand/RoCE port counters: NCCL over RDMA never passes tc.

Reads, for every ``{root}/sys/class/infiniband/<dev>/ports/<n>/``:
- ``counters/port_rcv_data`` and ``port_xmit_data``, in 4-byte words (IBA spec; the kernel
  shows the 64-bit extended counters where the HCA has them, else 32-bit ones that saturate);
- ``hw_counters/``: byte counters some drivers keep there (``rx_bytes``/``tx_bytes`` on EFA,
  bnxt_re, irdma), used when the port counters are missing or stuck, and request counters
  (mlx5's ``rx_write_requests``, ``rx_read_requests``, ``rx_atomic_requests``) as operations/s.

Devices and ports may appear and vanish between ticks (a driver reload, an SR-IOV change): a new
one gets a baseline and reports from its second tick on.

    det = RdmaDetector()
    det.sample(now)  # -> (RdmaReading("mlx5_0", "1", bps=..., ops_per_s=...), ...)
"""

from __future__ import annotations

from pathlib import Path

from agent.yielding.detect.counters import CounterRates
from agent.yielding.detect.readings import RdmaReading

WORD = 4  # port_rcv_data / port_xmit_data count 32-bit words
EMPTY_RESCAN = 1.0  # seconds between listings while no device is there
HW_BYTES = (("rx_bytes", "tx_bytes"), ("recv_bytes", "send_bytes"))
HW_REQUESTS = ("rx_write_requests", "rx_read_requests", "rx_atomic_requests")


class RdmaDetector:
    def __init__(self, root: str | Path = "/") -> None:
        self._ib = Path(root) / "sys" / "class" / "infiniband"
        self._counters = CounterRates()
        self._empty_at: float | None = None    # when a listing last found no RDMA device

    def sample(self, now: float) -> tuple[RdmaReading, ...]:
        out: list[RdmaReading] = []
        live: set[tuple[str, ...]] = set()
        # A node without RDMA is looked at again once a second, not every tick: listing a
        # directory that isn't there cost a tenth of a tick's CPU (measured).
        if self._empty_at is not None and now - self._empty_at < EMPTY_RESCAN:
            return ()
        ports = self._ports()
        self._empty_at = None if ports else now
        for dev, port, pdir in ports:
            reading = self._port(dev, port, pdir, now, live)
            if reading is not None:
                out.append(reading)
        self._counters.forget_except(live)
        return tuple(out)

    def _port(self, dev: str, port: str, pdir: Path, now: float,
              live: set[tuple[str, ...]]) -> RdmaReading | None:
        try:
            # sysfs gives a re-created device new inodes: its counters restart, they don't wrap.
            generation = pdir.stat().st_ino
        except OSError:
            return None

        def rate(name: str, path: Path, scale: int = 1) -> float | None:
            return self._rate(live, (dev, port, name), generation, path, now, scale)

        counters, hw = pdir / "counters", pdir / "hw_counters"
        rx = rate("rcv", counters / "port_rcv_data", WORD)
        tx = rate("xmit", counters / "port_xmit_data", WORD)
        saturated = any((dev, port, d) in self._counters.saturated for d in ("rcv", "xmit"))
        bps = max(rx or 0.0, tx or 0.0) * 8
        if rx is None and tx is None:  # no port counters, a baseline tick, or stuck at 2^32-1
            for rx_name, tx_name in HW_BYTES:
                hrx, htx = rate(rx_name, hw / rx_name), rate(tx_name, hw / tx_name)
                if hrx is not None or htx is not None:
                    bps = max(hrx or 0.0, htx or 0.0) * 8
                    break
        ops = [o for o in (rate(n, hw / n) for n in HW_REQUESTS) if o is not None]
        if rx is None and tx is None and not ops and bps == 0.0 and not saturated:
            return None  # a baseline tick, or a port with nothing readable
        return RdmaReading(dev, port, bps, sum(ops), saturated)

    def _ports(self) -> list[tuple[str, str, Path]]:
        found = []
        try:
            devices = sorted(self._ib.iterdir())
        except OSError:
            return []
        for dev in devices:
            try:
                ports = sorted((dev / "ports").iterdir(), key=lambda p: p.name)
            except OSError:
                continue
            found += [(dev.name, p.name, p) for p in ports]
        return found

    def _rate(self, live: set[tuple[str, ...]], key: tuple[str, ...], generation: int, path: Path,
              now: float, scale: int) -> float | None:
        try:
            value = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None  # absent on this driver, or the device went away mid-read
        live.add(key)
        r = self._counters.rate(key, generation, value, now)
        return None if r is None else r * scale
