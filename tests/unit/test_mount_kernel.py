"""agent.mount.kernel: the mountinfo parser on a recorded-style table, the proc/sys readers on
fake trees, the mount calls' arguments and rollback through a fake libc, and one real bind mount
as root. No test mounts FUSE: with no server to answer INIT, the first access would hang."""

from __future__ import annotations

import ctypes
import doctest
import errno
import os

import pytest

from agent.mount import kernel
from agent.mount.kernel import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    MountError,
    MountInfo,
    bind_mount,
    mount_at,
    mount_fuse,
    mounts,
    open_fuse_device,
    parse_mountinfo,
    set_read_ahead,
    unmount,
)

# Shaped like this host's /proc/self/mountinfo, plus a shared root, a slave with two optional
# fields, a path with a space, tab and backslash, and a served wagent mount.
MOUNTINFO = (
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    "23 27 0:22 / /sys rw,relatime - sysfs sysfs rw\n"
    "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard\n"
    "41 27 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 master:2 - cgroup2 cgroup2 rw\n"
    "52 27 254:0 /srv/My\\040Models /mnt/my\\040models\\011tab\\134back ro,nosuid,nodev,relatime"
    " - ext4 /dev/vda rw,discard\n"
    "60 27 0:61 / /models ro,nosuid,nodev,relatime - fuse.wagent wagent"
    " rw,user_id=0,group_id=0,default_permissions,allow_other\n"
)


def write_proc(tmp_path, text):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(text)
    return str(tmp_path / "proc")


def test_parse_mountinfo_fields():
    table = parse_mountinfo(MOUNTINFO)
    assert [m.mount_id for m in table] == [22, 23, 27, 41, 52, 60]
    assert table[-1] == MountInfo(
        mount_id=60, parent_id=27, major=0, minor=61, root="/", mount_point="/models",
        options="ro,nosuid,nodev,relatime", fstype="fuse.wagent", source="wagent",
        super_options="rw,user_id=0,group_id=0,default_permissions,allow_other")


def test_parse_mountinfo_optional_fields_end_at_the_separator():
    root, cgroup = parse_mountinfo(MOUNTINFO)[2:4]
    assert (root.major, root.minor, root.mount_point, root.fstype, root.source) == (
        254, 0, "/", "ext4", "/dev/vda")
    assert (cgroup.options, cgroup.fstype, cgroup.source, cgroup.super_options) == (
        "rw,relatime", "cgroup2", "cgroup2", "rw")


def test_parse_mountinfo_unescapes_paths():
    bound = parse_mountinfo(MOUNTINFO)[4]
    assert bound.root == "/srv/My Models"
    assert bound.mount_point == "/mnt/my models\ttab\\back"


def test_parse_mountinfo_says_which_line_is_wrong():
    with pytest.raises(ValueError, match="line 2 .*'27 1 254:0 / / rw'"):
        parse_mountinfo("22 27 0:21 / /proc rw - proc proc rw\n27 1 254:0 / / rw\n")


def test_doctests():
    assert doctest.testmod(kernel).failed == 0


def test_mount_at_finds_the_escaped_path(tmp_path):
    proc = write_proc(tmp_path, MOUNTINFO)
    assert mount_at("/mnt/my models\ttab\\back", proc).mount_id == 52
    assert mount_at("/models/", proc).mount_id == 60   # abspath drops the slash
    assert mount_at("/models/sub", proc) is None       # inside a mount is not a mount point


def test_mount_at_picks_the_topmost(tmp_path):
    # A bind stacked on the served FUSE mount: the later one is on top.
    proc = write_proc(tmp_path, MOUNTINFO
                      + "61 60 254:0 /srv /models ro,nosuid,nodev - ext4 /dev/vda rw\n")
    assert mount_at("/models", proc).mount_id == 61


def test_mount_at_follows_parents_when_order_disagrees(tmp_path):
    # 70 was moved on top of 71 after 71 was mounted: the list order says 71, the parents say 70.
    proc = write_proc(tmp_path, "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
                                "70 71 0:5 / /x rw - tmpfs a rw\n"
                                "71 27 0:6 / /x rw - tmpfs b rw\n")
    assert mount_at("/x", proc).source == "a"


def test_mounts_without_proc_says_what_to_check(tmp_path):
    with pytest.raises(MountError, match="reading the mount table .*No such file.*is /proc"):
        mounts(str(tmp_path))


def test_set_read_ahead_writes_the_bdi(tmp_path):
    bdi = tmp_path / "sys" / "class" / "bdi" / "0:61"
    bdi.mkdir(parents=True)
    (bdi / "read_ahead_kb").write_text("128000\n")    # longer than what replaces it
    set_read_ahead(parse_mountinfo(MOUNTINFO)[-1], 1024, str(tmp_path / "sys"))
    assert (bdi / "read_ahead_kb").read_text() == "1024\n"


