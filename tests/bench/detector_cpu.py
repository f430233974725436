"""What the fast path costs in CPU: the kernel detector per packet, and the readers' gate per read.

The detector (shaping/bpf.py) runs on every packet of the shaped links' ingress that is not
distribution traffic; the readers call the gate (agent/yielding/bursts.py ``BurstGate.hold``)
before each chunk they book. Measured here, each against a peer in the same run:

- the detector through ``BPF_PROG_TEST_RUN`` (the kernel runs the loaded program ``repeat``
  times on one packet and reports the mean), against an empty program (``return -1``): what
  the detector adds to a packet's way in;
- the gate's ``hold`` in Python against an empty lambda of the same signature.

From those, the share of one core at link rates this machine can't reach, with every packet
foreign (the worst case: training traffic arrives GRO'd in up to 64 KB packets on real NICs;
1500-byte packets are the bound without GRO), and the gate's share at the reads a pull makes
at 1 Gbit/s (fine reads: one per 16 kB window).

    python tests/bench/detector_cpu.py        # needs root (CAP_BPF)
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import agent.policy  # noqa: F401  (the policy package first: shaping imports its model)
from agent.policy.model import Backoff
from agent.yielding.bursts import BurstGate, rhythm_for, settings_for
from shaping import bpf

BPF_PROG_TEST_RUN = 10
REPEAT = 1_000_000
G = 10**9


def test_run(fd: int, packet: bytes, repeat: int = REPEAT) -> int:
    """Mean ns per run of program ``fd`` on ``packet`` (the kernel's own timing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    data = ctypes.create_string_buffer(packet, len(packet))
    attr = ctypes.create_string_buffer(struct.pack("=IIIIQQII", fd, 0, len(packet), 0,
                                                   ctypes.addressof(data), 0, repeat, 0), 128)
    nr = bpf._NR_BPF[platform.machine()]
    if libc.syscall(nr, BPF_PROG_TEST_RUN, attr, 128) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return int(struct.unpack_from("=I", attr.raw, 36)[0])


def empty_program(detector: bpf.Detector) -> int:
    return detector._load(struct.pack("<BBhi", 0xB7, 0, 0, -1) + struct.pack("<BBhi", 0x95, 0,
                                                                               0, 0))


def packet(size: int) -> bytes:
    # Ethernet + IPv4 + TCP headers, then payload: the detector reads only skb->len
    return (b"\x00" * 12 + b"\x08\x00" + b"\x45" + b"\x00" * 19 + b"\x00" * 20).ljust(size,
                                                                                        b"x")


def per_call(fn, n: int = 200_000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(10**9)
    return (time.perf_counter() - t) / n


def main() -> int:
    s = settings_for(Backoff().resolved(G))
    assert s is not None
    det = bpf.Detector(s)
    empty = empty_program(det)
    try:
        # The program reads skb->len only, so its cost doesn't depend on the packet's size
        # (and test runs take at most a page): one 1514-byte packet, the cost applied to both.
        d = test_run(det.fd, packet(1514))
        e = test_run(empty, packet(1514))
        rows = [(size, d, e) for size in (1514, 65_000)]
        gate = BurstGate(det.values, floor=lambda: 1, rhythm=rhythm_for(s, G, 120_000))
        hold, noop = per_call(gate.hold), per_call(lambda rate: 0.0)
    finally:
        os.close(empty)
        det.close()
    print("\nThe detector per packet (BPF_PROG_TEST_RUN, 1M runs), against an empty program:\n")
    print("| packet | detector | empty program | added | one core's share, all foreign at "
          "1 / 10 / 100 Gbit/s |")
    print("|---|---|---|---|---|")
    for size, d, e in rows:
        added = max(0, d - e)
        shares = " / ".join(f"{100 * rate / 8 / size * d * 1e-9:.2f}%"
                            for rate in (G, 10 * G, 100 * G))
        print(f"| {size} B | {d} ns | {e} ns | {added} ns | {shares} |")
    reads = G / 8 / 16_384               # fine reads at 1 Gbit/s: one per 16 kB window
    print("\nThe readers' gate per read (Python), against an empty callable:\n")
    print("| gate.hold | empty | reads/s at 1 Gbit/s (16 kB each) | one core's share |")
    print("|---|---|---|---|")
    print(f"| {hold * 1e9:.0f} ns | {noop * 1e9:.0f} ns | {reads:.0f} | "
          f"{100 * hold * reads:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
