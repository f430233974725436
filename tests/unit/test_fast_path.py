"""The fast path's pure side: the detector's program as assembled, its map as read, the gate the
readers wait on, the controller's view of bursts, and the loop that ties them (no kernel here:
tests/integration/test_burst_detector_netns.py loads the program into a real one)."""

from __future__ import annotations

import struct
import threading
import time

from agent.policy.model import Backoff
from agent.yielding.backoff import BackoffLoop
from agent.yielding.bursts import (
    SUSTAINED,
    BurstGate,
    BurstState,
    Sustained,
    parse_state,
    rhythm_for,
    settings_for,
    slow_view,
)
from agent.yielding.controller import FULL, Controller
from agent.yielding.detect.readings import LinkReading, NcclReading, PortReading, Readings
from agent.yielding.ratelimit import TokenBucket
from shaping import bpf

G = 10**9
MS = 1_000_000


def values(**fields: int) -> memoryview:
    buf = bytearray(bpf.VALUE_SIZE)
    offsets = {"level": bpf.LEVEL, "cut_until": bpf.CUT_UNTIL, "cut_start": bpf.CUT_START,
               "bursts": bpf.BURSTS, "foreign": bpf.FOREIGN, "held": bpf.HELD}
    for name, value in fields.items():
        struct.pack_into("=Q", buf, offsets[name], value)
    return memoryview(buf)


def test_the_program_is_whole_and_every_jump_lands_inside_it():
    code = bpf.program(map_fd=7)
    insns = [struct.unpack_from("<BBhi", code, i) for i in range(0, len(code), 8)]
    assert insns[-1][0] == 0x95                               # exit
    assert len(insns) < 100
    for pc, (op, _regs, off, _imm) in enumerate(insns):
        if op & 0x07 == 0x05 and op not in (0x85, 0x95):      # a jump (not call, exit)
            assert 0 <= pc + 1 + off < len(insns), f"jump at {pc} lands outside"
    ld = next(i for i in insns if i[0] == 0x18)               # the map's fd, as a pseudo fd
    assert ld[1] >> 4 == 1 and ld[3] == 7


def test_settings_follow_the_policy():
    s = settings_for(Backoff(burst_hold=0.002).resolved(10 * G))
    assert s == bpf.Settings(drain=62_500_000, threshold=64 * 1024, hold_ns=2 * MS,
                             merge_ns=4 * MS)
    assert settings_for(Backoff(burst_hold=None).resolved(G)) is None
    assert settings_for(Backoff(enabled=False).resolved(G)) is None


def test_the_map_read_as_a_state():
    s = parse_state(values(level=5, cut_until=30 * MS, cut_start=10 * MS, bursts=3,
                           foreign=9000, held=7 * MS))
    assert (s.level, s.bursts, s.foreign_bytes) == (5, 3, 9000)
    assert s.wait_s(20 * MS) == 0.01 and s.wait_s(40 * MS) == 0.0
    assert s.held_s(20 * MS) == 0.017 and s.held_s(40 * MS) == 0.027
    assert s.recent(5 * 10**9) and not s.recent(11 * 10**9)
    assert not BurstState(0, 0, 0, 0, 0, 0).recent(1)


def test_the_gate_holds_readers_until_the_cut_ends_and_never_at_the_floor():
    now = [10 * MS]
    gate = BurstGate(values(cut_until=15 * MS), floor=lambda: 2_000_000,
                     clock_ns=lambda: now[0])
    assert gate.hold(G) == 0.005 and gate.hold(None) == 0.005
    assert gate.hold(2_000_000) == 0.0          # the slow path holds it at its floor: it flows
    now[0] = 16 * MS
    assert gate.hold(G) == 0.0


def test_the_bucket_waits_out_a_cut_then_books():
    bucket = TokenBucket(None)
    ends = time.monotonic() + 0.05
    bucket.hold_on(lambda rate: max(0.0, ends - time.monotonic()))
    started = time.monotonic()
    bucket.consume(1000)
    assert time.monotonic() - started >= 0.045
    bucket.hold_on(None)
    started = time.monotonic()
    bucket.consume(1000)
    assert time.monotonic() - started < 0.04


