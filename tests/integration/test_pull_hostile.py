"""Pulls against sources that misbehave on purpose or by accident, on loopback: headers or bodies
trickled inside every read timeout, a gzip bomb for a manifest, ETags that flap between load-
balanced backends, a file republished in place, credentials in the source URL, manifests built to
break the parser; and the CLI stopped by SIGTERM or Ctrl-C whatever it is blocked on, and the
daemon's pull worker held by one stuck source."""

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import manifest
from agent.policy.model import Model, Policy, Source
from agent.pull import engine
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, pull_version
from agent.pull.worker import WindowState, Worker, WorkerDeps
from agent.scheduler import Scheduler
from agent.store import Store
from tests.pull_helpers import FaultyServer, LoopbackNginx, publish, publish_dir, same_files

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

pytestmark = pytest.mark.debian

REPO = Path(__file__).resolve().parents[2]
SHARD = "model-00001-of-00002.safetensors"
# Deadlines short enough to test: headers within 1 s, a small body within 5 s + size at 64 KiB/s.
FAST = PullOptions(streams=2, retries=1, backoff_base=0.01, read_timeout=5, connect_timeout=2,
                   headers_deadline=1.0, small_body_rate=64 * 1024)
# One byte of headers every 0.3 s: each read well inside the 5 s read timeout; the 200 bytes of
# padding alone take a minute.
SLOW_HEADERS = {"trickle": (1, 0.3), "header_pad": 200}


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    publish(root, "m", "v1", piece_size=2**20, layers=4, hidden=256, shards=2)
    return root


def version_dir(origin: Path) -> Path:
    return origin / "m" / "v1"


# -- deadlines -----------------------------------------------------------------------------------
@pytest.mark.parametrize("target, fault_on", [
    ("v1", r"manifest\.json$"),
    ("latest", r"/latest$"),
    ("v1", r"\.safetensors$"),
])
def test_trickled_headers_are_cut_at_their_deadline(origin, tmp_path, target, fault_on):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "slow_headers", fault_on=fault_on, **SLOW_HEADERS) as slow:
        started = time.monotonic()
        with pytest.raises(PullError, match="response headers did not arrive within 1 s"):
            pull_version([Source(slow.url)], "m", target, store, options=FAST,
                         connections=CONNECTIONS)
        assert time.monotonic() - started < 20
        assert slow.faults_done >= 1
        with LoopbackNginx(origin) as good:
            r = pull_version([Source(slow.url), Source(good.url)], "m", target, store,
                             options=FAST, connections=CONNECTIONS)
    same_files(r.path, version_dir(origin))