def test_set_read_ahead_without_the_bdi_raises_and_creates_nothing(tmp_path):
    (tmp_path / "sys" / "class" / "bdi").mkdir(parents=True)
    with pytest.raises(MountError, match=r"/models to 1024 KiB .*0:61/read_ahead_kb.*no bdi 0:61"):
        set_read_ahead(parse_mountinfo(MOUNTINFO)[-1], 1024, str(tmp_path / "sys"))
    assert not (tmp_path / "sys" / "class" / "bdi" / "0:61").exists()


def test_open_fuse_device_missing(tmp_path):
    path = str(tmp_path / "no-fuse")
    with pytest.raises(MountError) as e:
        open_fuse_device(path)
    message = str(e.value)
    assert path in message and os.strerror(errno.ENOENT) in message
    assert "modprobe fuse" in message and "fuse3" in message
    assert (e.value.errno, e.value.path) == (errno.ENOENT, path)


class FakeLibc:
    """mount/umount2 that record their calls and fail with the errnos queued for them."""

    def __init__(self, mount_errors=(), umount_errors=()):
        self.calls = []
        self._errors = {"mount": list(mount_errors), "umount2": list(umount_errors)}

    def _result(self, name):
        err = self._errors[name].pop(0) if self._errors[name] else 0
        ctypes.set_errno(err)
        return -1 if err else 0

    def mount(self, source, target, fstype, flags, data):
        self.calls.append(("mount", source, target, fstype, flags, data and data.value))
        return self._result("mount")

    def umount2(self, target, flags):
        self.calls.append(("umount2", target, flags))
        return self._result("umount2")


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(kernel, "_libc", lambda: fake)
    return fake


def test_mount_fuse_arguments(libc):
    mount_fuse(9, "/models", "wagent")
    mount_fuse(9, "/models", "wagent", allow_other=False)
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    assert libc.calls == [
        ("mount", b"wagent", b"/models", b"fuse.wagent", flags,
         b"fd=9,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"),
        ("mount", b"wagent", b"/models", b"fuse.wagent", flags,
         b"fd=9,rootmode=40000,user_id=0,group_id=0,default_permissions"),
    ]


def test_mount_fuse_refused(libc):
    libc._errors["mount"] = [errno.EPERM]
    with pytest.raises(MountError, match=r"mounting FUSE .*/models: Operation not permitted "
                                         r"\(run it as root"):
        mount_fuse(9, "/models", "wagent")


def test_bind_mount_binds_then_remounts_read_only(libc):
    bind_mount("/srv/a", "/mnt/b")
    assert libc.calls == [
        ("mount", b"/srv/a", b"/mnt/b", None, MS_BIND, None),
        ("mount", None, b"/mnt/b", None,
         MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
    ]


def test_bind_mount_undoes_the_bind_when_the_remount_fails(libc):
    libc._errors["mount"] = [0, errno.EPERM]
    with pytest.raises(MountError, match="read-only at /mnt/b.*the bind was undone") as e:
        bind_mount("/srv/a", "/mnt/b")
    assert e.value.errno == errno.EPERM
    assert libc.calls[-1] == ("umount2", b"/mnt/b", MNT_DETACH)


def test_bind_mount_says_when_the_undo_failed_too(libc):
    libc._errors["mount"] = [0, errno.EPERM]
    libc._errors["umount2"] = [errno.EBUSY]
    with pytest.raises(MountError, match="still mounted writable.*umount -l /mnt/b"):
        bind_mount("/srv/a", "/mnt/b")


def test_bind_mount_failed_bind_is_not_undone(libc):
    libc._errors["mount"] = [errno.ENOENT]
    with pytest.raises(MountError, match="bind-mounting /srv/a at /mnt/b.*must both exist"):
        bind_mount("/srv/a", "/mnt/b")
    assert [c[0] for c in libc.calls] == ["mount"]


def test_unmount_flags_and_not_a_mount_point(libc):
    unmount("/models")
    unmount("/models", lazy=True)
    assert libc.calls == [("umount2", b"/models", 0), ("umount2", b"/models", MNT_DETACH)]
    libc._errors["umount2"] = [errno.EINVAL]
    with pytest.raises(MountError, match=r"unmounting /models: Invalid argument "
                                         r"\(not a mount point\)"):
        unmount("/models")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to bind-mount")
def test_real_bind_mount_is_read_only(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    (source / "weights").write_text("w")
    try:
        bind_mount(str(source), str(target))
        assert (target / "weights").read_text() == "w"
        with pytest.raises(OSError) as e:
            (target / "new").write_text("x")
        assert e.value.errno == errno.EROFS
        (source / "new").write_text("x")              # the source itself stays writable
        info = mount_at(str(target))
        assert info is not None and info.mount_point == str(target)
        assert {"ro", "nosuid", "nodev"} <= set(info.options.split(","))
        unmount(str(target))
        assert mount_at(str(target)) is None
    finally:
        try:
            unmount(str(target), lazy=True)
        except MountError as e:
            if e.errno != errno.EINVAL:              # EINVAL: already unmounted above
                raise
