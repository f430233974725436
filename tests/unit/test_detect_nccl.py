import os
from pathlib import Path

from agent.yielding.detect.nccl import NcclDetector
from tests.backoff_helpers import add_process

# /proc/<pid>/maps of a torch process with the NCCL that pip's nvidia-nccl wheel ships.
TORCH_MAPS = (Path(__file__).parent / "data" / "detect" / "torch_maps").read_text()
PLAIN_MAPS = """\
55d0c0a00000-55d0c0a2e000 r--p 00000000 fd:01 1311 /usr/sbin/nginx
7f3a20000000-7f3a20021000 r-xp 00000000 fd:01 77 /usr/lib/x86_64-linux-gnu/libc.so.6
"""


def test_finds_processes_mapping_libnccl(tmp_path):
    add_process(tmp_path, 4242, "python", TORCH_MAPS)
    add_process(tmp_path, 17, "nginx", PLAIN_MAPS)
    add_process(tmp_path, 2, "kthreadd", "")                  # kernel threads: empty maps
    (tmp_path / "proc" / "self").mkdir()                     # not a pid: ignored
    (r,) = NcclDetector(tmp_path).sample(0.0)
    assert (r.pid, r.comm) == (4242, "python")


def test_unreadable_and_vanished_processes_are_skipped(tmp_path):
    add_process(tmp_path, 100, "secret", TORCH_MAPS, readable=False)
    add_process(tmp_path, 101, "python", TORCH_MAPS)
    (tmp_path / "proc" / "102").mkdir()                      # exited: no maps, no comm
    (tmp_path / "proc" / "101" / "comm").unlink()            # exiting while we looked
    assert [(r.pid, r.comm) for r in NcclDetector(tmp_path).scan()] == [(101, "?")]


def test_scans_at_most_every_few_seconds(tmp_path):
    det = NcclDetector(tmp_path, every=5.0)
    assert det.sample(0.0) == ()                             # no /proc: nothing, no error
    add_process(tmp_path, 4242, "python", TORCH_MAPS)
    assert det.sample(1.0) == ()                             # cached until the next scan
    assert det.scans == 1
    assert det.sample(5.0)[0].pid == 4242
    (tmp_path / "proc" / "4242" / "maps").write_text(PLAIN_MAPS)
    assert det.sample(6.0)[0].pid == 4242
    assert det.sample(10.0) == ()
    assert det.scans == 3


def test_live_proc_scan_skips_itself():
    # This test process maps no libnccl, and must never report itself either way.
    assert os.getpid() not in [r.pid for r in NcclDetector().scan()]