def test_a_trickled_manifest_body_is_cut_at_its_deadline(origin, tmp_path):
    """4 bytes every 0.2 s: each read is quick, the manifest would take minutes."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "slow_body", fault_on=r"manifest\.json$", trickle=(4, 0.2)) as slow:
        started = time.monotonic()
        with pytest.raises(PullError, match=r"manifest\.json: the body did not arrive within "
                                            r"5\.\d+ s"):
            pull_version([Source(slow.url)], "m", "v1", store, options=FAST,
                         connections=CONNECTIONS)
        assert time.monotonic() - started < 20
        with LoopbackNginx(origin) as good:
            r = pull_version([Source(slow.url), Source(good.url)], "m", "v1", store,
                             options=FAST, connections=CONNECTIONS)
    same_files(r.path, version_dir(origin))


# -- the CLI, stopped by a signal ------------------------------------------------------------------
def cli(*args: str, env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **popen)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.parametrize("case, fault, fault_on, url, extra, sig", [
    # the main thread reading a manifest, then `latest`, whose headers trickle
    ("manifest", "slow_headers", r"manifest\.json$", "m/v1", [], signal.SIGTERM),
    ("latest", "slow_headers", r"/latest$", "m/latest", [], signal.SIGINT),
    # the streams, blocked in trickled headers after a few pieces verified
    ("streams", "slow_headers", r"\.safetensors$", "m/v1", [], signal.SIGTERM),
    # the streams, waiting on the token bucket (1 KB/s: 16 s per chunk)
    ("bucket", None, r"\.safetensors$", "m/v1", ["--rate", "8kbit"], signal.SIGINT),
])
def test_a_signal_ends_a_cli_pull_within_two_seconds(origin, tmp_path, case, fault, fault_on,
                                                     url, extra, sig):
    store = tmp_path / "store"
    after = 4 if case == "streams" else 0
    with FaultyServer(origin, fault, fault_on=fault_on, after=after, **SLOW_HEADERS) as srv:
        # With faulthandler: a pull still there 30 s after the signal is aborted, and its
        # stderr says where each of its threads waited (a CI run once saw it, and no re-run).
        p = cli("pull", f"{srv.url}/{url}", "--store", str(store), "--streams", "2", "-q",
                *extra, stderr=subprocess.PIPE, env={"PYTHONFAULTHANDLER": "1"})
        try:
            wait_for(lambda: sum(1 for path, _, _ in srv.requests
                                 if re.search(fault_on, path)) > after)
            time.sleep(0.5)                         # blocked in it by now
            sent = time.monotonic()
            p.send_signal(sig)
            try:
                code = p.wait(30)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
                p.kill()
                p.wait()
                pytest.fail(f"the pull did not end within 30 s of {sig.name}; its threads:\n"
                            f"{p.stderr.read().decode(errors='replace')}")
            took = time.monotonic() - sent
        finally:
            p.kill()
            p.wait()
        err = p.stderr.read().decode()
    assert took < 2.0, (took, err)
    assert code == 128 + sig, err
    assert f"stopped by {'SIGTERM' if sig == signal.SIGTERM else 'Ctrl-C'}" in err
    assert "pieces already verified are kept" in err and "Traceback" not in err
    if case == "streams":
        # The pieces verified before the stop are kept: the next pull fetches the rest only.
        with LoopbackNginx(origin) as good:
            r = pull_version([Source(good.url)], "m", "v1", Store(store), options=FAST,
                             connections=CONNECTIONS)
        assert 0 < r.bytes_fetched < r.bytes_total
        same_files(r.path, version_dir(origin))


# -- gzip ------------------------------------------------------------------------------------------
def test_a_gzip_bomb_for_a_manifest_is_refused_in_bounded_memory(origin, tmp_path):
    """1 MB that inflates to 1 GiB: refused past the manifest limit (64 MiB), and the process
    never holds much more than that (urllib3 1.26 used to inflate all of it at once)."""
    out, peak = tmp_path / "err", tmp_path / "peak"
    # The peak is the CLI's own (VmHWM of its memory map, read as it exits): a child's
    # ru_maxrss starts at its parent's RSS (exec records the mm it replaces), and pytest's own
    # grows with the suite.
    measure = ("import atexit, sys, runpy; atexit.register(lambda: open(sys.argv.pop(), 'w')"
               ".write(open('/proc/self/status').read())); sys.argv = ['wagent', *sys.argv[1:]]; "
               "from agent.cli import main; sys.exit(main(sys.argv[1:-1]))")
    with FaultyServer(origin, "gzip_bomb", fault_on=r"manifest\.json$") as srv, \
            open(out, "wb") as err:
        p = subprocess.run([sys.executable, "-c", measure, "pull", f"{srv.url}/m/v1",
                            "--store", str(tmp_path / "store"), "-q", str(peak)], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=err, timeout=120)
    message = out.read_text()
    assert p.returncode == 1, message
    assert f"larger than {manifest.MAX_MANIFEST_BYTES} bytes" in message
    hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", peak.read_text(), re.M).group(1))
    assert 10 * 1024 < hwm < 400 * 1024, f"peak RSS {hwm} KiB"


def test_a_gzip_encoded_manifest_is_decoded(origin, tmp_path):
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "gzipped", fault_on=r"manifest\.json$") as srv:
        r = pull_version([Source(srv.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        assert srv.faults_done == 1
    same_files(r.path, version_dir(origin))


# -- ETags -----------------------------------------------------------------------------------------
ONE_PIECE = PullOptions(streams=2, request_size=1, retries=0, backoff_base=0.01, read_timeout=5,
                        connect_timeout=2)


def test_a_source_whose_etags_flap_is_pulled_from_and_nothing_is_fetched_twice(origin, tmp_path,
                                                                               caplog):
    """Two backends with their own ETags for the same bytes: every piece still verifies, so
    the ETag is only a hint, dropped for this source; no verified piece is ever discarded."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "etag_flap") as lb:
        r = pull_version([Source(lb.url)], "m", "v1", store, options=ONE_PIECE,
                         connections=CONNECTIONS)
        assert lb.faults_done > 2
    assert r.bytes_fetched == r.bytes_total
    same_files(r.path, version_dir(origin))
    assert any("ETags" in m and lb.url in m for m in caplog.messages), caplog.messages


