"""Traffic inside the testbed: iperf3 as the training-like flow, curl to measure goodput."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from tests.testbed.hosts import CommandFailed, Host, stop_process, wait_listening


@dataclass(frozen=True)
class IperfResult:
    """Goodput at the receiver: mean bits/s and per-interval (start s, end s, bits/s)."""

    bps: float
    intervals: list[tuple[float, float, float]]
    retransmits: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def iperf3_server(host: Host, port: int = 5201) -> subprocess.Popen:
    """A persistent iperf3 server (one test at a time), tracked and killed with the testbed."""
    proc = host.popen(["iperf3", "-s", "-p", str(port)], log=f"iperf3-server-{host.name}-{port}")
    wait_listening(proc, host.ns, port, f"iperf3 server on {host.name}",
                   log=getattr(proc, "log_path", None))
    return proc


@dataclass
class IperfFlow:
    """A running iperf3 client; result() waits for it and parses its JSON."""

    host: Host
    proc: subprocess.Popen
    argv: list[str]
    deadline: float

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_process(self.proc)

    def result(self) -> IperfResult:
        try:
            out, err = self.proc.communicate(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
            raise
        try:
            data = json.loads(out)
        except ValueError as e:
            raise CommandFailed(self.host.name, self.proc.returncode, self.argv, out,
                                err) from e
        if self.proc.returncode != 0 or "error" in data:
            raise CommandFailed(self.host.name, self.proc.returncode, self.argv,
                                data.get("error", out), err)
        return parse_iperf3(data)


def parse_iperf3(data: dict[str, Any]) -> IperfResult:
    """The receiver's view of an `iperf3 --json` report (forward or reverse alike)."""
    intervals = [(iv["sum"]["start"], iv["sum"]["end"], iv["sum"]["bits_per_second"])
                 for iv in data.get("intervals", [])]
    end = data.get("end", {})
    received = end.get("sum_received") or end.get("sum") or {}
    return IperfResult(float(received.get("bits_per_second", 0.0)), intervals,
                       end.get("sum_sent", {}).get("retransmits"), data)


def iperf3_start(host: Host, server: str, port: int = 5201, seconds: float = 10,
                 reverse: bool = False, streams: int = 1, cport: int | None = None,
                 congestion: str | None = None, bitrate: str | None = None) -> IperfFlow:
    """Start an iperf3 client in `host`; reverse=True makes the server the sender."""
    argv = ["iperf3", "-c", server, "-p", str(port), "-t", str(seconds), "--json",
            "-P", str(streams)]
    if reverse:
        argv.append("-R")
    if cport is not None:
        argv += ["--cport", str(cport)]
    if congestion:
        argv += ["-C", congestion]
    if bitrate:
        argv += ["-b", bitrate]
    proc = host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return IperfFlow(host, proc, argv, time.monotonic() + seconds + 30)


def goodput(host: Host, url: str, seconds: float = 10, streams: int = 1,
            byte_range: tuple[int, int] | None = None, curl_args: list[str] | None = None) -> float:
    """Bits/s that `streams` parallel curls in `host` receive from `url` over `seconds`.

    Each curl stops after `seconds` (or at the end of the file, or of `byte_range`); the figure
    is all bytes received divided by the longest transfer time.
    """
    argv = ["curl", "-sg", "-o", "/dev/null", "--max-time", str(seconds),
            "-w", "%{size_download} %{time_total} %{http_code}\\n", *(curl_args or [])]
    if byte_range is not None:
        argv += ["-r", f"{byte_range[0]}-{byte_range[1]}"]
    procs = [host.popen([*argv, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(streams)]
    total, longest = 0, 0.0
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 30)
        # 28: --max-time reached, the normal end of a timed measurement.
        if proc.returncode not in (0, 28):
            raise CommandFailed(host.name, proc.returncode, [*argv, url], out, err)
        size, elapsed, code = out.split()
        if not code.startswith("2"):
            raise CommandFailed(host.name, proc.returncode, [*argv, url], out,
                                f"HTTP status {code}")
        total += int(size)
        longest = max(longest, float(elapsed))
    return total * 8 / longest if longest else 0.0
