from agent.store.evict import VersionUse, choose


def v(model, version, published, last_used, *blobs):
    return VersionUse(model, version, published, last_used, frozenset(blobs))


VERSIONS = [
    v("m", "v1", 1, 50, "a", "b"),
    v("m", "v2", 2, 10, "a", "c"),
    v("m", "v3", 3, 30, "a", "d"),
    v("n", "x1", 1, 5, "e"),
]
SIZES = {"a": 100, "b": 10, "c": 20, "d": 30, "e": 40, "orphan": 7}


def test_keep_newest_and_drop_unreferenced_blobs():
    c = choose(VERSIONS, SIZES, keep=1, pins={}, max_size=None, now=100)
    assert c.versions == (("m", "v2"), ("m", "v1"))          # least recently used first
    assert c.blobs == ("b", "c", "orphan")                    # never "a": v3 uses it


def test_pins_are_kept():
    c = choose(VERSIONS, SIZES, keep=1, pins={"m": ["v1"]}, max_size=None, now=100)
    assert c.versions == (("m", "v2"),)
    assert "b" not in c.blobs


def test_evict_after_waits_for_unused_time_and_size_limit_goes_lru():
    c = choose(VERSIONS, SIZES, keep=1, pins={}, max_size=None, now=60, evict_after=40)
    assert c.versions == (("m", "v2"),)                       # v1 used 10 s ago stays
    c = choose(VERSIONS, SIZES, keep=1, pins={}, max_size=185, now=60, evict_after=1000)
    # kept: v3 (a, d) + x1 (e) = 170; with v1 (b) = 180 fits, with v2 (c) too = 200 does not.
    assert c.versions == (("m", "v2"),)


def test_size_limit_never_touches_kept_versions():
    c = choose(VERSIONS, SIZES, keep=5, pins={}, max_size=1, now=60, evict_after=1000)
    assert c.versions == ()
    assert c.blobs == ("orphan",)


def test_keep_per_model():
    c = choose(VERSIONS, SIZES, keep={"m": 3}, pins={}, max_size=None, now=100)
    assert c.versions == (("n", "x1"),)
