"""The root side of ``wagent mount``: the kernel calls that make the mount, and the mount table
read back, kept apart from the daemon that serves it.

Why split this way: the daemon runs unprivileged and never mounts. The root CLI opens
``/dev/fuse``, mounts it (read-only, nosuid, nodev) and hands the descriptor over; the daemon
answers it with pyfuse3. So everything needing CAP_SYS_ADMIN lives here, in a few thin calls into
libc, and nothing else in the agent has to know about mount(2).

The trap this module is shaped around: the kernel sends FUSE INIT during mount(2), and every access
to the mount, even a stat of its mount point, blocks until a server answers it. Between mounting
and handing the descriptor over, nobody answers. So nothing here touches the mount point after
mounting: the device number comes from ``/proc/self/mountinfo`` (``mount_at``), and the read-ahead
is set through sysfs (``set_read_ahead``), neither of which enters the mount.

Why read-ahead at all: FUSE read sizes follow the bdi's readahead window, 128 KiB by default.
Measured here, ``read_ahead_kb`` = 1024 written after the mount gives 1 MiB reads instead.

A session, as the CLI runs it (paths already resolved)::

    fd = open_fuse_device()
    mount_fuse(fd, "/models", "wagent")
    info = mount_at("/models")          # from mountinfo: no stat of /models
    set_read_ahead(info, 1024)          # a failure is the caller's call: slower, not broken
    ... pass fd to the daemon ...

Parsing is pure (``parse_mountinfo``); the I/O around it takes a ``proc``/``sys`` root so tests
point it at a tree under tmp_path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from dataclasses import dataclass

# Flag values from <sys/mount.h> (linux/mount.h): the same on every architecture Linux supports.
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2

FSTYPE = "fuse.wagent"
# The root directory's mode for the FUSE mount, as the kernel parses it: octal text, S_IFDIR.
ROOTMODE = "40000"

_ROOT_HINT = "run it as root: mounting needs CAP_SYS_ADMIN"
_FUSE_MISSING_HINT = ("the kernel has no FUSE: load it with `modprobe fuse` (and install fuse3: "
                      "apt-get install fuse3); in a container, pass the device in "
                      "(docker run --device /dev/fuse --cap-add SYS_ADMIN)")


class MountError(Exception):
    """A mount call failed. The message says what failed, on which path, the kernel's reason and
    what to do; ``errno`` and ``path`` keep the first two for callers that branch on them."""

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.path = path


def _error(what: str, path: str, err: int, hint: str = "") -> MountError:
    if not hint and err in (errno.EPERM, errno.EACCES):
        hint = _ROOT_HINT
    message = f"{what} {path}: {os.strerror(err)}"
    return MountError(f"{message} ({hint})" if hint else message, errno=err, path=path)


# -- the calls ------------------------------------------------------------------------------

def _libc() -> ctypes.CDLL:
    # Loaded per call rather than kept in a module global: mounting happens a handful of times
    # per run, and dlopen(NULL) of the already-loaded libc costs nothing.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_void_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None) -> int:
    """mount(2); 0, or the errno it failed with."""
    enc = os.fsencode
    data_buf = ctypes.create_string_buffer(enc(data)) if data is not None else None
    rc = libc.mount(enc(source) if source is not None else None, enc(target),
                    enc(fstype) if fstype is not None else None, flags, data_buf)
    return ctypes.get_errno() if rc != 0 else 0


def _umount2(libc: ctypes.CDLL, target: str, flags: int) -> int:
    """umount2(2); 0, or the errno it failed with."""
    return ctypes.get_errno() if libc.umount2(os.fsencode(target), flags) != 0 else 0


def open_fuse_device(path: str = "/dev/fuse") -> int:
    """Open the FUSE device for one mount; the caller owns the descriptor (close-on-exec: it is
    passed to the daemon deliberately, never leaked to other children)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        err = e.errno or errno.EIO
        hint = _FUSE_MISSING_HINT if err in (errno.ENOENT, errno.ENODEV, errno.ENXIO) else ""
        raise _error("opening the FUSE device", path, err, hint) from None


def fuse_mount_data(fd: int, *, allow_other: bool = True) -> str:
    """The FUSE mount's data string.

    ``user_id``/``group_id`` are root's: the root CLI owns the mount, the daemon only serves the
    descriptor. ``allow_other`` lets users other than root in at all (training jobs run as
    themselves); ``default_permissions`` has the kernel check file modes, so the daemon doesn't.

    >>> fuse_mount_data(7)
    'fd=7,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions'
    >>> fuse_mount_data(7, allow_other=False)
    'fd=7,rootmode=40000,user_id=0,group_id=0,default_permissions'
    """
    options = [f"fd={fd}", f"rootmode={ROOTMODE}", "user_id=0", "group_id=0"]
    if allow_other:
        options.append("allow_other")
    options.append("default_permissions")
    return ",".join(options)


def mount_fuse(fd: int, target: str, source: str, *, allow_other: bool = True) -> None:
    """Mount the FUSE device ``fd`` (from ``open_fuse_device``) read-only at ``target``.

    From here until a server answers INIT on ``fd``, any access to ``target`` blocks: don't stat
    it, use ``mount_at``. ``fd`` stays open and the caller's (on failure too)."""
    err = _mount(_libc(), source, target, FSTYPE, MS_RDONLY | MS_NOSUID | MS_NODEV,
                 fuse_mount_data(fd, allow_other=allow_other))
    if err:
        hint = {
            errno.ENODEV: _FUSE_MISSING_HINT,
            errno.ENOENT: "create the mount point directory first",
            errno.ENOTDIR: "the mount point must be a directory",
            errno.EINVAL: "is fd a freshly opened /dev/fuse descriptor, not used for a mount yet?",
        }.get(err, "")
        raise _error(f"mounting FUSE ({FSTYPE}, fd {fd}) at", target, err, hint)


