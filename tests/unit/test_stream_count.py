"""The stream count chosen by measurement (``agent.pull.stream_count``), against modelled paths:
goodput as a function of the count, fed as a pull feeds it."""

from agent.pull.stream_count import HELD_FEWEST, RAMP_WINDOW, REPROBE, SETTLE, StreamCount

MB = 1e6


def pull(c, rate_of, seconds, start=0.0, dt=0.25, held_of=lambda n: False, cap=None):
    """Runs ``c`` for ``seconds`` on a path whose goodput is ``rate_of(count)``, behind a
    bucket of rate ``cap`` (bytes/s) that holds a stream at times when ``held_of(count)``;
    the counts."""
    t, got, counts = start, 0.0, [c.count]
    while t < start + seconds:
        t, got = t + dt, got + rate_of(c.count) * dt
        n = c.step(t, got, held=held_of(c.count), cap=cap)
        if n != counts[-1]:
            counts.append(n)
    return counts


def test_behind_a_cap_per_connection_it_grows_to_what_fills_the_link():
    c = StreamCount(most=32)
    counts = pull(c, lambda n: min(5 * MB * n, 120 * MB), 40)
    # one more, then four times as many while each added stream carries its share; the
    # policy's 32 carries no more than 24, where the added streams' share puts the limit
    assert counts[:5] == [2, 3, 12, 32, 24], counts
    assert c.count == 24


def test_the_ramp_passes_the_limit_in_three_judgements():
    c = StreamCount(most=32)
    t, got = 0.0, 0.0
    while c.count < 24:
        t, got = t + 0.05, got + min(5 * MB * c.count, 120 * MB) * 0.05
        c.step(t, got, held=False)
    # 2 > 3 > 12 > 32; each judgement the settle and two windows (and a step of the feed)
    assert c.count == 32 and t <= 3 * (SETTLE + 2 * RAMP_WINDOW + 0.1) + 0.1, (c.count, t)


def test_past_the_limit_the_count_goes_to_where_it_is():
    # 6 MB/s per connection, 120 MB/s: 20 fill it; 12 -> 48 overshoots
    c = StreamCount(most=64)
    counts = pull(c, lambda n: min(6 * MB * n, 120 * MB), 40)
    assert counts[:5] == [2, 3, 12, 48, 20], counts
    assert c.count == 20, c.reason             # and probes either side give it back


def test_windows_wait_while_new_streams_ramp_up():
    # each change takes 1.5 s to reach its rate (slow start on a long round trip): the
    # judgement waits for windows that stop rising, and the count still reaches 24
    c = StreamCount(most=32)
    t, got, since, old = 0.0, 0.0, 0.0, c.count
    while t < 40:
        ramp = min(1.0, (t - since) / 1.5)
        streams = min(old, c.count) + max(0, c.count - old) * ramp
        t, got = t + 0.05, got + min(5 * MB * streams, 120 * MB) * 0.05
        before = c.count
        if c.step(t, got, held=False) != before:
            since, old = t, before
    assert 22 <= c.count <= 28, c.reason


def test_it_never_passes_the_policys_streams():
    c = StreamCount(most=8)
    assert max(pull(c, lambda n: 5 * MB * n, 30)) == 8 and c.count == 8
    assert "the most the policy allows" in c.reason
    assert StreamCount(most=1).count == 1


def test_where_two_fill_the_path_it_stays_at_two():
    c = StreamCount(most=8)
    assert max(pull(c, lambda n: 100 * MB, 20)) == 3 and c.count == 2
    assert c.reason.endswith("given back")


def test_a_server_slowing_as_connections_grow_settles_near_its_best():
    # aggregate peaks at 6 connections (60 MB/s), then falls
    def rate(n):
        return 20 * MB * n / (1 + (n / 6) ** 2)
    c = StreamCount(most=32)
    pull(c, rate, 40)
    assert rate(c.count) >= 0.95 * rate(6), c.count


def test_held_by_the_rate_cap_it_gives_streams_back():
    c = StreamCount(most=8)
    pull(c, lambda n: 5 * MB * n, 20)                 # 8 streams, 40 MB/s
    assert c.count == 8
    # now a cap of 20 MB/s holds the pull: fewer streams fill it as well
    counts = pull(c, lambda n: min(5 * MB * n, 20 * MB), 30, start=20.0,
                  held_of=lambda n: 5 * MB * n > 20 * MB, cap=20 * MB)
    assert c.count == 4 and counts[-1] == 4, counts
    assert "the pull's rate cap or backoff holds it" in c.reason or "carry as much" in c.reason


