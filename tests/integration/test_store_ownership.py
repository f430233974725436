"""Who can stall or change the store (issue 21, items 5 and 6), shown with a real other user.

5. flock works on a read-only descriptor: whoever can open a lock can hold it. The store's
   readers (nginx, inference servers in the wagent group) could stall every pull by holding
   ``.lock``, ``.usage.lock`` or a partial file's claim. Now the locks are 0600 and partial/ is
   0700: nobody can't open them, an older wagent's store included once ``ensure`` ran.
6. A store root another user owns (or under a directory they own) let them swap blobs/ for
   zeros that ``current`` then served. Now a pull, ``store gc``/``pin`` and the daemon's start
   refuse it, naming the directory and the fix, before writing anything.

nobody (65534) is the other user; every process it runs is ended and every directory removed,
even on failure.
"""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.store import Store, partial
from agent.store.partial import Partial
from tests.daemon_helpers import wagent, write_policy
from tests.pull_helpers import LoopbackNginx, publish_dir

pytestmark = [pytest.mark.debian,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as nobody")]

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# Open read-only (all a reader needs) and take the lock without waiting: flock, as on the store's
# locks, or a read lock on one byte of partial/.claims (an OFD lock, as a pull's claim of the
# file that byte stands for). Held until stdin closes.
_HOLD = r"""
import fcntl, os, struct, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    if sys.argv[2] == "flock":
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    else:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                    struct.pack("@hhqqi", fcntl.F_RDLCK, 0, int(sys.argv[2]), 1, 0))
except OSError as e:
    print("denied", e.strerror, flush=True)
    sys.exit(0)
print("held", flush=True)
sys.stdin.read()
"""
NAME = "ab" * 32          # a partial file's name (a blob id)


@contextmanager
def nobody_holds(path: Path, how: str) -> Iterator[str]:
    """nobody's attempt to hold the lock at ``path``: yields "held" or "denied ..."."""
    proc = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", _HOLD, str(path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_NOBODY, *cmd], capture_output=True, timeout=60)


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 directory nobody can reach (pytest's tmp_path is under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="wagent-own-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sticky(base: Path) -> Path:
    """A /tmp-like directory: root's, 1777."""
    d = base / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


def made_store(base: Path) -> tuple[Store, dict[str, tuple[Path, str]]]:
    """A store with its two locks and a partial file (and the claims file a running pull has):
    name -> (path, how nobody would lock it)."""
    store = Store(base / "store")
    with store.exclusive():
        store.touch("m", "v1", 1.0)
    Partial(store.partial, NAME, 1000, durable=False).close()
    os.close(os.open(store.partial / partial.CLAIMS, os.O_RDWR | os.O_CREAT, partial.MODE))
    return store, {".lock": (store.root / ".lock", "flock"),
                   ".usage.lock": (store.root / ".usage.lock", "flock"),
                   "a claim": (store.partial / partial.CLAIMS, str(partial._offset(NAME))),
                   "a journal": (store.partial / f"{NAME}.journal", "flock")}


def assert_nobody_holds_nothing(locks: dict[str, tuple[Path, str]]) -> None:
    for name, (path, how) in locks.items():
        with nobody_holds(path, how) as got:
            assert got.startswith("denied"), f"nobody could hold {name}: {got}"


def test_nobody_can_hold_none_of_the_stores_locks(base):
    store, locks = made_store(base)
    assert_nobody_holds_nothing(locks)
    # and the store's writers go on: gc has the store, a pin records, the partial is claimed
    with store.exclusive() as alone:
        assert alone
    assert wagent("store", "pin", "m", "v1", "--store", str(store.root),
                  timeout=20).returncode == 0
    Partial(store.partial, NAME, 1000, durable=False).close()


def test_an_older_wagents_store_is_closed_by_ensure(base):
    """The modes a store had before: partial/ 0755, locks and journals 0644. Control: nobody
    can hold them then, and a pull of that file is "already fetching" while it does; after
    ensure (any pull, gc, pin or the daemon's start) nobody can't even open them."""
    store, locks = made_store(base)
    store.partial.chmod(0o755)
    for path, _ in locks.values():
        path.chmod(0o644)
    for name, (path, how) in locks.items():
        with nobody_holds(path, how) as got:
            assert got == "held", f"{name}: {got}"        # what issue 21 item 5 reported
            if name == "a claim":
                with pytest.raises(partial.PartialBusy, match="already fetching"):
                    Partial(store.partial, NAME, 1000, durable=False)
            if name == ".lock":                           # `store gc`: "a pull holds the store"
                fd = os.open(path, os.O_RDWR)
                try:
                    with pytest.raises(BlockingIOError):
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                finally:
                    os.close(fd)
    Store(store.root).ensure()
    assert_nobody_holds_nothing(locks)


@pytest.fixture
def origin(base: Path) -> Iterator[str]:
    root = base / "origin"
    d = root / "m" / "v1"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(os.urandom(70_000))
    publish_dir(d, piece_size=16384)
    with LoopbackNginx(root) as ng:
        yield ng.url


def test_readers_still_read_versions_and_list_the_store(base, origin):
    """nginx and inference servers need blobs/ and models/ only: a 0700 partial/ costs them
    nothing, and `wagent store ls` as a reader still answers."""
    store = base / "store"
    r = wagent("pull", f"{origin}/m/v1", "--store", str(store), "--current", "--quiet")
    assert r.returncode == 0, r.stderr
    got = as_nobody("cat", str(store / "models" / "m" / "current" / "weights.bin"))
    assert got.returncode == 0, got.stderr
    assert got.stdout == (base / "origin" / "m" / "v1" / "weights.bin").read_bytes()
    ls = as_nobody(sys.executable, "-m", "agent", "store", "ls", "--store", str(store))
    assert ls.returncode == 0 and b"v1" in ls.stdout, ls.stderr


def test_a_pull_refuses_a_store_another_user_owns(sticky, origin):
    """Issue 21 item 6: nobody makes the store in a 1777 directory; root's pull with --current
    would have succeeded, and nobody could then swap blobs/ for zeros."""
    mine = sticky / "mine"                   # control: the same pull into root's own store
    r = wagent("pull", f"{origin}/m/v1", "--store", str(mine), "--current", "--quiet")
    assert r.returncode == 0, r.stderr
    theirs = sticky / "theirs"
    assert as_nobody("mkdir", str(theirs)).returncode == 0
    r = wagent("pull", f"{origin}/m/v1", "--store", str(theirs), "--current", "--quiet")
    assert r.returncode == 1
    assert f"{theirs} is owned by uid 65534" in r.stderr and f"chown root {theirs}" in r.stderr
    assert list(theirs.iterdir()) == []      # refused before anything was written
    for cmd in (["store", "gc"], ["store", "pin", "m", "v1"]):
        r = wagent(*cmd, "--store", str(theirs))
        assert r.returncode == 1 and f"{theirs} is owned by uid 65534" in r.stderr, r.stderr
    assert list(theirs.iterdir()) == []


def test_a_pull_refuses_a_store_under_another_users_directory(sticky, origin):
    above = sticky / "x"
    assert as_nobody("mkdir", str(above)).returncode == 0
    r = wagent("pull", f"{origin}/m/v1", "--store", str(above / "store"), "--quiet")
    assert r.returncode == 1 and f"{above} is owned by uid 65534" in r.stderr, r.stderr
    assert list(above.iterdir()) == []       # the store wasn't even made


def test_a_pull_refuses_a_blobs_directory_another_user_made(base, origin):
    """The root was handed back (chown root) but blobs/ is still nobody's: they can swap it."""
    store = base / "store"
    r = wagent("pull", f"{origin}/m/v1", "--store", str(store), "--quiet")
    assert r.returncode == 0, r.stderr
    os.chown(store / "blobs", NOBODY, NOBODY)
    r = wagent("pull", f"{origin}/m/v1", "--store", str(store), "--quiet")
    assert r.returncode == 1, r.stderr
    assert f"{store / 'blobs'} is owned by uid 65534" in r.stderr
    assert f"chown -R root {store / 'blobs'}" in r.stderr


@pytest.mark.parametrize("where", ["store", "above-store", "state_dir"])
def test_the_daemon_refuses_to_start_with_a_directory_another_user_owns(base, sticky, where):
    """`wagent run` exits 1 naming the directory; the store (or state) is left as it was."""
    theirs = sticky / "theirs"
    assert as_nobody("mkdir", str(theirs)).returncode == 0
    store = {"store": theirs, "above-store": theirs / "store"}.get(where, base / "store")
    state = theirs if where == "state_dir" else base / "state"
    policy = write_policy(base / "policy.yaml", base, store={"path": str(store)},
                          state_dir=str(state))
    res = wagent("run", "--policy", str(policy), timeout=30)
    assert res.returncode == 1, res.stderr
    assert f"{theirs} is owned by uid 65534" in res.stderr, res.stderr
    assert "not safe" in res.stderr and "fix: chown root" in res.stderr
    assert list(theirs.iterdir()) == []
    assert not (base / "control.sock").exists()          # the socket went with the refusal
