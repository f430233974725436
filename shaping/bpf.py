"""The burst detector in the kernel: a tc BPF program on the link's ingress that sees every packet
that is not distribution traffic, and a map the pull's readers read without a system call.

Why in the kernel: a training burst at 1 Gbit/s lasts tens of milliseconds, at 100 Gbit/s under
one. A Python loop reading counters every millisecond wakes late by p99 2.4 ms alone and 22 ms
when another thread holds the GIL (issue 23's measurements); a program run on each packet is
never late, costs a few dozen instructions per packet, and needs no thread at all.

Where: the ingress qdisc's u32 filters (``shaping.plan``, prefs 20 and 21) take distribution
traffic to the IFB first (mirred, stolen: the chain stops there). This program sits after them
(``DETECTOR_PREF``), so every packet it sees is someone else's: training, or anything else on the
link. It returns TC_ACT_UNSPEC: the packet goes on as if the filter weren't there.

What it keeps (one array map, mmapped by the agent, ``BPF_F_MMAPABLE``): a leaky bucket of
foreign bytes, drained at ``drain`` bytes/s (the policy's ``link_threshold``: traffic below that
share of the link never fills it), and a cut: when the bucket holds ``threshold`` bytes, the cut
lasts until ``hold`` ns after the last packet that found it that full; a cut that starts within
``merge`` ns of the last one's end is the same burst (its sender paused: a start and a count per
burst, which the rhythm of periodic bursts is read from). A burst at line rate fills
it in ``threshold / rate`` (64 KiB: 0.5 ms at 1 Gbit/s, 5 us at 100 Gbit/s); background traffic
(ssh, metrics, a GRO'd 64 KB aggregate now and then) never does. Times are CLOCK_MONOTONIC
(``bpf_ktime_get_ns``), which Python's ``time.monotonic_ns`` reads too.

Hand-assembled, loaded with the raw ``bpf()`` system call: no compiler at build time, no libbpf
at run time, nothing to ship but this file. The program is 55 instructions, with no packet
parsing (the u32 filters did that). Updates from two CPUs at once may lose one packet's count;
the bucket is a detector, not an account.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from dataclasses import dataclass

from shaping.errors import ShapingError

DETECTOR_PREF = 30          # after the redirect filters (shaping.plan: 20, 21)
DETECTOR_NAME = "wagent_bursts"

_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_MAP_CREATE, BPF_PROG_LOAD = 0, 5
BPF_MAP_TYPE_ARRAY = 2
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_F_MMAPABLE = 1 << 10
TC_ACT_UNSPEC = -1

# The map's one value: u64 fields at these offsets (the agent reads them with ``struct``).
LEVEL, LAST, CUT_UNTIL, CUT_START, BURSTS, FOREIGN, DRAIN, THRESHOLD, HOLD, HELD, MERGE = (
    8 * i for i in range(11))
VALUE_SIZE = 128
_U64 = struct.Struct("=Q")

# eBPF encoding (include/uapi/linux/bpf.h, bpf_common.h)
_ALU64, _JMP, _LDX, _STX, _ST, _LD = 0x07, 0x05, 0x01, 0x03, 0x02, 0x00
_DW, _W = 0x18, 0x00
_MEM, _IMM = 0x60, 0x00
_K, _X = 0x00, 0x08
_ADD, _SUB, _MUL, _DIV, _MOV = 0x00, 0x10, 0x20, 0x30, 0xB0
_JA, _JEQ, _JGT, _JGE, _JLT, _JLE, _CALL, _EXIT = 0x00, 0x10, 0x20, 0x30, 0xA0, 0xB0, 0x80, 0x90
_MAP_LOOKUP_ELEM, _KTIME_GET_NS = 1, 5
_PSEUDO_MAP_FD = 1
_INSN = struct.Struct("<BBhi")
_SKB_LEN = 0                # offsetof(struct __sk_buff, len)
_MAX_GAP_NS = 1_000_000_000  # the bucket is empty after a second of nothing (and no overflow)


def _i(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return _INSN.pack(code, (src << 4) | dst, off, imm)


def _ldx(dst: int, src: int, off: int) -> bytes:
    return _i(_LDX | _DW | _MEM, dst, src, off)


def _stx(dst: int, off: int, src: int) -> bytes:
    return _i(_STX | _DW | _MEM, dst, src, off)


def _alu(op: int, dst: int, *, src: int | None = None, imm: int = 0) -> bytes:
    if src is None:
        return _i(_ALU64 | op | _K, dst, 0, 0, imm)
    return _i(_ALU64 | op | _X, dst, src, 0, 0)


def _jmp(op: int, dst: int, off: int, *, src: int | None = None, imm: int = 0) -> bytes:
    if src is None:
        return _i(_JMP | op | _K, dst, 0, off, imm)
    return _i(_JMP | op | _X, dst, src, off, 0)


def program(map_fd: int) -> bytes:
    """The detector's instructions, for a map whose file descriptor is ``map_fd``.

    r6 ctx, r7 packet bytes, r8 now (ns), r9 the map value. Jump offsets count instructions
    after the jump; the labels below are checked by ``_resolve``."""
    code: list[bytes | tuple[str, int, int, str]] = [
        _alu(_MOV, 6, src=1),
        _i(_LDX | _W | _MEM, 7, 6, _SKB_LEN),                 # r7 = skb->len
        _i(_JMP | _CALL, imm=_KTIME_GET_NS),
        _alu(_MOV, 8, src=0),                                 # r8 = now
        _i(_ST | _W | _MEM, 10, 0, -4, 0),                    # key 0 on the stack
        _i(_LD | _DW | _IMM, 1, _PSEUDO_MAP_FD, 0, map_fd), _i(0),
        _alu(_MOV, 2, src=10),
        _alu(_ADD, 2, imm=-4),
        _i(_JMP | _CALL, imm=_MAP_LOOKUP_ELEM),
        ("jeq0", 0, 0, "out"),                                # no value: nothing to do
        _alu(_MOV, 9, src=0),
        _ldx(1, 9, FOREIGN), _alu(_ADD, 1, src=7), _stx(9, FOREIGN, 1),
        # drained = min(now - last, 1 s) x drain / 1e9; last = now
        _ldx(1, 9, LAST), _stx(9, LAST, 8),
        _alu(_MOV, 2, src=8), _alu(_SUB, 2, src=1),
        ("jle_imm", 2, _MAX_GAP_NS, "drain"),
        _alu(_MOV, 2, imm=_MAX_GAP_NS),
        ("label", 0, 0, "drain"),
        _ldx(3, 9, DRAIN), _alu(_MUL, 2, src=3), _alu(_DIV, 2, imm=1_000_000_000),
        # level = max(0, level - drained) + len
        _ldx(1, 9, LEVEL),
        ("jgt_reg", 1, 2, "sub"),
        _alu(_MOV, 1, imm=0),
        ("ja", 0, 0, "add"),
        ("label", 0, 0, "sub"),
        _alu(_SUB, 1, src=2),
        ("label", 0, 0, "add"),
        _alu(_ADD, 1, src=7),
        # below the threshold (or none set): no cut; above it, the level stays at the
        # threshold (the bucket's depth: a long burst leaves nothing to drain after it)
        _ldx(3, 9, THRESHOLD),
        ("jeq0", 3, 0, "store"),
        ("jlt_reg", 1, 3, "store"),
        _alu(_MOV, 1, src=3),
        _stx(9, LEVEL, 1),
        # a new cut (the last one ended more than ``merge`` ago: a burst whose sender paused
        # longer than the hold is one burst still): count it, and the time the last one held
        _ldx(4, 9, CUT_UNTIL),
        _ldx(5, 9, MERGE), _alu(_ADD, 5, src=4),
        ("jle_reg", 8, 5, "extend"),
        _ldx(5, 9, CUT_START), _alu(_SUB, 4, src=5),
        _ldx(5, 9, HELD), _alu(_ADD, 5, src=4), _stx(9, HELD, 5),
        _stx(9, CUT_START, 8),
        _ldx(5, 9, BURSTS), _alu(_ADD, 5, imm=1), _stx(9, BURSTS, 5),
        ("label", 0, 0, "extend"),
        _ldx(4, 9, HOLD), _alu(_ADD, 4, src=8), _stx(9, CUT_UNTIL, 4),
        ("ja", 0, 0, "out"),
        ("label", 0, 0, "store"),
        _stx(9, LEVEL, 1),
        ("label", 0, 0, "out"),
        _i(_ALU64 | _MOV | _K, 0, 0, 0, TC_ACT_UNSPEC),
        _i(_JMP | _EXIT),
    ]
    return _resolve(code)


def _resolve(code: list[bytes | tuple[str, int, int, str]]) -> bytes:
    """Turns the symbolic jumps into offsets (each ``bytes`` entry is one or two instructions)."""
    at: dict[str, int] = {}
    pc = 0
    for item in code:
        if isinstance(item, tuple) and item[0] == "label":
            at[item[3]] = pc
        else:
            pc += len(item) // _INSN.size if isinstance(item, bytes) else 1
    out = []
    pc = 0
    for item in code:
        if isinstance(item, bytes):
            out.append(item)
            pc += len(item) // _INSN.size
            continue
        kind, a, b, label = item
        if kind == "label":
            continue
        off = at[label] - pc - 1
        pc += 1
        match kind:
            case "jeq0":
                out.append(_jmp(_JEQ, a, off, imm=0))
            case "jle_imm":
                out.append(_jmp(_JLE, a, off, imm=b))
            case "jgt_reg":
                out.append(_jmp(_JGT, a, off, src=b))
            case "jlt_reg":
                out.append(_jmp(_JLT, a, off, src=b))
            case "jle_reg":
                out.append(_jmp(_JLE, a, off, src=b))
            case "ja":
                out.append(_jmp(_JA, 0, off))
            case _:
                raise ValueError(kind)
    return b"".join(out)


@dataclass(frozen=True)
class Settings:
    """What the detector counts as a burst (see the module's docstring)."""

    drain: int          # bytes/s
    threshold: int      # bytes
    hold_ns: int
    # a cut that starts within this long of the last one's end continues it (one burst: the
    # start the rhythm keeps, one count), though the readers read in between
    merge_ns: int = 0


class Detector:
    """The loaded program and its map: ``fd`` goes to ``Netlink.attach_detector``; ``values``
    is the map's memory, read by ``agent.yielding.bursts``. Close to free both (a filter that
    still holds the program keeps it alive in the kernel until the filter goes)."""

    def __init__(self, settings: Settings) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._nr = _NR_BPF.get(platform.machine())
        if self._nr is None:
            raise ShapingError(f"the burst detector has no bpf() number for {platform.machine()}")
        self.map_fd = self._bpf(BPF_MAP_CREATE, struct.pack(
            "=IIIIIII16s", BPF_MAP_TYPE_ARRAY, 4, VALUE_SIZE, 1, BPF_F_MMAPABLE, 0, 0,
            b"wagent_bursts"), "creating its map")
        try:
            self._mem = mmap.mmap(self.map_fd, mmap.PAGESIZE, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self.values = memoryview(self._mem)[:VALUE_SIZE]
            self.configure(settings)
            self.fd = self._load(program(self.map_fd))
        except BaseException:
            self.close()
            raise

    def configure(self, settings: Settings) -> None:
        """New settings, taken by the next packet (no reload)."""
        _U64.pack_into(self.values, DRAIN, settings.drain)
        _U64.pack_into(self.values, THRESHOLD, settings.threshold)
        _U64.pack_into(self.values, HOLD, settings.hold_ns)
        _U64.pack_into(self.values, MERGE, settings.merge_ns)

    def close(self) -> None:
        values = getattr(self, "values", None)
        if values is not None:
            values.release()
            self._mem.close()
            del self.values
        for name in ("fd", "map_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def _load(self, insns: bytes) -> int:
        code = ctypes.create_string_buffer(insns, len(insns))
        license_ = ctypes.create_string_buffer(b"GPL")
        log = ctypes.create_string_buffer(1 << 16)
        attr = struct.pack("=IIQQIIQII16s", BPF_PROG_TYPE_SCHED_CLS, len(insns) // _INSN.size,
                           ctypes.addressof(code), ctypes.addressof(license_), 1, len(log),
                           ctypes.addressof(log), 0, 0, DETECTOR_NAME.encode()[:15])
        try:
            return self._bpf(BPF_PROG_LOAD, attr, "loading its program")
        except ShapingError as e:
            text = log.value.decode("ascii", "replace").strip()
            raise ShapingError(f"{e}{': ' + text.splitlines()[-1] if text else ''}") from None

    def _bpf(self, cmd: int, attr: bytes, what: str) -> int:
        buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
        fd = self._libc.syscall(self._nr, cmd, buf, len(buf))
        if fd < 0:
            err = ctypes.get_errno()
            hint = ""
            if err in (errno.EPERM, errno.EACCES):
                hint = (" (it needs CAP_BPF and CAP_NET_ADMIN, or root: systemd "
                        "AmbientCapabilities=CAP_BPF CAP_NET_ADMIN)")
            elif err == errno.ENOSYS:
                hint = " (a kernel without CONFIG_BPF_SYSCALL)"
            raise ShapingError(f"the burst detector: {what}: {os.strerror(err)}{hint}")
        return int(fd)
