import threading
import time

import pytest

from agent.yielding.ratelimit import TokenBucket, book
from tests.waiting import wait_for


def test_bookings_are_scheduled_at_the_rate():
    tat = 0.0
    for _ in range(100):                                             # 10 MB booked at t=0
        tat = book(tat, 0.0, 100_000, 80_000_000, burst=0.0)         # at 10 MB/s
    assert tat == pytest.approx(1.0)
    # idle until t=5: no credit banked without a burst
    assert book(tat, 5.0, 100_000, 80_000_000, burst=0.0) - 5.0 == pytest.approx(0.01)


def test_burst_bounds_credit():
    now = 100.0                                                      # idle for 100 s at 1 MB/s
    tat = book(0.0, now, 50_000, 8_000_000, burst=0.05)
    assert tat - now == 0.0                                          # 50 ms of credit
    assert book(tat, now, 100_000, 8_000_000, burst=0.05) - now == pytest.approx(0.1)


def consumer(b: TokenBucket, n_bytes: int, stop: threading.Event | None = None):
    """``b.consume(n_bytes)`` in a thread of its own; returns the event set when it returns."""
    done = threading.Event()

    def run():
        b.consume(n_bytes, stop)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_unlimited_and_set_rate():
    b = TokenBucket(None)
    assert consumer(b, 10**12).wait(5.0)                             # unlimited: no wait
    assert b.waiting == 0
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
    done = consumer(b, 100_000)                                      # 100 s at this rate
    assert wait_for(lambda: b.waiting == 1)                          # it waits for its turn
    assert b.rate_binds                                              # the cap limits the pull
    assert not done.is_set()
    b.set_rate(None)
    assert done.wait(1.0)                                            # woken: unlimited now
    assert b.waiting == 0
    b.set_rate(8_000)
    stop = threading.Event()
    done = consumer(b, 100_000, stop)
    assert wait_for(lambda: b.waiting == 1)
    assert not done.is_set()
    stop.set()                                                       # a pull being stopped
    assert done.wait(1.0)


def test_disturbances_count_rate_changes_and_cuts_not_a_rate_set_again():
    b = TokenBucket(8_000_000)
    assert b.disturbances == 0
    b.set_rate(8_000_000)                                   # the same rate: no change
    assert b.disturbances == 0
    b.set_rate(4_000_000)
    assert b.disturbances == 1
    cut = [0.15]
    b.hold_on(lambda rate: cut[0])                          # the fast path cuts the readers
    done = consumer(b, 10)
    assert wait_for(lambda: b.waiting == 1)
    cut[0] = 0.0
    assert done.wait(1.0)
    assert b.disturbances >= 2 and not b.rate_binds         # a cut is not the rate binding
