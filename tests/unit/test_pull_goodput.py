"""The goodput floor's judgement, on a hand-driven clock."""

from agent.pull.goodput import Floor, Meter

FLOOR = Floor(min_rate=1000, average_over=10, grace=5)


def meter():
    t = [0.0]
    return Meter(FLOOR, clock=lambda: t[0]), t


def test_nothing_is_judged_before_the_grace_period():
    m, t = meter()
    m.begin(100)
    t[0] = 4.9
    assert m.verdict() is None
    t[0] = 5.1
    assert m.verdict() is not None


def test_a_source_above_the_floor_is_kept():
    m, t = meter()
    for _ in range(40):
        m.begin(500)
        t[0] += 0.4            # 1250 B/s
        m.end(500)
    assert m.verdict() is None


def test_a_trickle_is_judged_on_the_last_window_only():
    m, t = meter()
    for _ in range(20):        # 10 s well above the floor
        m.begin(2000)
        t[0] += 0.5
        m.end(2000)
    assert m.verdict() is None
    for _ in range(20):        # then 20 s at 100 B/s
        m.begin(100)
        t[0] += 1.0
        m.end(100)
    rate, span = m.verdict()
    assert span == 10 and rate < 200


def test_time_outside_reads_never_counts():
    """Waiting for the token bucket (between reads) is not the source's slowness."""
    m, t = meter()
    for _ in range(50):
        m.begin(10)
        t[0] += 0.001          # the bytes were already in the socket buffer
        m.end(10)
        t[0] += 10.0           # held by the rate limit
    assert m.verdict() is None


def test_a_read_in_flight_counts_as_if_it_had_all_its_bytes():
    """Bytes inside an unfinished read can't be seen: judge only when even all of them would
    leave the source under the floor."""
    m, t = meter()
    m.begin(20_000)
    t[0] = 11.0
    assert m.verdict() is None          # 20 kB in 10 s could be 2 kB/s
    m2, t2 = meter()
    m2.begin(5_000)
    t2[0] = 11.0
    assert m2.verdict() == (500.0, 10)


def test_the_floor_caps_reads_so_that_a_trickle_can_be_judged():
    assert FLOOR.max_read(2**20) == 5000
    assert Floor(0, 30, 30).max_read(2**20) == 2**20
    assert Floor(0, 30, 30).enabled is False


def test_a_cut_breaks_the_read_but_never_after_the_body_is_done():
    broken = []
    m, _ = meter()
    m.abort = lambda: broken.append(1)
    m.cut("too slow")
    assert broken == [1] and m.abandoned == "too slow" and m.close() is True
    late, _ = meter()
    late.abort = lambda: broken.append(2)
    assert late.close() is False
    late.cut("too slow")          # its connection may be back in the pool: leave it alone
    assert broken == [1] and late.abandoned is None