def test_the_bucket_says_when_readers_are_paused():
    bucket = TokenBucket(None)
    assert not bucket.paused() and not bucket.cuts  # no fast path
    wait = [0.01]
    bucket.hold_on(lambda rate: wait[0])
    assert bucket.paused() and bucket.cuts
    wait[0] = 0.0
    assert not bucket.paused()


def test_a_stop_ends_the_wait_for_a_cut():
    bucket = TokenBucket(None)
    bucket.hold_on(lambda rate: 60.0)
    stop = threading.Event()
    t = threading.Thread(target=bucket.consume, args=(1000, stop))
    t.start()
    time.sleep(0.05)
    assert bucket.waiting == 1
    assert not bucket.rate_binds        # a cut lasts a burst: the stream count keeps its streams
    stop.set()
    t.join(1.0)
    assert not t.is_alive()


def readings(other: float = 0.0, nccl: bool = False, port: bool = False) -> Readings:
    return Readings(at=0.0, links=(LinkReading("eth0", other, other, 0.0, 0.0),),
                    ports=(PortReading(29500, 1, None, ("10.0.0.1:29500",)),) if port else (),
                    nccl=(NcclReading(42, "python"),) if nccl else ())


def test_the_controller_sees_bursts_no_more_only_flows():
    view = slow_view(readings(9e8, nccl=True, port=True), sustained=False)
    assert view.links[0].other_bps == 0.0 and view.nccl == () and view.ports == ()
    view = slow_view(readings(9e8), sustained=True)
    assert view.links[0].other_bps == 9e8                  # a flow: the slow path's again


def state_held(held_ms: int) -> BurstState:
    return BurstState(0, cut_until_ns=0, cut_start_ns=0, bursts=1, foreign_bytes=0,
                      held_ns=held_ms * MS)


def test_a_flow_is_cuts_that_hold_most_of_every_tick_for_a_second():
    """Bursts every 0.5 s hold one tick in two or three; a flow holds them all, even when
    its gaps (a busy CPU, pacing) end one cut and start the next."""
    s = Sustained()
    held, flow = 0, []
    for tick in range(1, 16):
        held += 60                                  # 60 ms of every 100 ms tick
        flow.append(s.see(state_held(held), tick * 100 * MS))
    assert flow.index(True) == int(SUSTAINED / 0.1) and all(flow[10:])
    s, held, bursts = Sustained(), 0, []
    for tick in range(1, 40):                       # 200 ms held every 500 ms
        held += 100 if tick % 5 in (1, 2) else 0
        bursts.append(s.see(state_held(held), tick * 100 * MS))
    assert not any(bursts)


class FakeDetectors:
    link = None

    def __init__(self) -> None:
        self.next = readings()

    def sample(self, now, distribution=None):
        return self.next


def test_with_the_fast_path_training_present_bounds_the_windows_but_keeps_the_rate():
    """A node that trains all the time (libnccl mapped, bursts) keeps its cap between bursts:
    the fast path yields to each burst; the windows stay bounded while training is there."""
    now = [5 * 10**9]
    told: list[tuple[bool, bool]] = []
    gate = BurstGate(values(cut_until=now[0] - 50 * MS, cut_start=now[0] - 250 * MS, bursts=4),
                     floor=lambda: 2_000_000, clock_ns=lambda: now[0])
    dets = FakeDetectors()
    dets.next = readings(4e8, nccl=True)          # a tick with a burst in it, NCCL there
    clock = [0.0]
    loop = BackoffLoop(Controller(Backoff(), G, link_bps=G), dets, bursts=gate,
                       training_present=lambda *told_now: told.append(told_now),
                       clock=lambda: clock[0])
    for _ in range(5):
        clock[0] += 0.1
        d = loop.tick()
    assert d.state == FULL and d.rate_bps == G
    assert told == [(True, False)]              # bursts, no rhythm: they come unannounced
    st = loop.status()
    assert st.bursts is not None and st.bursts.bursts == 4
    # without the fast path, the same ticks back off to the floor
    loop = BackoffLoop(Controller(Backoff(), G, link_bps=G), dets, clock=lambda: clock[0])
    assert loop.tick().state != FULL


