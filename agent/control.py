"""The control socket: JSON lines over a Unix stream socket, one request per connection.

Protocol (documented in docs/status.md)::

    client -> {"cmd": "status"}\\n
    daemon -> {"ok": true, "result": {...}}\\n
           or {"ok": false, "error": "...", "kind": "forbidden"}\\n

Commands: ``ping`` and ``status`` read; ``reload``, ``pause`` and ``resume`` change something and
are served only to root or to the daemon's own user, checked with SO_PEERCRED (the kernel's word,
not the client's). ``mount``, ``umount`` and ``serve_fuse`` (``wagent mount``, which mounts as
root) are root's alone; ``serve_fuse`` carries the mount's /dev/fuse descriptor (SCM_RIGHTS), the
only request that may: descriptors sent with any other are closed unread. The socket is mode
0660, group ``wagent`` when that group exists, so other users can't even connect; the
SO_PEERCRED check still holds when an operator widens the mode.

A slow or malicious client can't stall the daemon: each connection is served in its own thread
with a read deadline and a size limit, at most ``max_clients`` at a time (more are told "busy")
plus two kept for root and the service's user, and the daemon's control methods are called from
that thread, never from the daemon's main loop.
The server knows nothing of the daemon: it calls methods on any object with ``status()``,
``reload()``, ``pause()`` and ``resume()`` (the daemon doesn't know its transport).

Both ends also check who could have put the socket there. Whoever can create names in the
socket's directory can replace the socket with one of their own and answer root's ``reload`` or
``pause`` with a success the daemon never heard. So the daemon refuses to start, and a client
refuses to talk, unless that directory and each one above it is owned by a trusted user
(:func:`trusted_uids`: root, this process's user, the service's user ``wagent``) and writable
by nobody else (:func:`socket_dir_problem`). A client also asks the kernel who serves the socket
(SO_PEERCRED on its own end gives the server's uid) and refuses an answer from anyone else
before it sends the request.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.ownership import SERVICE_USER, ancestry, dir_problem, trusted_uids
from agent.ownership import describe_user as _user

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
RESERVED_PERMITS = 2         # connections beyond max_clients, for root and the service's user only
MAX_RESPONSE = 16 * 2**20
# No request needs a long number. Refused before int() sees it: Python's own limit (4300
# digits) raises a ValueError whose advice (sys.set_int_max_str_digits) is not the client's.
MAX_DIGITS = 100
MAX_LOGGED_ERROR = 200     # a refused request's error, as logged (it may quote the request)
# command -> changes something (needs root or the service's user)
COMMANDS = {"ping": False, "status": False, "reload": True, "pause": True, "resume": True,
            "mount": True, "umount": True, "serve_fuse": True}
# ...and these root alone: they come from `wagent mount`, which mounts as root; the service's
# own user can't mount, so a request from it is not the CLI's
ROOT_ONLY = frozenset({"mount", "umount", "serve_fuse"})
# commands that take their arguments (the others take none); serve_fuse also takes descriptors
WITH_ARGS = frozenset({"mount", "umount"})
MAX_FDS = 2                  # descriptors accepted with a request (SCM_RIGHTS); more are closed
# /run/wagent is the RuntimeDirectory of wagent.service (its User= is ownership.SERVICE_USER)
DEFAULT_SOCKET = "/run/wagent/control.sock"


class ControlError(Exception):
    """The daemon answered with an error, or the answer couldn't be read."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class NotRunning(ControlError):
    """Nothing listens on the control socket."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "not_running")


class ProtocolError(ValueError):
    """A request that isn't one JSON object with a known ``cmd``."""


