"""Local copies between files, and the partial files' journals and claims, on real files."""

import fcntl
import hashlib
import os
import struct
import threading
import time

import pytest

from agent.pull.transfer import BlobFiles, copy_range
from agent.store import Store
from agent.store.partial import Claims, Partial, PartialBusy, clean


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


# -- claims: one descriptor owns every file of a pull; files open only while worked on --------

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def names(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


def test_a_pull_holds_hundreds_of_partial_files_with_one_descriptor(tmp_path):
    """Each file is claimed on the pull's one descriptor and opened only while worked on: a
    version's files cost no descriptors (issue 21: two each, 1024 at most, used to be held)."""
    before = open_fds()
    claims = Claims(tmp_path)
    parts = [Partial(tmp_path, n, 10, durable=False, claims=claims) for n in names(300)]
    assert open_fds() == before + 1
    assert all(p.fd < 0 for p in parts) and all(p.created for p in parts)
    with parts[0].opened(), parts[0].opened(), parts[1].opened():
        assert open_fds() == before + 5          # two files each, shared by nested users
        parts[0].write(0, b"x" * 10)
        parts[0].record_piece(0, 10, "a" * 64)
    assert open_fds() == before + 1
    with pytest.raises(RuntimeError, match="outside opened"):
        parts[2].write(0, b"x")
    for p in parts:
        p.close()
    claims.close()
    assert open_fds() == before
    assert not (tmp_path / ".claims").exists()     # nobody holds one: the lock file goes
    again = Partial(tmp_path, names(1)[0], 10)
    assert again.done == {0: (10, "a" * 64)} and not again.created
    again.close()


def test_a_claimed_file_is_busy_for_another_pull_and_free_once_given_back(tmp_path):
    a, b = Claims(tmp_path), Claims(tmp_path)
    first, second = names(2)
    p = Partial(tmp_path, first, 10, claims=a)
    with pytest.raises(PartialBusy, match="another pull is already fetching"):
        Partial(tmp_path, first, 10, claims=b)
    with pytest.raises(PartialBusy):
        Partial(tmp_path, first, 10)               # made alone: a claims of its own
    q = Partial(tmp_path, second, 10, claims=b)    # another file: no conflict
    p.close()                                      # gives it back, a still open
    r = Partial(tmp_path, first, 10, claims=b)
    q.close()
    a.close()
    assert (tmp_path / ".claims").exists()         # b holds r: the lock file stays
    r.close()
    b.close()
    assert not (tmp_path / ".claims").exists()


def test_clean_never_removes_a_claimed_file_and_removes_an_unclaimed_one(tmp_path):
    held, free = names(2)
    claims = Claims(tmp_path)
    Partial(tmp_path, held, 10, claims=claims)
    Partial(tmp_path, free, 10, claims=claims).close()
    removed = clean(tmp_path, time.time(), lambda name, idle: True)
    assert [name for name, _ in removed] == [free]
    assert sorted(os.listdir(tmp_path)) == [".claims", f"{held}.journal", f"{held}.part"]
    claims.close()
    assert [name for name, _ in clean(tmp_path, time.time(), lambda n, i: True)] == [held]
    assert os.listdir(tmp_path) == []


def test_clean_leaves_a_file_whose_journal_an_older_wagent_holds(tmp_path):
    name = names(1)[0]
    Partial(tmp_path, name, 10).close()
    fd = os.open(tmp_path / f"{name}.journal", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)             # how a pull before the claims file owned it
        assert clean(tmp_path, time.time(), lambda n, i: True) == []
    finally:
        os.close(fd)
    assert [n for n, _ in clean(tmp_path, time.time(), lambda n, i: True)] == [name]


def test_a_claim_on_a_claims_file_removed_meanwhile_is_taken_again_on_the_new_one(tmp_path):
    """The last owner out removes the claims file; one who opened it before takes its claim on
    the file at the path, where the next owner sees it."""
    late, other, wanted = Claims(tmp_path), Claims(tmp_path), names(3)
    late.take(wanted[0], "busy")
    late.give_back(wanted[0])                      # open on the old file, holding nothing
    other.take(wanted[1], "busy")
    other.close()                                  # the last out: removes the file
    assert not (tmp_path / ".claims").exists()
    late.take(wanted[2], "busy")
    with Claims(tmp_path) as third, pytest.raises(PartialBusy):
        third.take(wanted[2], "busy")
    late.close()


def test_a_claim_waits_out_the_removal_of_the_claims_file_instead_of_failing(tmp_path):
    """While the last owner out holds the whole file to remove it, a new claim is not told
    "busy": it takes its byte on the next file."""
    remover = Claims(tmp_path)
    remover.take(names(1)[0], "busy")
    fd = os.open(tmp_path / ".claims", os.O_RDWR)
    remover.close()
    assert not (tmp_path / ".claims").exists()
    # Hold a whole-file lock on a claims file at the path, as a remover does before unlinking.
    os.close(fd)
    fd = os.open(tmp_path / ".claims", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
    newcomer = Claims(tmp_path)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(newcomer.take(names(2)[1], "busy")))
    t.start()
    time.sleep(0.05)
    assert t.is_alive()                            # waiting, not busy
    os.unlink(tmp_path / ".claims")
    os.close(fd)
    t.join(5)
    assert got == [None]
    with Claims(tmp_path) as third, pytest.raises(PartialBusy):
        third.take(names(2)[1], "busy")
    newcomer.close()


def test_the_copier_keeps_a_few_local_blobs_open_not_all(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    for n in names(20):
        (store.blobs / n).write_bytes(b"x")
    before = open_fds()
    with BlobFiles(store, keep=4) as blobs:
        fds = [blobs.fd(n) for n in names(20)]
        assert open_fds() == before + 4
        assert blobs.fd(names(20)[-1]) == fds[-1]  # the recent ones stay open
    assert open_fds() == before