def bind_mount(source: str, target: str) -> None:
    """Bind ``source`` (not its submounts) at ``target``, read-only, nosuid, nodev.

    Two calls because the kernel ignores MS_RDONLY on the bind itself: the bind, then a remount of
    the bind alone. If the remount fails, the writable bind is detached before raising: a
    read-only view must never be left behind writable."""
    libc = _libc()
    err = _mount(libc, source, target, None, MS_BIND, None)
    if err:
        hint = "source and mount point must both exist" if err == errno.ENOENT else ""
        raise _error(f"bind-mounting {source} at", target, err, hint)
    err = _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
                 None)
    if err:
        undo = _umount2(libc, target, MNT_DETACH)
        hint = "the bind was undone" if not undo else (
            f"undoing the bind failed too ({os.strerror(undo)}): it is still mounted writable, "
            f"unmount it by hand: umount -l {target}")
        raise _error("making the bind mount read-only at", target, err, hint)


def unmount(target: str, *, lazy: bool = False) -> None:
    """Unmount ``target``; ``lazy`` detaches it now and lets the kernel finish once the last open
    file in it is closed (what a FUSE mount whose daemon died needs)."""
    err = _umount2(_libc(), target, MNT_DETACH if lazy else 0)
    if err:
        hint = {
            errno.EINVAL: "not a mount point",
            errno.EBUSY: "still in use (open files, or a working directory inside): close them, "
                         "or unmount lazily",
            errno.ENOENT: "no such path",
        }.get(err, "")
        raise _error("unmounting", target, err, hint)


# -- the mount table ------------------------------------------------------------------------

@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/<pid>/mountinfo (proc(5)), with paths unescaped.

    ``major``/``minor`` are the superblock's device: the name of a FUSE mount's bdi in sysfs."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str


# The kernel writes space, tab, newline and backslash in paths as \ and three octal digits
# (fs/proc_namespace.c: mangle), so a field never contains a raw space.
_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse mountinfo's text: six fields, optional fields (``shared:1``, ``master:2``, ...) up to
    a lone ``-``, then fstype, source and the superblock's options.

    >>> [m] = parse_mountinfo("36 35 98:0 /mnt1 /mnt\\\\0402 rw,noatime master:1 - ext3 "
    ...                       "/dev/root rw,errors=continue\\n")
    >>> m.mount_point, m.major, m.minor, m.fstype
    ('/mnt 2', 98, 0, 'ext3')
    """
    result = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mount_id, parent_id, dev, root, mount_point, options = fields[:6]
            fstype, source, super_options = fields[sep + 1:sep + 4]
            major, minor = dev.split(":")
            result.append(MountInfo(
                mount_id=int(mount_id), parent_id=int(parent_id), major=int(major),
                minor=int(minor), root=_unescape(root), mount_point=_unescape(mount_point),
                options=options, fstype=_unescape(fstype), source=_unescape(source),
                super_options=super_options))
        except ValueError:
            raise ValueError(
                f"mountinfo line {number} is not in proc(5)'s format: {line!r}") from None
    return result


def mounts(proc: str = "/proc") -> list[MountInfo]:
    """The mounts this process sees (its mount namespace), in the kernel's order."""
    path = os.path.join(proc, "self", "mountinfo")
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as e:
        hint = "is /proc mounted?" if e.errno == errno.ENOENT else ""
        raise _error("reading the mount table", path, e.errno or errno.EIO, hint) from None
    try:
        return parse_mountinfo(text)
    except ValueError as e:
        raise MountError(f"reading the mount table {path}: {e}", path=path) from None


def mount_at(path: str, proc: str = "/proc") -> MountInfo | None:
    """The mount on top at ``path``, or None when nothing is mounted exactly there.

    ``path`` is only made absolute (``os.path.abspath``), not resolved: resolving would lstat the
    mount point, and on a FUSE mount not yet served that blocks until INIT is answered. Callers
    pass an already resolved path (the CLI resolves it before mounting), so a symlinked path
    simply finds nothing.

    On top: mounts stacked at one point appear in mounting order, so it is the last of them, unless
    the chain of parents says otherwise (a mount moved there later keeps its place in the list):
    the one no other mount at that point sits on."""
    point = os.path.abspath(path)
    here = [m for m in mounts(proc) if m.mount_point == point]
    below = {m.parent_id for m in here}
    top = [m for m in here if m.mount_id not in below]
    return (top or here or [None])[-1]


def set_read_ahead(info: MountInfo, kb: int, sys: str = "/sys") -> None:
    """Set the read-ahead of the mount's bdi to ``kb`` KiB: FUSE reads come in chunks this size
    (128 KiB by default). Through sysfs, so the mount itself is never touched. A failure raises
    MountError; the mount works without it, only with smaller reads, so the caller decides."""
    if kb < 0:
        raise ValueError(f"read-ahead must be 0 KiB or more, not {kb}")
    path = os.path.join(sys, "class", "bdi", f"{info.major}:{info.minor}", "read_ahead_kb")
    try:
        # No O_CREAT: a missing bdi is an error to report, not a file to make.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, f"{kb}\n".encode())
        finally:
            os.close(fd)
    except OSError as e:
        hint = {
            errno.ENOENT: f"no bdi {info.major}:{info.minor} for {info.mount_point} "
                          f"({info.fstype}): is it still mounted?",
            errno.EROFS: "sysfs is read-only here (a container?)",
        }.get(e.errno or 0, "")
        raise _error(f"setting the read-ahead of {info.mount_point} to {kb} KiB in", path,
                     e.errno or errno.EIO, hint) from None