def test_held_by_the_backoff_it_keeps_two_streams():
    """At the backoff's floor every stream waits for the bucket; two stay for the moment the
    training stops (one stalls on windows sized for a 1 ms queue whenever its reader is late)."""
    c = StreamCount(most=32)
    pull(c, lambda n: 5 * MB * n, 20)
    assert c.count > 8
    pull(c, lambda n: 0.25 * MB, 60, start=20.0, held_of=lambda n: True, cap=0.25 * MB)
    assert c.count == HELD_FEWEST == 2
    assert c.reason.startswith("2 streams: the pull's rate cap or backoff holds it")


def test_a_bucket_at_the_links_rate_that_waits_now_and_then_is_not_a_cap():
    """Alone on a link, behind a bucket at the link's rate (the backoff's ceiling): chunks
    come in clumps, so some stream waits for the bucket at times, but the link limits the
    pull (91% of the bucket's rate), and more streams carry more of it."""
    c = StreamCount(most=32)
    counts = pull(c, lambda n: min(100 * MB + 5 * MB * n, 118 * MB), 20,
                  held_of=lambda n: True, cap=125 * MB)
    assert counts[:2] == [2, 3] and c.count >= 3, counts      # a stream more: 4.5% more
    assert "rate cap" not in c.reason


def test_settled_it_ramps_again_when_goodput_rises():
    c = StreamCount(most=16)
    pull(c, lambda n: 10 * MB, 10)                  # a cap on the link: two carry it
    assert c.count == 2
    # the link's cap lifts, a cap per connection shows: goodput rises, the count ramps
    counts = pull(c, lambda n: min(10 * MB * n, 100 * MB), 40, start=10.0)
    assert counts[:3] == [2, 4, 16], counts         # ramping again: twice, then four times
    assert max(counts) >= 10 and c.count >= 8, (counts, c.reason)   # (probes either side)


def test_goodput_that_falls_adds_no_stream_and_a_probe_finds_a_new_cap():
    c = StreamCount(most=16)
    pull(c, lambda n: 100 * MB, 10)
    assert c.count == 2
    # another flow takes most of the link: no more connections to fight it with
    assert pull(c, lambda n: 20 * MB, 20, start=10.0) == [2]
    # a cap per connection appears (a proxy in the way): the next probe up finds it and
    # grows on by quarters while each step adds
    counts = pull(c, lambda n: min(10 * MB * n, 100 * MB), REPROBE + 20, start=30.0)
    assert counts[:2] == [2, 3] and c.count >= 8, (counts, c.reason)


def test_settled_it_probes_both_ways_every_while():
    c = StreamCount(most=16)
    counts = pull(c, lambda n: 100 * MB, REPROBE * 2.5)
    # up probes given back, then a probe down: one stream carries as much, so one it is
    assert counts.count(3) >= 2 and counts[-1] == 1 and c.count == 1, counts
    assert "carry as much" in c.reason


def test_a_window_holds_enough_reads_to_measure_by():
    # bytes come a read (1 MiB) at a time: at 4 MB/s a 0.5 s window would be off by half
    c = StreamCount(most=8, grain=1 << 20)
    t, got, changes = 0.0, 0.0, []
    while t < 30:
        t += 0.05
        got += 2 * MB * c.count * 0.05
        counted = (got // (1 << 20)) * (1 << 20)          # what a pull has booked
        before = c.count
        if c.step(t, counted, held=False) != before:
            changes.append(t)
    assert changes and changes[0] >= 16 * (1 << 20) / (4 * MB), changes
    assert c.count == 8, c.reason                 # the quantized counts still grow it


def test_the_last_requests_of_a_pull_judge_nothing():
    c = StreamCount(most=32)
    pull(c, lambda n: min(5 * MB * n, 120 * MB), 3)
    n = c.count
    t, got = 3.0, 0.0
    while t < 10:                 # goodput falls as streams run out of work: not the path's
        t, got = t + 0.25, got + 1 * MB * 0.25
        assert c.step(t, got, held=False, starved=True) == n