def test_a_file_that_really_changed_is_named_and_its_verified_pieces_kept(origin, tmp_path):
    store = Store(tmp_path / "store")
    one_stream = PullOptions(streams=1, request_size=1, retries=0, backoff_base=0.01,
                             read_timeout=5, connect_timeout=2)
    shard = version_dir(origin) / SHARD
    with FaultyServer(origin, "changed", fault_on=SHARD, after=2) as bad:
        with pytest.raises(PullError, match=rf"{SHARD}: bytes \d+\+ failed .* do not match "
                                            r"their sha256 in the manifest.*changed on the "
                                            r"source"):
            pull_version([Source(bad.url)], "m", "v1", store, options=one_stream,
                         connections=CONNECTIONS)
    with LoopbackNginx(origin) as good:
        r = pull_version([Source(good.url)], "m", "v1", store, options=one_stream,
                         connections=CONNECTIONS)
        sent = good.bytes_sent(f"/m/v1/{SHARD}")
    assert 0 < sent < shard.stat().st_size          # its two verified pieces were kept
    same_files(r.path, version_dir(origin))


# -- credentials -----------------------------------------------------------------------------------
PASSWORD = "p@s3cr3t"          # an "@" in it: redaction must not stop at the first one


@pytest.mark.parametrize("case", ["manifest", "piece"])
def test_credentials_in_a_source_url_reach_no_message_nor_log(origin, tmp_path, caplog, case):
    caplog.set_level(logging.DEBUG, logger="agent")
    root = origin
    if case == "manifest":
        root = tmp_path / "bad"
        (root / "m" / "v1").mkdir(parents=True)
        text = (version_dir(origin) / "manifest.json").read_text()
        (root / "m" / "v1" / "manifest.json").write_text(
            text.replace('"path": "config.json"', '"path": "../evil"'))
    with FaultyServer(root, "corrupt" if case == "piece" else None) as srv:
        url = srv.url.replace("http://", f"http://user:{PASSWORD}@")
        with pytest.raises(PullError, match="'..' part" if case == "manifest" else
                           "do not match their sha256") as e:
            pull_version([Source(url)], "m", "v1", Store(tmp_path / "store"), options=FAST,
                         connections=CONNECTIONS)
    assert srv.url in str(e.value)
    for text in (str(e.value), caplog.text):
        assert "s3cr3t" not in text and "user:" not in text


# -- manifests built to break the parser -----------------------------------------------------------
def nested(text: str) -> str:
    return text.replace('"files":', '"junk": ' + "[" * 100_000 + "]" * 100_000 + ', "files":')


def huge_size(text: str) -> str:
    doc = json.loads(text)
    doc["files"][0]["size"] = 2**80
    return json.dumps(doc)


def many_digits(text: str) -> str:
    return text.replace('"format": 1', '"format": ' + "1" * 5000)


@pytest.mark.parametrize("breaking, message", [
    (nested, "nested too deeply"),
    (huge_size, "more than any file can hold"),
    (many_digits, "too many digits"),
])
def test_a_manifest_that_breaks_the_parser_sends_the_pull_to_the_mirror(origin, tmp_path,
                                                                         breaking, message):
    bad_root = tmp_path / "bad"
    (bad_root / "m" / "v1").mkdir(parents=True)
    (bad_root / "m" / "v1" / "manifest.json").write_text(
        breaking((version_dir(origin) / "manifest.json").read_text()))
    store = Store(tmp_path / "store")
    with FaultyServer(bad_root) as bad:
        with pytest.raises(PullError, match=message):
            pull_version([Source(bad.url)], "m", "v1", store, options=FAST, connections=CONNECTIONS)
        with LoopbackNginx(origin) as good:
            r = pull_version([Source(bad.url), Source(good.url)], "m", "v1", store,
                             options=FAST, connections=CONNECTIONS)
    same_files(r.path, version_dir(origin))


