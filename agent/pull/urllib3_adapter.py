"""Everything wagent asks of urllib3 beyond its public API, in one place (1.26 and 2.x alike).

The pulls need three things urllib3 doesn't offer publicly, and each is done here:

1. the connection a pool hands a request, before any header arrives (so that the deadline
   watchdog can shut its socket down): ``HTTPConnectionPool._get_conn``, overridden, and the
   pool classes given to requests' pool managers through ``pool_classes_by_scheme``;
2. each connection's socket once connected, after TLS (so that the pull sockets' registry can
   clamp its receive window): ``HTTPConnection.connect`` and ``.sock``; and every 1xx response
   skipped before the final one: http.client's ``HTTPResponse._read_status``, through the
   connection's ``response_class``;
3. the body read straight into a buffer, the connection handed back clean, a blocked read
   broken from another thread: the urllib3 response's ``_fp`` (http.client's response: its
   ``readinto``, ``isclosed``, ``fp.raw._sock``), ``_connection`` (its ``sock``) and
   ``release_conn``.

``tests/unit/test_urllib3_adapter.py`` checks each of these members on the installed urllib3 and
fails naming the member and the version when a release changes one. What a request's failure
means (``describe``) is read from urllib3's and requests' exception classes here too, since
their shapes differ between urllib3 1.26 and 2.x. The only other module that imports requests
is ``agent.pull.client``; none other imports urllib3.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MAX_INFORMATIONAL = 16           # 1xx responses skipped before a final one, at most
MAX_HEADER_LINES = 100           # as http.client bounds a header block
MAX_LINE = 65536


# -- 1 and 2: pools and connections ----------------------------------------------------------
class FinalResponse(http.client.HTTPResponse):
    """http.client skips only a ``100 Continue`` before the final response: any other 1xx (a
    CDN's or nginx's ``103 Early Hints``) was taken for the answer, its final response left
    in the connection. Informational responses are skipped here (RFC 9110 15.2: a client
    must accept and ignore them), all but ``101``, which wagent never asks for."""

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(MAX_INFORMATIONAL):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 101 < status < 200:
                return version, status, reason     # 100: begin() skips it itself
            for _ in range(MAX_HEADER_LINES):      # its header block, up to the blank line
                line = self.fp.readline(MAX_LINE + 1)
                if line in (b"\r\n", b"\n", b""):
                    break
            else:
                raise http.client.HTTPException("an informational response with too many "
                                                "header lines")
        raise http.client.HTTPException(f"more than {MAX_INFORMATIONAL} informational "
                                        "responses before the final one")


def connection_class(base: type, connected: Callable[[socket.socket], None]) -> type:
    """A subclass of urllib3's ``HTTPConnection`` or ``HTTPSConnection`` that tells
    ``connected`` its socket once connected (after TLS, behind a proxy too) and skips
    informational responses (``FinalResponse``)."""

    class Connection(base):  # type: ignore[misc, valid-type]
        response_class = FinalResponse

        def connect(self) -> None:
            super().connect()
            sock = getattr(self, "sock", None)
            if isinstance(sock, socket.socket):
                connected(sock)

    Connection.__name__ = Connection.__qualname__ = f"Watched{base.__name__}"
    return Connection


def pool_classes(handed_out: Callable[[Any], None], connected: Callable[[socket.socket], None]
                 ) -> dict[str, type]:
    """``{"http": ..., "https": ...}``: pool classes that tell ``handed_out`` each connection
    they hand a request (in the requesting thread, before the request is sent), whose
    connections are ``connection_class``'s. Built per caller: the hooks are its own."""

    class Watched:
        def _get_conn(self, timeout: float | None = None) -> Any:
            conn = super()._get_conn(timeout)  # type: ignore[misc]
            handed_out(conn)
            return conn

    class HTTPPool(Watched, HTTPConnectionPool):
        ConnectionCls = connection_class(HTTPConnection, connected)

    class HTTPSPool(Watched, HTTPSConnectionPool):
        ConnectionCls = connection_class(HTTPSConnection, connected)

    return {"http": HTTPPool, "https": HTTPSPool}


class PoolsAdapter(HTTPAdapter):
    """requests' adapter with the given pool classes, also behind an HTTP proxy (urllib3 1.26
    and 2.x both look pools up in ``pool_classes_by_scheme``)."""

    def __init__(self, pools: dict[str, type], **kwargs: Any) -> None:
        self.pools = pools              # before super().__init__, which makes the pool manager
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = self.pools

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):   # SOCKS managers need pools of their own
            manager.pool_classes_by_scheme = self.pools
        return manager


# -- 3: the response's body and connection -----------------------------------------------------
def readinto_of(raw: Any) -> Callable[[memoryview], int] | None:
    """http.client's own ``readinto`` of ``raw`` (a urllib3 response) when its body is framed by
    Content-Length: the bytes go straight into the caller's buffer (urllib3's own read copies
    every chunk once more), the buffer filled whole (a loop in C over as many receives as it
    takes); None otherwise (read it with ``raw.read``)."""
    if raw.headers.get("Content-Length") is None:
        return None
    return getattr(getattr(raw, "_fp", None), "readinto", None)