class Controls(Protocol):
    def status(self) -> dict[str, Any]: ...
    def reload(self) -> dict[str, Any]: ...
    def pause(self) -> dict[str, Any]: ...
    def resume(self) -> dict[str, Any]: ...
    def mount(self, args: dict[str, Any]) -> dict[str, Any]: ...
    def umount(self, args: dict[str, Any]) -> dict[str, Any]: ...
    def serve_fuse(self, fds: list[int]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ControlRequest:
    cmd: str
    args: dict[str, Any]
    fds: tuple[int, ...] = ()       # descriptors that came with it (owned: closed or handed on)


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise ProtocolError(f"request has a number {len(digits.lstrip('-'))} digits long; "
                            f"at most {MAX_DIGITS}")
    return int(digits)


def parse_request(line: bytes) -> ControlRequest:
    """Raises ProtocolError for whatever the JSON decoder refuses, deep nesting (a
    RecursionError) and long numbers included: each is the client's mistake, answered."""
    try:
        obj = json.loads(line.decode("utf-8"), parse_int=_int)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"request is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("request is nested too deeply to decode") from None
    except ValueError as e:
        raise ProtocolError(f"request can't be decoded: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("cmd"), str):
        raise ProtocolError('request must be an object like {"cmd": "status"}')
    if obj["cmd"] not in COMMANDS:
        raise ProtocolError(f"unknown command {obj['cmd']!r}; known: {', '.join(COMMANDS)}")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError('"args" must be an object')
    return ControlRequest(obj["cmd"], args)


def authorized(cmd: str, peer_uid: int, allowed_uids: Iterable[int]) -> bool:
    """Reads for anyone who can connect; changes for root and the service's own user; mounts
    for root."""
    if cmd in ROOT_ONLY:
        return peer_uid == 0
    return not COMMANDS.get(cmd, True) or peer_uid == 0 or peer_uid in set(allowed_uids)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def error_reply(message: str, kind: str) -> dict[str, Any]:
    return {"ok": False, "error": message, "kind": kind}


def dispatch(controls: Controls, request: ControlRequest, peer: Peer,
             allowed_uids: Iterable[int]) -> dict[str, Any]:
    fds = list(request.fds)
    try:
        if not authorized(request.cmd, peer.uid, allowed_uids):
            who = "not root" if request.cmd in ROOT_ONLY else \
                "neither root nor the service's user"
            return error_reply(f"{request.cmd} refused: uid {peer.uid} is {who}", "forbidden")
        if request.cmd == "ping":
            return {"ok": True, "result": {"pong": True}}
        if request.cmd == "serve_fuse":
            fds, given = [], fds                  # the control method owns them now
            return _call(lambda: controls.serve_fuse(given), request.cmd)
        if request.cmd in WITH_ARGS:
            return _call(lambda: getattr(controls, request.cmd)(request.args), request.cmd)
        return _call(getattr(controls, request.cmd), request.cmd)
    finally:
        for fd in fds:
            os.close(fd)


def _call(method: Callable[[], dict[str, Any]], cmd: str) -> dict[str, Any]:
    try:
        result = method()
    except ControlError as e:
        return error_reply(str(e), e.kind)
    except Exception as e:  # the daemon must answer, whatever went wrong in the command
        log.exception("control command %s failed", cmd)
        return error_reply(f"{cmd} failed: {e}", "internal")
    return {"ok": True, "result": result}


def socket_dir_problem(path: str, trusted: Iterable[int] | None = None) -> str | None:
    """Why the directory of the socket ``path`` lets someone untrusted replace the socket, or
    None when it doesn't. Raises OSError (FileNotFoundError, PermissionError, ...) when a
    directory can't be looked at.

    The rules of :mod:`agent.ownership`: every directory from ``/`` down to the socket's owned
    by a trusted uid, and the socket's own directory not group- or other-writable: a sticky bit
    doesn't help there, since others may still create names in it (a socket while the daemon
    is down, the lock file). A directory above may be world-writable if it is sticky
    (``/tmp``). systemd's RuntimeDirectory=wagent (``/run/wagent``, owned by ``wagent``, mode
    0750) passes, as does a root-owned 0700 or 0755 directory anywhere. Both the path as
    written and the path resolved are checked (``/var/run`` -> ``/run`` passes)."""
    return dir_problem(os.path.dirname(os.path.abspath(path)),
                       trusted_uids() if trusted is None else trusted,
                       risk="replace the control socket and answer for the daemon",
                       also=f", or put the socket in a directory only root or {SERVICE_USER} "
                            f"can write, like the default {DEFAULT_SOCKET}")


def peer_credentials(conn: socket.socket) -> Peer:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


class ControlServer:
    """Serves one set of control methods on a Unix socket until :meth:`stop`."""

    def __init__(self, path: str, controls: Controls, *, group: str | None = "wagent",
                 allowed_uids: Iterable[int] = (), read_timeout: float = 5.0,
                 max_clients: int = 8) -> None:
        self.path = path
        self.controls = controls
        self.group = group
        self.allowed_uids = frozenset(allowed_uids) | {os.getuid()}
        # who may own the socket's directories (the clients trust the same users to serve it)
        self.trusted = trusted_uids()
        self.read_timeout = read_timeout
        self._permits = threading.BoundedSemaphore(max_clients)
        # Kept for root and the service's user: a reader in the socket's group holding every
        # ordinary permit open must not turn away `systemctl reload` (ExecReload=wagent reload).
        self._reserve = threading.BoundedSemaphore(RESERVED_PERMITS)
        self._sock: socket.socket | None = None
        self._lock: int | None = None
        self._inode: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._serving = 0
        self._serving_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def bind(self) -> None:
        """Takes the socket's lock, then binds without listening; raises ControlError when
        another daemon holds it. Call it before changing anything else: it is what keeps a
        second ``wagent run`` from applying shaping or pulling beside a live daemon. Until
        :meth:`start`, clients are refused and ``wagent status`` says "not running"."""
        if self._sock is not None:
            return
        prepare_socket_dir(self.path, self.trusted)
        self._lock = _take_lock(self.path)
        try:
            self._sock = _bind(self.path, self.group)
        except BaseException:
            os.close(self._lock)
            self._lock = None
            raise
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)

    def start(self) -> None:
        """Binds (if :meth:`bind` wasn't called) and serves."""
        self.bind()
        assert self._sock is not None
        self._sock.listen(16)
        self._sock.settimeout(0.5)  # the accept loop checks for stop twice a second
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            # a connection of our own wakes the blocked accept() at once
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.2)
                s.connect(self.path)
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:   # never another daemon's socket
                    os.unlink(self.path)
        if self._lock is not None:
            os.close(self._lock)       # the lock file stays: unlinking it would race a starter
            self._lock = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def connections(self) -> int:
        """Connections being served now, each holding a permit (counted once its permit is taken,
        until it is given back): how full the server is, for whoever watches it."""
        with self._serving_lock:
            return self._serving

    # -- serving -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("control socket accept failed: %s", e)
                time.sleep(0.1)
                continue
            if self._stop.is_set():
                conn.close()
                return
            try:
                peer = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            permit = self.permit_for(peer)
            if permit is None:
                self._refuse_busy(conn)
                continue
            with self._serving_lock:
                self._serving += 1
            threading.Thread(target=self._serve, args=(conn, peer, permit), name="control-conn",
                             daemon=True).start()

    def permit_for(self, peer: Peer) -> threading.BoundedSemaphore | None:
        if self._permits.acquire(blocking=False):
            return self._permits
        privileged = peer.uid == 0 or peer.uid in self.allowed_uids
        if privileged and self._reserve.acquire(blocking=False):
            return self._reserve
        return None

    def _refuse_busy(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(0.2)
            conn.sendall(encode(error_reply("daemon busy: too many control connections",
                                            "busy")))

    def _serve(self, conn: socket.socket, peer: Peer, permit: threading.BoundedSemaphore) -> None:
        try:
            with conn:
                try:
                    reply = self._answer(conn, peer)
                    data = None if reply is None else encode(reply)
                except Exception as e:   # a bug: still an answer, and one log record for it
                    log.exception("control: serving uid %d pid %d failed", peer.uid, peer.pid)
                    data = encode(error_reply(f"internal error: {type(e).__name__}: {e}",
                                              "internal"))
                if data is None:
                    return
                conn.settimeout(self.read_timeout)
                with contextlib.suppress(OSError):
                    conn.sendall(data)
        finally:
            permit.release()
            with self._serving_lock:
                self._serving -= 1

    def _answer(self, conn: socket.socket, peer: Peer) -> dict[str, Any] | None:
        """The reply to the connection's request; None when the client is gone or too slow."""
        fds: list[int] = []
        try:
            line = _read_line(conn, self.read_timeout, MAX_REQUEST, fds=fds)
            request = parse_request(line)
            request = ControlRequest(request.cmd, request.args, tuple(fds))
            fds = []                              # dispatch owns them now
        except ProtocolError as e:
            log.info("control: refused a request from uid %d pid %d: %s", peer.uid, peer.pid,
                     str(e)[:MAX_LOGGED_ERROR])
            return error_reply(str(e), "protocol")
        except (TimeoutError, OSError) as e:
            log.info("control client pid %d dropped: %s", peer.pid, e)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        reply = dispatch(self.controls, request, peer, self.allowed_uids)
        if request.cmd != "status":
            log.info("control: %s from uid %d pid %d: %s", request.cmd, peer.uid, peer.pid,
                     "ok" if reply["ok"] else reply["error"])
        return reply


def _read_line(conn: socket.socket, timeout: float, limit: int,
               clock: Callable[[], float] = time.monotonic, fds: list[int] | None = None
               ) -> bytes:
    """One line, within ``timeout`` seconds in total (not per recv: a client dribbling a byte a
    second is cut off too) and ``limit`` bytes. Descriptors passed with it (SCM_RIGHTS) are
    appended to ``fds`` (the caller closes them), at most ``MAX_FDS``: the kernel closes what
    doesn't fit the buffer."""
    deadline = clock() + timeout
    buf = bytearray()
    while b"\n" not in buf:
        left = deadline - clock()
        if left <= 0:
            raise TimeoutError("no complete request in time")
        conn.settimeout(left)
        chunk, got, _, _ = socket.recv_fds(conn, 4096, MAX_FDS)
        if fds is not None:
            fds.extend(got)
        else:
            for fd in got:
                os.close(fd)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ProtocolError(f"request larger than {limit} bytes")
    line = bytes(buf).split(b"\n", 1)[0]
    if not line.strip():
        raise ProtocolError("empty request")
    return line


def prepare_socket_dir(path: str, trusted: Iterable[int]) -> None:
    """Creates the socket's missing directories (mode 0755, whatever the umask or Python's
    default for parents), then refuses, naming the directory, unless only trusted users can
    put a socket there: checked before the lock file or the socket is created in it. Public so
    that a reload moving the socket can check the new path before it stops the old server."""
    for d in ancestry(os.path.dirname(os.path.abspath(path))):
        if not os.path.isdir(d):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o755)
    try:
        problem = socket_dir_problem(path, trusted)
    except OSError as e:
        raise ControlError(f"can't check the control socket's directory for {path}: {e}",
                           "setup") from None
    if problem is not None:
        raise ControlError(f"the control socket {path} is not safe: {problem}", "unsafe")


