"""Local copies between files, and the partial files' journals, on real files."""

import os

from agent.pull.transfer import copy_range
from agent.store.partial import Partial


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