class OneReceive:
    """http.client's body of a response, read one receive per call (``readinto1_of``).

    ``ready`` waits until the socket has bytes for the next call without taking any: a reader
    the fast path holds (``agent.yielding.bursts``) that finds them there leaves them in the
    socket's buffer, and its window stays where it was. A reader that took them first would
    free their room and advertise it at once: its sender, holding a window it was just granted,
    would go on sending into the burst (measured: each held stream let two windows through, not
    one; 310 kB of pull met each detected 6 MB burst at 1 Gbit/s)."""

    def __init__(self, resp: Any, sock: socket.socket | None) -> None:
        self._resp = resp
        self._sock = sock
        # True once http.client's buffered reader provably holds nothing of the body: a
        # readinto1 that returned less than it was asked copied all it held (CPython's
        # BufferedReader) and filled it no further. Until then bytes may wait there while the
        # socket has none: waiting on the socket could wait for bytes already received.
        self._drained = False
        self._poll: select.poll | None = None

    def __call__(self, b: memoryview) -> int:
        resp = self._resp
        if resp.fp is None:
            return 0
        if len(b) > resp.length:
            b = b[:resp.length]
        n = resp.fp.readinto1(b)
        self._drained = n < len(b)
        if not n and b:
            resp._close_conn()
        else:
            resp.length -= n
            if not resp.length:
                resp._close_conn()
        return int(n)

    def ready(self) -> bool:
        """Waits (the socket's own timeout at most) until the next call has bytes to take;
        False: this can't be known here (the next call takes what comes, as before)."""
        sock = self._sock
        if not self._drained or sock is None or self._resp.fp is None or sock.fileno() < 0:
            return False
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True                  # decrypted already, waiting in TLS's own buffer
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN | select.POLLPRI)
        timeout = sock.gettimeout()
        if not self._poll.poll(None if timeout is None else max(1, int(timeout * 1000))):
            raise TimeoutError("timed out")      # what the receive would have raised
        return True


def readinto1_of(raw: Any) -> OneReceive | None:
    """The same, but each call returns what one receive gave (at most one ``recv`` on the
    socket, as ``readinto1``), not a full buffer: a reader that stops between two calls (the
    fast path's cut, ``agent.yielding.bursts``) has taken at most what was already there, so
    its socket's buffer fills and its window closes within one window (with ``readinto``, 8
    readers held only between megabytes carried on through the first 150 ms of a 200 ms
    burst). The length and the close at the end are kept as ``HTTPResponse.readinto`` keeps
    them (CPython 3.11 to 3.13), so the connection goes back to its pool clean. None: not a
    body this can read (read it with ``readinto_of``)."""
    if raw.headers.get("Content-Length") is None:
        return None
    resp = getattr(raw, "_fp", None)
    fp = getattr(resp, "fp", None)
    if (getattr(resp, "chunked", True) or not isinstance(getattr(resp, "length", None), int)
            or not hasattr(fp, "readinto1") or not hasattr(resp, "_close_conn")):
        return None
    return OneReceive(resp, socket_of(raw))


def read_to_its_length(raw: Any) -> bool:
    """http.client read ``raw``'s body to its Content-Length (it closes its file then): the
    connection is clean for the next request."""
    fp = getattr(raw, "_fp", None)
    return fp is not None and fp.isclosed()


def release(raw: Any) -> None:
    """Hand ``raw``'s connection back to its pool (only once its body was read to its end)."""
    raw.release_conn()


def socket_of(raw: Any) -> socket.socket | None:
    """The socket ``raw`` (a urllib3 response) is read from, or None."""
    sock = getattr(getattr(raw, "_connection", None), "sock", None)
    if sock is None:
        # http.client's own file object: its socket wrapper holds the socket.
        fp = getattr(getattr(raw, "_fp", None), "fp", None)
        sock = getattr(getattr(fp, "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


# -- what a failure means ------------------------------------------------------------------------
def describe(e: BaseException) -> str:
    """What went wrong with a request, in the user's words, from requests' or urllib3's
    exception (raised by ``Session.get`` or mid-body)."""
    if isinstance(e, urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return "timed out reading"
    if isinstance(e, urllib3.exceptions.ProtocolError | urllib3.exceptions.IncompleteRead):
        return "the connection broke or the body ended early"
    if isinstance(e, requests.exceptions.SSLError):
        return "TLS verification failed (set a CA bundle for this source if it uses a private CA)"
    if isinstance(e, requests.exceptions.ProxyError):
        return "the proxy refused or failed the request"
    if isinstance(e, requests.exceptions.ConnectTimeout):
        return "timed out connecting"
    if isinstance(e, requests.exceptions.ReadTimeout):
        return "timed out reading"
    if isinstance(e, requests.exceptions.ConnectionError):
        return _connection_failure(e)
    return type(e).__name__


def _connection_failure(e: BaseException) -> str:
    """Which of the usual causes broke a connection, from the chain of exceptions under it (its
    shape differs between urllib3 1.26 and 2.x; the OS error at the bottom is the same)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror) or type(x).__name__ == "NameResolutionError":
            return "the host name did not resolve (DNS)"
        if isinstance(x, ConnectionRefusedError):
            return "connection refused (nothing listens on that port)"
        if isinstance(x, ConnectionResetError):
            return "the connection was reset"
        if isinstance(x, OSError) and x.errno is not None:
            return f"connection failed: {x.strerror}"
        stack += [x.__cause__, x.__context__, *(a for a in getattr(x, "args", ())
                                                if isinstance(a, BaseException))]
        reason = getattr(x, "reason", None)
        if isinstance(reason, BaseException):
            stack.append(reason)
    return "connection failed or was reset"
