import threading
import time

import pytest

from agent.ratelimit import TokenBucket


def test_reserve_schedules_at_the_rate():
    t = [0.0]
    b = TokenBucket(80_000_000, burst=0.0, clock=lambda: t[0])      # 10 MB/s
    waits = [b.reserve(100_000) for _ in range(100)]                 # 10 MB booked at t=0
    assert waits[-1] == pytest.approx(1.0)
    t[0] = 5.0                                                       # idle: at most burst banked
    assert b.reserve(100_000) == pytest.approx(0.01)


def test_burst_bounds_credit():
    t = [0.0]
    b = TokenBucket(8_000_000, burst=0.05, clock=lambda: t[0])       # 1 MB/s
    t[0] = 100.0
    assert b.reserve(50_000) == 0.0                                  # 50 ms of credit
    assert b.reserve(100_000) == pytest.approx(0.1)


def test_unlimited_and_set_rate():
    b = TokenBucket(None)
    assert b.reserve(10**12) == 0.0
    b.set_rate(8_000)
    assert b.rate == 8_000
    with pytest.raises(ValueError):
        b.set_rate(0)
    assert b.chunk_size(2**20) == 16384
    b.set_rate(None)
    assert b.chunk_size(2**20) == 2**20


def test_shared_by_threads_accurate_over_a_fraction_of_a_second():
    rate = 80_000_000                                                # 10 MB/s
    b = TokenBucket(rate)
    moved = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + 0.4

    def stream():
        while time.monotonic() < stop_at:
            b.consume(32768)
            with lock:
                moved[0] += 32768

    threads = [threading.Thread(target=stream) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert moved[0] / elapsed == pytest.approx(rate / 8, rel=0.08)


def test_set_rate_wakes_waiters_and_stop_ends_wait():
    b = TokenBucket(8_000)                                           # 1 KB/s
    b.consume(10)
    done = threading.Event()

    def waiter():
        b.consume(100_000)                                           # 100 s at this rate
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    time.sleep(0.05)
    assert not done.is_set()
    b.set_rate(None)
    assert done.wait(1.0)
    stop = threading.Event()
    stop.set()
    b.set_rate(8_000)
    started = time.monotonic()
    b.consume(100_000, stop)
    assert time.monotonic() - started < 0.5