def test_the_sockets_hear_when_the_bursts_come_at_a_rhythm():
    """Unannounced bursts meet the windows and the bucket's filling; once the readers stop
    before each burst (its rhythm known), the windows may hold the looser bound again."""
    now = [5 * 10**9]
    told: list[tuple[bool, bool]] = []
    rhythm = rhythm_for(settings_for(Backoff().resolved(G)), G, 120_000)
    gate = BurstGate(values(cut_until=now[0] - 50 * MS, cut_start=now[0] - 60 * MS, bursts=5),
                     floor=lambda: 2_000_000, clock_ns=lambda: now[0], rhythm=rhythm)
    dets = FakeDetectors()
    dets.next = readings()
    clock = [0.0]
    loop = BackoffLoop(Controller(Backoff(), G, link_bps=G), dets, bursts=gate,
                       training_present=lambda *told_now: told.append(told_now),
                       clock=lambda: clock[0])
    clock[0] += 0.1
    loop.tick()
    for k in range(1, 6):                         # a burst every 120 ms
        rhythm.see(now[0] - 60 * MS - (5 - k) * 120 * MS)
    clock[0] += 0.1
    loop.tick()
    assert told == [(True, False), (True, True)]


def test_a_held_reader_leaves_bytes_that_are_there_in_the_socket():
    """A reader waiting for its next receive when the cut begins takes nothing once the bytes
    are there: taking them would free their room, and the window advertised with it would let
    its sender send into the burst."""
    from agent.pull.client import _fill

    class One:
        def __init__(self) -> None:
            self.received = [b"a" * 10, b"b" * 10]
            self.waited = 0

        def ready(self) -> bool:
            self.waited += 1
            return True

        def __call__(self, view: memoryview) -> int:
            data = self.received.pop(0) if self.received else b""
            if len(data) > len(view):
                data, rest = data[:len(view)], data[len(view):]
                self.received.insert(0, rest)
            view[:len(data)] = data
            return len(data)

    one, paused = One(), [False]
    buf = memoryview(bytearray(100))
    assert _fill(one, buf, 15, lambda: paused[0], before=True) == (15, False)
    paused[0] = True
    assert _fill(one, buf, 100, lambda: paused[0], before=True) == (0, True)
    assert one.received == [b"b" * 5]             # left where it was
    assert _fill(one, buf, 100, lambda: paused[0]) == (5, False)   # not asked before: read


def test_a_reader_with_nothing_to_hand_over_waits_the_cut_out():
    bucket = TokenBucket(None)
    ends = time.monotonic() + 0.05
    bucket.hold_on(lambda rate: max(0.0, ends - time.monotonic()))
    started = time.monotonic()
    bucket.wait_cut()
    assert time.monotonic() - started >= 0.045
    stop = threading.Event()
    stop.set()
    bucket.hold_on(lambda rate: 60.0)
    bucket.wait_cut(stop)                         # a stop ends it at once


def test_a_chunk_is_filled_receive_by_receive_and_handed_over_at_a_pause():
    from agent.pull.client import _fill

    received = [b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10]

    def one(view: memoryview) -> int:
        data = received.pop(0)[:len(view)] if received else b""
        view[:len(data)] = data
        return len(data)

    buf = memoryview(bytearray(100))
    assert _fill(one, buf, 25, lambda: False) == (25, False)    # full: three receives
    assert bytes(buf[:25]) == b"a" * 10 + b"b" * 10 + b"c" * 5
    assert _fill(one, buf, 100, lambda: True) == (10, False)    # paused: the one receive only
    assert _fill(one, buf, 100, lambda: False) == (0, False)    # the body ended


def test_each_receive_is_told_as_it_lands():
    """The stream count's grain (``arrived``): a receive's bytes, not a whole chunk's."""
    from agent.pull.client import _fill

    received = [b"a" * 7, b"b" * 10, b"c" * 10]

    def one(view: memoryview) -> int:
        data = received.pop(0)[:len(view)] if received else b""
        view[:len(data)] = data
        return len(data)

    told: list[int] = []
    assert _fill(one, memoryview(bytearray(20)), 20, None, told.append) == (20, False)
    assert told == [7, 10, 3]
