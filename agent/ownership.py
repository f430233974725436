"""Who may own the directories wagent trusts: the control socket's, the store's, the state's.

Whoever can create or rename names in a directory on a path can put their own file (a socket
answering for the daemon, a blob of zeros under a verified name) where wagent expects its own.
So a path wagent writes through is trusted only when every directory from ``/`` down to it is
owned by a trusted user (:func:`trusted_uids`: root, this process's user, the service's user
``wagent``) and writable by nobody else. The rules, checked by :func:`chain_problem`:

1. Every directory on the path, and every symlink on it, is owned by a trusted uid (a symlink's
   owner can point it elsewhere whenever they like).
2. A symlink's own mode means nothing: its target is checked on the path resolved.
3. A directory above the target may be writable by its group or by all users if it is sticky
   (``/tmp``): the sticky bit keeps others from renaming or removing a trusted user's entry.
4. The target itself is writable by no one but its owner, sticky or not: others could still
   create names in it.

The path as written and the path resolved are both checked (:func:`dir_problem`). Inside a
trusted directory, what wagent keeps there (the store's ``blobs/``, ``models/``...) must be its
owner's or root's, and writable by no one else (:func:`inner_problem`).

>>> from types import SimpleNamespace as St
>>> chain_problem([("/", St(st_uid=0, st_mode=0o40755)), ("/tmp", St(st_uid=0, st_mode=0o41777)),
...                ("/tmp/s", St(st_uid=0, st_mode=0o40755))], {0}, complete=True,
...               risk="swap its files") is None
True
>>> chain_problem([("/", St(st_uid=0, st_mode=0o40755)), ("/tmp", St(st_uid=0, st_mode=0o41777)),
...                ("/tmp/s", St(st_uid=0, st_mode=0o41777))], {0}, complete=True,
...               risk="swap its files")[:40]
'/tmp/s is writable by its group and all '
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

# wagent.service's User= (packaging/deb/wagent.sysusers)
SERVICE_USER = "wagent"


class StatLike(Protocol):
    @property
    def st_uid(self) -> int: ...
    @property
    def st_mode(self) -> int: ...


def trusted_uids() -> frozenset[int]:
    """The users who may own the directories wagent trusts and serve its control socket: root,
    this process's own user (the daemon's user; for a client, a daemon the same user started by
    hand) and the service's user when the package created it (the daemon runs as ``wagent``
    while root or a ``wagent`` group member runs the client or a pull by hand)."""
    uids = {0, os.geteuid()}
    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    return frozenset(uids)


def describe_user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def user_name(uid: int) -> str:
    """The name for a chown command line (the number when the user has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def ancestry(directory: str) -> list[str]:
    """``/``, ``/a``, ``/a/b`` for ``/a/b``."""
    parts = Path(directory).parts
    return [os.path.join(*parts[:i + 1]) for i in range(len(parts))]


def _writers(mode: int) -> str:
    return " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "all users")) if mode & bit)


def chain_problem(chain: Sequence[tuple[str, StatLike]], trusted: Iterable[int], *,
                  complete: bool, risk: str, also: str = "") -> str | None:
    """Why someone untrusted could change the path ``chain`` walks (``(path, stat)`` from ``/``
    down), or None. ``complete``: the last entry is the target itself (rule 4), not an ancestor
    of a target still to be made. ``risk`` says what they could then do ("replace the control
    socket and answer for the daemon"); ``also`` ends each fix (", or ...")."""
    ok = frozenset(trusted)
    for i, (d, st) in enumerate(chain):
        mode = st.st_mode
        if st.st_uid not in ok:
            return (f"{d} is owned by {describe_user(st.st_uid)}, not by root or the service's "
                    f"user ({SERVICE_USER}): that user can {risk}; fix: "
                    f"chown{' -h' * stat.S_ISLNK(mode)} root {d}{also}")
        if stat.S_ISLNK(mode) or not mode & 0o022:
            continue
        target = complete and i == len(chain) - 1
        if not target and mode & stat.S_ISVTX:
            continue
        sticky = " (sticky, but others can still create names in it)" \
            if mode & stat.S_ISVTX else ""
        return (f"{d} is writable by {_writers(mode)}, mode {stat.S_IMODE(mode):04o}{sticky}: "
                f"they can {risk}; fix: chmod go-w {d}{also}")
    return None


def dir_problem(directory: str, trusted: Iterable[int], *, risk: str, also: str = "",
                missing_ok: bool = False) -> str | None:
    """:func:`chain_problem` of ``directory`` as written (symlinks not followed: each must be a
    trusted user's) and as resolved (where it really is). ``missing_ok``: a directory not made
    yet is no problem if what exists above it is safe (check again once it is made). Raises
    OSError (FileNotFoundError unless ``missing_ok``, PermissionError, ...) when a directory
    can't be looked at."""
    directory = os.path.abspath(directory)
    for path, look in ((directory, os.lstat), (os.path.realpath(directory), os.stat)):
        chain: list[tuple[str, os.stat_result]] = []
        complete = True
        for d in ancestry(path):
            try:
                chain.append((d, look(d)))
            except FileNotFoundError:
                if not missing_ok:
                    raise
                complete = False
                break
        problem = chain_problem(chain, trusted, complete=complete, risk=risk, also=also)
        if problem is not None:
            return problem
    return None


def inner_problem(path: str, st: StatLike, owner: int, *, risk: str) -> str | None:
    """Why ``path``, kept inside a trusted directory that ``owner`` owns, lets someone else
    ``risk``, or None: it must be the owner's (or root's, who is trusted anyway) and, unless a
    symlink, writable by no one else."""
    mode = st.st_mode
    if st.st_uid not in (owner, 0):
        return (f"{path} is owned by {describe_user(st.st_uid)}, not by {describe_user(owner)} "
                f"who owns the directory it is in: that user can {risk}; fix: "
                f"chown -R{'h' * stat.S_ISLNK(mode)} {user_name(owner)} {path}, or remove it")
    if not stat.S_ISLNK(mode) and mode & 0o022:
        return (f"{path} is writable by {_writers(mode)}, mode {stat.S_IMODE(mode):04o}: they "
                f"can {risk}; fix: chmod go-w {path}")
    return None


def make_missing(directory: str, mode: int, parents_mode: int = 0o755) -> list[str]:
    """Make the missing directories of ``directory`` one by one, ``directory`` itself with
    ``mode`` and those above it with ``parents_mode``, whatever the umask; returns those made
    (the caller makes their names durable if it cares)."""
    made = []
    chain = ancestry(os.path.abspath(directory))
    for i, d in enumerate(chain):
        if os.path.isdir(d):
            continue
        m = mode if i == len(chain) - 1 else parents_mode
        try:
            os.mkdir(d, m)
        except FileExistsError:
            continue          # made meanwhile (or a file: the caller's check says so)
        os.chmod(d, m)
        made.append(d)
    return made


LOCK_MODE = 0o600


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file ``path``, created 0600 (and made so if an older wagent
    left it 0644): flock and OFD read locks work on a read-only descriptor, so anyone who could
    open it could hold the lock. Root makes it the directory owner's, who must open it too (the
    daemon as ``wagent``, after a root `wagent pull` or a crash of one left the file behind)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_MODE)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != LOCK_MODE:
            os.fchmod(fd, LOCK_MODE)
        if os.geteuid() == 0:
            owner = os.stat(path.parent).st_uid
            if st.st_uid != owner:
                os.fchown(fd, owner, -1)
    except BaseException:
        os.close(fd)
        raise
    return fd