# -- the daemon's pull worker ----------------------------------------------------------------------
def test_a_stuck_source_holds_up_no_other_model(tmp_path):
    """Model a's source trickles its headers; model b, after it in the policy, is pulled all
    the same (a fails at its deadline and is retried later), and a shows the reason."""
    root = tmp_path / "origin"
    for name in ("a", "b"):
        d = root / name / "v1"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(name.encode() * 100_000)
        publish_dir(d, piece_size=2**16)
    store = Store(tmp_path / "store")
    with FaultyServer(root, "slow_headers", fault_on=r"^/a/", **SLOW_HEADERS) as srv:
        sources = [Source(srv.url)]

        def pull(model, version, progress, stop):
            engine.pull_version(sources, model.name, version, store, options=FAST, stop=stop,
                                connections=CONNECTIONS)

        deps = WorkerDeps(
            clock=time.monotonic,
            resolve=lambda m: engine.resolve_latest(sources, m.name, FAST, connections=CONNECTIONS),
            published=lambda m, v: 0.0,
            schedule=lambda m, v, pub, now: (now, now),
            window=lambda now: WindowState(True),
            have=lambda m, v: store.installed(m.name, v) is not None,
            local_version=lambda m: None,
            pull=pull,
            evict=lambda: None,
            poll_after=lambda m, polled, interval: polled + interval)
        puller = Worker(Policy(models=(Model("a"), Model("b")), sources=tuple(sources),
                               poll_interval=300.0), deps)
        jobs = Scheduler()
        jobs.start()
        puller.start(jobs)
        try:
            # Each model is a job of its own: b is done while a still waits for its headers.
            wait_for(lambda: {i.model: i.state for i in puller.snapshot()}.get("b") == "done")
            wait_for(lambda: any(i.model == "a" and i.error for i in puller.snapshot()))
        finally:
            puller.stop()
            jobs.shutdown(wait=False)
    a = next(i for i in puller.snapshot() if i.model == "a")
    assert "response headers did not arrive within 1 s" in (a.error or ""), a
    assert store.installed("b", "v1") is not None


# -- what HTTP allows a source to say ------------------------------------------------------------
def test_informational_responses_before_the_answer_are_skipped(origin, tmp_path):
    """A `103 Early Hints` (nginx's early_hints, CDNs) before every answer: `latest`, the
    manifest and every range. Before, http.client took the 103 for the answer."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "early_hints", fault_on=r".") as hinting:
        r = pull_version([Source(hinting.url)], "m", "latest", store, options=FAST,
                         connections=CONNECTIONS)
        assert hinting.faults_done >= 4
    same_files(r.path, version_dir(origin))


def test_a_busy_source_is_asked_again_only_after_its_retry_after(origin, tmp_path):
    """503 with Retry-After: 1, twice, on one shard: each retry waits the second it was told
    (before: six rounds 10 ms apart, and the pull failed in a 503 storm), and the pull ends."""
    store = Store(tmp_path / "store")
    opts = PullOptions(streams=1, retries=5, backoff_base=0.01, read_timeout=5,
                       connect_timeout=2, headers_deadline=2.0)
    with FaultyServer(origin, "busy_503", fault_on=SHARD, times=2, retry_after=1) as busy:
        r = pull_version([Source(busy.url)], "m", "v1", store, options=opts,
                         connections=CONNECTIONS)
        times = [t for p, t in busy.arrivals if p.endswith(SHARD)]
        statuses = [status for p, _, status in busy.requests if p.endswith(SHARD)]
    same_files(r.path, version_dir(origin))
    assert statuses[:3] == [503, 503, 206]
    assert times[1] - times[0] >= 1.0 and times[2] - times[1] >= 1.0
