"""The stream count chosen by measurement (``agent.pull.stream_count``), against modelled paths:
goodput as a function of the count, fed as a pull feeds it."""

from agent.pull.stream_count import REPROBE, StreamCount

MB = 1e6


def pull(c, rate_of, seconds, start=0.0, dt=0.25, held_of=lambda n: False):
    """Runs ``c`` for ``seconds`` on a path whose goodput is ``rate_of(count)``; the counts."""
    t, got, counts = start, 0.0, [c.count]
    while t < start + seconds:
        t, got = t + dt, got + rate_of(c.count) * dt
        n = c.step(t, got, held=held_of(c.count))
        if n != counts[-1]:
            counts.append(n)
    return counts


def test_behind_a_cap_per_connection_it_grows_to_what_fills_the_link():
    c = StreamCount(most=32)
    counts = pull(c, lambda n: min(5 * MB * n, 120 * MB), 40)
    assert counts[:8] == [2, 3, 4, 6, 9, 13, 19, 28]
    assert 24 <= c.count <= 28, counts           # 24 fill it; the step overshoots by 4 at most


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
                  held_of=lambda n: 5 * MB * n > 20 * MB)
    assert c.count == 4 and counts[-1] == 4, counts
    assert "the pull's rate cap or backoff holds it" in c.reason or "carry as much" in c.reason


def test_settled_it_probes_again_when_the_path_changes():
    c = StreamCount(most=16)
    pull(c, lambda n: 100 * MB, 10)
    assert c.count == 2
    # a cap per connection appears (a proxy in the way): goodput falls, the count grows
    pull(c, lambda n: min(10 * MB * n, 100 * MB), 40, start=10.0)
    assert c.count >= 9, c.reason


def test_settled_it_probes_both_ways_every_while():
    c = StreamCount(most=16)
    counts = pull(c, lambda n: 100 * MB, REPROBE * 2.5)
    # up probes given back, then a probe down: one stream carries as much, so one it is
    assert counts.count(3) >= 2 and counts[-1] == 1 and c.count == 1, counts
    assert "carry as much" in c.reason
