"""The transfer's bookkeeping on real files, with bodies fed by hand (no network)."""

import hashlib
import os
import threading
from collections import deque

import pytest

from agent.manifest import Piece
from agent.policy_model import Source
from agent.pull.http import FetchError, Timeouts
from agent.pull.journal import Partial
from agent.pull.transfer import FileState, Settings, Transfer, _Stale, copy_range
from agent.store import Store


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


GOOD = b"G" * 8 + b"H" * 8
PIECES = (Piece(0, 8, sha(GOOD[:8])), Piece(8, 8, sha(GOOD[8:])))


@pytest.fixture
def transfer(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    part = Partial(store.partial, sha(GOOD), len(GOOD), durable=False)
    part.preallocate()
    f = FileState(sha(GOOD), sha(GOOD), len(GOOD), "f.bin", PIECES, part, remaining=2)
    t = Transfer([Source("http://127.0.0.1:9")], store, {f.blob: f}, [], [],
                 Settings("m", "v1", 1, 16, 4, Timeouts(), 0, 0.01, 0.01, False),
                 None, threading.Event(), on_file=lambda f, n: None)
    yield t, f
    part.close()


def test_a_stream_of_a_restarted_file_never_writes_over_a_verified_piece(transfer):
    """After an ETag change restarts the file, a stream still receiving old bytes must stop
    before its next write: the new generation's verified piece stays as verified."""
    t, f = transfer
    first_written, go = threading.Event(), threading.Event()

    def stale_body():
        yield memoryview(b"BBBB")
        first_written.set()
        go.wait(5)
        yield memoryview(b"BBBB")

    outcome = []

    def stale():
        try:
            t._receive("u", f, stale_body(), deque([PIECES[0]]), 0, 0)
            outcome.append("done")
        except (_Stale, FetchError) as e:
            outcome.append(type(e).__name__)

    th = threading.Thread(target=stale)
    th.start()
    assert first_written.wait(5)
    t._restart_file(f, 0, 0)                               # generation 0 -> 1
    t._receive("u", f, iter([memoryview(GOOD[:8])]), deque([PIECES[0]]), 0, 1)
    assert f.partial.done == {0: (8, PIECES[0].sha256)}
    go.set()
    th.join(5)
    assert outcome == ["_Stale"]
    assert os.pread(f.partial.fd, 8, 0) == GOOD[:8]


def test_a_restart_waits_for_a_write_in_flight(transfer):
    t, f = transfer
    with t.cond:
        f.writers = 1                       # a stream is inside pwrite right now
    restarted = threading.Event()
    th = threading.Thread(target=lambda: (t._restart_file(f, 0, 0), restarted.set()))
    th.start()
    assert not restarted.wait(0.2)
    t._wrote(f, 0)
    assert restarted.wait(5)
    th.join()
    assert f.generation == 1 and [r.pieces for r in t.queue] == [(PIECES[0],), (PIECES[1],)]


def test_copy_range_reports_a_short_source(tmp_path):
    (tmp_path / "src").write_bytes(b"abc")
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        assert copy_range(src, dst, 0, 0, 10) == 3
        assert copy_range(src, dst, 1, 0, 2) == 2
    finally:
        os.close(src)
        os.close(dst)


def test_journal_claims_past_the_end_of_a_cut_part_file_are_dropped(tmp_path):
    p = Partial(tmp_path, "f" * 64, 100, durable=False)
    p.preallocate()
    p.record_piece(0, 50, "a" * 64)
    p.record_piece(50, 50, "b" * 64)
    p.close()
    os.truncate(p.part_path, 60)
    q = Partial(tmp_path, "f" * 64, 100)
    assert q.done == {0: (50, "a" * 64)}
    q.close()


def test_finish_keeps_the_journal_until_the_file_is_a_blob(tmp_path):
    p = Partial(tmp_path, "f" * 64, 4, durable=False)
    p.write(0, b"abcd")
    p.record_piece(0, 4, "a" * 64)
    part = p.finish()
    assert p.journal_path.exists() and part.exists()
    p.drop_journal()
    assert not p.journal_path.exists()
    p.close()                               # again: harmless


def test_a_request_taken_just_before_a_restart_belongs_to_the_old_generation(transfer):
    from agent.pull.plan import Request
    t, f = transfer
    t.queue.append(Request(f.blob, (PIECES[0],)))
    req, generation = t._next()
    t._restart_file(f, 0, 0)               # lands between taking the request and using it
    with pytest.raises(_Stale):
        t._receive("u", f, iter([memoryview(b"BBBB")]), deque(req.pieces), 0, generation)
    assert os.pread(f.partial.fd, 4, 0) != b"BBBB"