def _take_lock(path: str) -> int:
    """An flock on ``{path}.lock``, held while the daemon runs. Connecting to the socket alone
    can't tell a live daemon from a stale file reliably (a daemon between bind and listen
    refuses connections, so two starters could each unlink the other's socket); the lock can."""
    lock = f"{path}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ControlError(f"can't open the control lock {lock}: {e.strerror}", "setup") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ControlError(f"another wagent daemon (pid {holder}) is running with the control "
                           f"socket {path}; stop it first (systemctl stop wagent), or give this "
                           "one another control.socket", "setup") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _bind(path: str, group: str | None) -> socket.socket:
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ControlError(f"{path} exists and is not a socket; remove it or set "
                               "control.socket in the policy", "setup")
        if _answers(path):
            raise ControlError(f"another wagent daemon is already listening on {path}", "setup")
        p.unlink()  # stale, left by a daemon that was killed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Created with the umask's mode first, which never grants others write (connect) access;
    # then narrowed/widened to exactly 0660.
    sock.bind(path)
    os.chmod(path, 0o660)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            log.info("group %r does not exist; control socket %s stays in group %d", group,
                     path, os.getgid())
        except PermissionError as e:
            log.warning("can't give %s to group %s: %s", path, group, e)
    return sock


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
        return True


