"""On/off bursts with an application-level ack (all-reduce-like), each burst timed end to end.

NCCL's collectives over TCP send a step's data in a burst, then the step waits for its peers;
what the training job feels is how long a burst takes to be *received*, not a flow's average
rate. So the sender (the origin side, like a peer sending its share) sends ``size`` bytes, and
the receiver answers one byte once it has read the burst's last byte; the burst's time is from
its first write to that ack. Then the sender stays idle ``gap`` seconds and sends the next.

Wire format, sender to receiver: 8 bytes big-endian burst size, then that many bytes (a size of
0 ends the run); receiver to sender: one byte per burst received.

    flow = start_bursts(sender_host, receiver_host, server=link.a.ip4, port=40123,
                        size=24 * 10**6, gap=0.5, count=30)
    bursts = flow.result()      # [Burst(index=0, size=24000000, started=..., seconds=0.23), ...]

Both ends run as ``python -m tests.testbed.bursts send|receive`` inside the hosts; the sender
prints one JSON line per burst (``started`` is time.monotonic(), one clock for every namespace of
this machine, so a harness can line bursts up with its own samples).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from tests.testbed.hosts import CommandFailed, Host, stop_process, wait_listening

HEADER = struct.Struct("!Q")
ACK = b"A"


@dataclass(frozen=True)
class Burst:
    index: int
    size: int              # bytes
    started: float         # time.monotonic() at its first write
    seconds: float         # until the receiver's ack arrived

    @property
    def bps(self) -> float:
        return self.size * 8 / self.seconds if self.seconds > 0 else 0.0


# --- the two ends (run inside the hosts) ------------------------------------------------------
def send(port: int, size: int, gap: float, count: int, seconds: float | None,
         out: Any = sys.stdout) -> None:
    """Listen on ``port``, take one receiver, send it bursts; one JSON line per burst."""
    try:
        listener = socket.create_server(("::", port), family=socket.AF_INET6,
                                        dualstack_ipv6=True)
    except OSError:                      # no IPv6 here
        listener = socket.create_server(("0.0.0.0", port))
    print(json.dumps({"listening": port}), file=out, flush=True)
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytes(size))
    ack = bytearray(1)
    deadline = None if seconds is None else time.monotonic() + seconds
    i = 0
    while i < count and (deadline is None or time.monotonic() < deadline):
        started = time.monotonic()
        conn.sendall(HEADER.pack(size))
        conn.sendall(payload)
        if conn.recv_into(ack, 1) != 1:
            raise ConnectionError("the receiver went away mid-run")
        took = time.monotonic() - started
        print(json.dumps({"index": i, "size": size, "started": started, "seconds": took}),
              file=out, flush=True)
        i += 1
        time.sleep(gap)
    conn.sendall(HEADER.pack(0))
    conn.close()


def receive(server: str, port: int) -> int:
    """Connect, read bursts and ack each one; returns how many were received."""
    conn = socket.create_connection((server, port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(1 << 20))
    head = bytearray(HEADER.size)
    n = 0
    while True:
        _read_exactly(conn, memoryview(head), HEADER.size)
        (size,) = HEADER.unpack(head)
        if size == 0:
            return n
        left = size
        while left:
            got = conn.recv_into(buf, min(len(buf), left))
            if not got:
                raise ConnectionError("the sender went away mid-burst")
            left -= got
        conn.sendall(ACK)
        n += 1


def _read_exactly(conn: socket.socket, view: memoryview, n: int) -> None:
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the sender closed the connection")
        got += k


# --- the harness's side -------------------------------------------------------------------------
@dataclass
class BurstFlow:
    """A running burst sender and receiver; ``result()`` waits for them and parses."""

    sender: subprocess.Popen
    receiver: subprocess.Popen
    deadline: float
    host: str = "sender"

    def running(self) -> bool:
        return self.sender.poll() is None

    def stop(self) -> None:
        stop_process(self.receiver)
        stop_process(self.sender)

    def result(self) -> list[Burst]:
        try:
            out, err = self.sender.communicate(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if self.sender.returncode != 0:
            self.stop()
            raise CommandFailed(self.host, self.sender.returncode,
                                list(map(str, self.sender.args)), out, err)
        try:
            self.receiver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.stop()                  # the bursts were all acked: nothing is lost
        return parse(out)


def parse(text: str) -> list[Burst]:
    bursts = []
    for line in text.splitlines():
        doc = json.loads(line)
        if "index" in doc:
            bursts.append(Burst(doc["index"], doc["size"], doc["started"], doc["seconds"]))
    return bursts


def start_bursts(sender: Host, receiver: Host, server: str, port: int, size: int = 24 * 10**6,
                 gap: float = 0.5, count: int = 30, seconds: float | None = None) -> BurstFlow:
    """Bursts from ``sender`` (listening on ``port``) to ``receiver``, which connects to
    ``server`` (an address of the sender). Both processes are the testbed's, killed with it."""
    argv = [sys.executable, "-m", "tests.testbed.bursts", "send", "--port", str(port),
            "--size", str(size), "--gap", str(gap), "--count", str(count)]
    if seconds is not None:
        argv += ["--seconds", str(seconds)]
    send_proc = sender.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_listening(send_proc, sender.ns, port, f"burst sender on {sender.name}")
    recv_proc = receiver.popen([sys.executable, "-m", "tests.testbed.bursts", "receive",
                                "--server", server, "--port", str(port)], log="bursts-receiver")
    longest = count * (gap + 30.0) if seconds is None else seconds + 30.0
    return BurstFlow(send_proc, recv_proc, time.monotonic() + longest, sender.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("send")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--size", type=int, default=24 * 10**6)
    s.add_argument("--gap", type=float, default=0.5)
    s.add_argument("--count", type=int, default=30)
    s.add_argument("--seconds", type=float)
    r = sub.add_parser("receive")
    r.add_argument("--server", required=True)
    r.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    if args.mode == "send":
        send(args.port, args.size, args.gap, args.count, args.seconds)
    else:
        receive(args.server, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
