"""`wagent mount MODEL[@VERSION] DIR` and `wagent umount DIR`: a version, readable before its
last byte lands (docs/mount.md).

Root's: mounting needs CAP_SYS_ADMIN, which the daemon doesn't have and shouldn't. So this
command does the kernel's part and the daemon the rest (``agent.mount.service``):

1. asks the daemon to show the version (it checks the model, picks the version the policy wants
   when none is given, reads the manifest, and starts the version's pull at once);
2. when no FUSE server runs yet: opens /dev/fuse, mounts it read-only (``allow_other``: engines
   run as their own users) on this daemon's root mount, ``/run/wagent-mount/<id>``, hands the
   descriptor to the daemon (SCM_RIGHTS), and raises the mount's read-ahead to 1 MiB (FUSE reads
   follow it: 128 KiB by default);
3. bind-mounts ``ROOT/MODEL@VERSION`` read-only onto DIR.

Any step failing undoes the ones before it: nothing is left half-mounted. `wagent umount` takes
the bind off, tells the daemon, and unmounts the root once no directory shows a version.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Any

from agent.commands import ask_daemon
from agent.control import DEFAULT_SOCKET, ControlError, NotRunning, call
from agent.mount.kernel import (
    FSTYPE,
    MountError,
    bind_mount,
    mount_at,
    mount_fuse,
    open_fuse_device,
    set_read_ahead,
    unmount,
)
from agent.store.views import VIEWS

MOUNT_ROOTS = "/run/wagent-mount"
READ_AHEAD_KB = 1024        # 1 MiB FUSE reads (measured: 2.1 GB/s against 0.66 at 128 KiB)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mount", help="show a version at DIR now, read-only; its pieces come as they are read",
        description="Mount MODEL (at VERSION, or the version the policy wants now) read-only "
        "at DIR, an empty directory, before the version is pulled: reads of pieces not here "
        "yet get them fetched first and wait for them; only verified bytes are read. Root only.")
    p.add_argument("target", metavar="MODEL[@VERSION]")
    p.add_argument("dir", metavar="DIR")
    _socket(p)
    p.set_defaults(func=run_mount)
    u = sub.add_parser("umount", help="take a `wagent mount` off DIR",
                       description="Unmount a directory that `wagent mount` made. Root only.")
    u.add_argument("dir", metavar="DIR")
    u.add_argument("--lazy", action="store_true",
                   help="detach now even while it is in use (readers keep their open files)")
    _socket(u)
    u.set_defaults(func=run_umount)


def _socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")


def mount_root(socket: str) -> str:
    """This daemon's root mount: one per control socket, so daemons side by side (tests, a
    second store) never share one."""
    tag = hashlib.sha256(os.path.abspath(socket).encode()).hexdigest()[:12]
    return os.path.join(MOUNT_ROOTS, tag)


def _fail(cmd: str, message: str) -> int:
    print(f"wagent {cmd}: {message}", file=sys.stderr)
    return 1


def run_mount(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        return _fail("mount", "run it as root: it mounts (the daemon then serves the mount)")
    model, _, version = args.target.partition("@")
    target = os.path.abspath(args.dir)
    problem = _dir_problem(target)
    if problem is not None:
        return _fail("mount", problem)
    # the daemon may read the manifest from the sources first: longer than a status
    result = ask_daemon("mount", args.socket, timeout=120.0,
                        args={"model": model, "version": version or None, "dir": target})
    if result is None:
        return 1
    view = result.get("view")
    try:
        if isinstance(view, str):
            # complete in the store: its view (hard links to the blobs), no FUSE in the way
            bind_mount(view, target)
        else:
            root = mount_root(args.socket)
            _ensure_served(root, args.socket, bool(result.get("serving")))
            bind_mount(os.path.join(root, result["entry"]), target)
    except (MountError, ControlError, OSError) as e:
        try:
            call(args.socket, "umount", {"dir": target})
        except ControlError:
            pass
        return _fail("mount", str(e))
    if isinstance(view, str):
        print(f"{result['model']}@{result['version']} mounted read-only at {target}, from the "
              "store (complete)")
    else:
        print(f"{result['model']}@{result['version']} mounted read-only at {target}; pieces "
              "not here yet are fetched first when read (wagent status shows progress)")
    return 0


def _is_view(root: str) -> bool:
    """A bind of a store's view (``agent.store.views``): ``.../views/MODEL@VERSION`` within its
    filesystem, as mountinfo gives a bind's root."""
    parent, _, name = root.rpartition("/")
    return parent.rpartition("/")[2] == VIEWS and "@" in name


def _dir_problem(target: str) -> str | None:
    if not os.path.isdir(target):
        what = "is not a directory" if os.path.lexists(target) else "does not exist"
        return f"{target} {what}: give an empty directory"
    if mount_at(target) is not None:
        return f"{target} is a mount point already (wagent umount {target}, or another DIR)"
    if os.listdir(target):
        return f"{target} is not empty: a mount would hide what it holds; give an empty one"
    return None


def _ensure_served(root: str, socket: str, serving: bool) -> None:
    """The daemon's root mount, mounted and served: made now when the daemon serves none."""
    info = mount_at(root)
    if serving and info is not None and info.fstype == FSTYPE:
        return
    if serving:
        raise ControlError(f"the daemon serves a mount, but not at {root}; restart it "
                           "(systemctl restart wagent) and mount again")
    if info is not None:
        unmount(root, lazy=True)            # a root whose server is gone (a restart): dead
    os.makedirs(root, mode=0o755, exist_ok=True)
    fd = open_fuse_device()
    try:
        mount_fuse(fd, root, "wagent")
        try:
            call(socket, "serve_fuse", fds=[fd])
        except BaseException:
            # Nobody will answer it: the kernel's INIT waits for ever, and so would a reader.
            unmount(root, lazy=True)
            raise
    finally:
        os.close(fd)
    # The kernel sets the read-ahead when the server answers INIT: set before, it would be
    # undone (seen: 128 KiB reads one time in two). A stat waits for that answer.
    os.stat(root)
    info = mount_at(root)
    if info is not None:
        try:
            set_read_ahead(info, READ_AHEAD_KB)
        except MountError as e:   # slower reads, not a broken mount
            print(f"wagent mount: warning: {e}", file=sys.stderr)


def run_umount(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        return _fail("umount", "run it as root: it unmounts")
    target = os.path.abspath(args.dir)
    info = mount_at(target)
    if info is None or not (info.fstype == FSTYPE or _is_view(info.root)):
        return _fail("umount", f"{target} is not a `wagent mount`")
    try:
        unmount(target, lazy=args.lazy)
    except MountError as e:
        return _fail("umount", f"{e}; stop its readers, or use --lazy")
    left: Any = None
    try:
        left = call(args.socket, "umount", {"dir": target}).get("left")
    except NotRunning:
        pass            # nothing serves it: the bind is gone, which is all there was to do
    except ControlError as e:
        print(f"wagent umount: warning: the daemon: {e}", file=sys.stderr)
    root = mount_root(args.socket)
    if left == 0 and mount_at(root) is not None:
        try:
            unmount(root, lazy=True)
        except MountError as e:
            print(f"wagent umount: warning: {e}", file=sys.stderr)
    print(f"unmounted {target}")
    return 0