# -- client ------------------------------------------------------------------------------------
def call(path: str, cmd: str, args: dict[str, Any] | None = None,
         timeout: float = 10.0, fds: Iterable[int] = ()) -> dict[str, Any]:
    """Sends one request and returns the daemon's ``result``; raises NotRunning or
    ControlError (with the daemon's words) otherwise. Refuses (kind ``unsafe``) a socket in a
    directory others can write, and (kind ``untrusted``) a socket served by anyone but root,
    this user or the service's user, before sending anything: either could be a socket put
    there by someone else, answering success for a daemon that never heard the request."""
    trusted = trusted_uids()
    try:
        problem = socket_dir_problem(path, trusted)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise NotRunning(f"{path}: {e.strerror}") from None   # /run/wagent goes with the service
    except PermissionError:
        raise _permission_denied(path) from None
    if problem is not None:
        raise ControlError(f"not trusting the control socket {path}: {problem}", "unsafe")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise NotRunning(f"{path}: {e.strerror}") from None
        except PermissionError:
            raise _permission_denied(path) from None
        except OSError as e:
            if e.errno in (errno.ENOTSOCK, errno.ENOTDIR):
                raise NotRunning(f"{path}: {e.strerror}") from None
            raise
        # The kernel's word on who listens (the server's credentials as of its listen()),
        # checked before the request goes out: an impostor learns nothing and can't claim a
        # reload or pause happened.
        peer = peer_credentials(s)
        if peer.uid not in trusted:
            raise ControlError(
                f"not trusting the control socket {path}: it is served by {_user(peer.uid)} "
                f"(pid {peer.pid}), neither root nor the service's user ({SERVICE_USER}), so "
                "it is not the daemon's; nothing was sent. Find who replaced it (ss -xlp) and "
                "restart the daemon (systemctl restart wagent)", "untrusted")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # a busy daemon answers and closes before reading; its answer is still there
            data = encode({"cmd": cmd, "args": args or {}})
            fds = list(fds)
            if fds:
                # the descriptors ride on the first bytes; the rest follows as usual
                sent = socket.send_fds(s, [data], fds)
                data = data[sent:]
            if data:
                s.sendall(data)
        try:
            line = _read_reply(s)
        except TimeoutError:
            raise ControlError(f"the daemon didn't answer {cmd!r} within {timeout:g} s",
                               "timeout") from None
    if not line:
        raise ControlError(f"the daemon closed the connection without answering {cmd!r}",
                           "protocol")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as e:
        raise ControlError(f"unreadable answer from the daemon: {e}", "protocol") from None
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "unknown error"), reply.get("kind", "error"))
    return reply.get("result", {})


def _permission_denied(path: str) -> ControlError:
    return ControlError(f"permission denied on {path}; run as root or as a member of the "
                        f"socket's group ({SERVICE_USER})", "forbidden")


def _read_reply(s: socket.socket) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_RESPONSE:
            raise ControlError("answer from the daemon too large", "protocol")
    return bytes(buf).split(b"\n", 1)[0]
