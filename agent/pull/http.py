"""HTTP for pulls: the only module that imports requests.

One ``requests.Session`` per stream (connection reuse, no sharing across threads). TLS verification
is always on, with an optional CA bundle per source; a per-source proxy; per-source credentials read
from a file (``bearer TOKEN`` or ``basic USER:PASSWORD``), never logged nor put in an error message.
Range responses are checked to the byte: status 206 (a 200 is a full body, refused), no
``Content-Encoding``, a ``Content-Range`` naming exactly the bytes asked for, and exactly that many
bytes in the body. The read timeout bounds every read of a body, so a server that stalls mid-body
costs one timeout, then the piece moves to the next source; a server that trickles is caught by
the request's goodput ``Meter``, whose watcher shuts the connection's socket down.

A read timeout bounds each read, not a whole wait: a server trickling its headers a byte per read
timeout would hold a request for ever. So every request also has deadlines: its response headers
within ``Timeouts.headers_deadline`` of its start, and a small document's body (manifest,
``latest``) within a bound scaled by its size. One watchdog thread for the process enforces them,
and each client's stop event, by shutting the request's socket down; it knows the socket from the
moment a connection pool hands the connection out (``_WatchedPool``), before any header arrives.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import http.client
import re
import socket
import threading
import time
import zlib
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from agent.policy.model import Source
from agent.pull.goodput import Meter
from agent.redact import redact
from agent.yielding import sockets

__all__ = ["ChangedError", "Client", "CredentialsError", "FetchError", "Timeouts",
           "read_credentials", "redact", "url_for"]

USER_AGENT = "wagent"
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_SMALL_READ = 64 * 1024            # bytes read at a time from a small document's body
_MAX_INFORMATIONAL = 16            # 1xx responses skipped before a final one, at most
_MAX_HEADER_LINES = 100            # as http.client bounds a header block
_MAX_LINE = 65536


class FetchError(Exception):
    """One request failed (network, status, framing); the pull may try another source.

    ``retry_after``: the seconds the source asked to be left alone (a 503 or 429 with
    ``Retry-After``), which the pull honours before it asks that source again."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds (RFC 9110 10.2.3): delay-seconds,
    or an HTTP-date read against the response's own ``Date`` (the server's clock against
    itself: no clock of this node, so no skew); None when absent or unreadable.

    >>> retry_after({"Retry-After": "120"})
    120.0
    >>> retry_after({"Retry-After": "Wed, 21 Oct 2026 07:28:30 GMT",
    ...              "Date": "Wed, 21 Oct 2026 07:28:00 GMT"})
    30.0
    """
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(min(int(value[:9]), 10**8))
    try:
        when = email.utils.parsedate_to_datetime(value)
        now = email.utils.parsedate_to_datetime(headers.get("Date") or "")
        return max(0.0, (when - now).total_seconds())
    except (TypeError, ValueError, IndexError):
        return None


def _status_error(r: requests.Response, url: str) -> FetchError:
    """A response whose status is not the one asked for; a busy source says when to return."""
    after = retry_after(r.headers) if r.status_code in (429, 503) else None
    told = f" (Retry-After {after:.0f} s)" if after is not None else ""
    return FetchError(f"{redact(url)}: HTTP {r.status_code} {r.reason}{told}", after)


class ChangedError(FetchError):
    """The file changed on the source (its ETag is not the one recorded)."""

    def __init__(self, message: str, etag: str | None) -> None:
        super().__init__(message)
        self.etag = etag


class NoRangesError(FetchError):
    """The source answers Range requests with the whole file: no use for pieces."""


class CredentialsError(Exception):
    """A credentials file that can't be read or parsed (its content is never shown)."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    read: float = 30.0
    # The whole wait for a response's headers, from the request's start. None: connect + read,
    # what a healthy server needs at worst.
    headers: float | None = None
    # A small document's body must arrive within one read timeout plus its size at this rate
    # (bytes/s): 256 KiB/s gives a 2 MB manifest 38 s and the largest one (64 MiB) under 5 min.
    small_rate: float = 256 * 1024

    @property
    def headers_deadline(self) -> float:
        return self.headers if self.headers is not None else self.connect + self.read

    def small_body_deadline(self, size: int) -> float:
        return self.read + size / self.small_rate


def read_credentials(path: str) -> str:
    """The Authorization header value from a credentials file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise CredentialsError(f"credentials file {path}: {e.strerror}") from None
    kind, _, secret = text.partition(" ")
    secret = secret.strip()
    if kind.lower() == "bearer" and secret:
        return f"Bearer {secret}"
    if kind.lower() == "basic" and ":" in secret:
        return "Basic " + base64.b64encode(secret.encode()).decode()
    raise CredentialsError(f"credentials file {path}: expected one line 'bearer TOKEN' or "
                           "'basic USER:PASSWORD'")


def url_for(source: Source, *parts: str) -> str:
    return source.url.rstrip("/") + "/" + "/".join(quote(p, safe="/") for p in parts)


# -- deadlines and stop events ---------------------------------------------------------------
class _Watch:
    """One request in flight as the watchdog sees it: when it must be done, the stop event that
    ends it early, and the connection it runs on (set by ``_WatchedPool``)."""

    def __init__(self, limit: float | None, what: str, stop: threading.Event | None,
                 now: float) -> None:
        self.limit = limit                  # seconds, for the message
        self.what = what                    # what must arrive by then, for the message
        self.deadline = None if limit is None else now + limit
        self.stop = stop
        self.conn: Any = None
        self.cut: str | None = None         # "deadline" or "stopped", once cut
        self.shut = False                   # its socket is shut down

    def why(self) -> str:
        if self.cut == "stopped":
            return "stopped"
        return f"{self.what} did not arrive within {self.limit:g} s"


class _Watchdog:
    """One thread cutting every request of the process that passed its deadline or whose stop
    event is set: a blocked read then ends at once (EOF or an error)."""

    TICK = 0.1          # how soon a stop event is seen, and a socket not made yet retried

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._watches: set[_Watch] = set()
        self._thread: threading.Thread | None = None

    def add(self, w: _Watch) -> None:
        with self._cond:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, w: _Watch) -> None:
        with self._cond:
            self._watches.discard(w)

    def renew(self, w: _Watch, limit: float | None, what: str) -> None:
        """The next phase of a request: ``limit`` seconds from now (None: no deadline)."""
        with self._cond:
            if w.cut is None:
                w.limit, w.what = limit, what
                w.deadline = None if limit is None else self.clock() + limit
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                self._cond.wait(self._sweep(self.clock()))

    def _sweep(self, now: float) -> float | None:
        """Cut what is due; seconds until the next look (None: until something changes)."""
        wait: float | None = None
        for w in self._watches:
            if w.cut is None:
                if w.stop is not None and w.stop.is_set():
                    w.cut = "stopped"
                elif w.deadline is not None and now >= w.deadline:
                    w.cut = "deadline"
            if w.cut is not None and not w.shut:
                w.shut = _shut_socket(getattr(w.conn, "sock", None))
            for due in self._due(w, now):
                wait = due if wait is None else min(wait, due)
        return wait

    def _due(self, w: _Watch, now: float) -> list[float]:
        if w.cut is not None:
            return [] if w.shut else [self.TICK]       # still connecting: no socket yet
        due = [self.TICK] if w.stop is not None else []
        if w.deadline is not None:
            due.append(w.deadline - now)
        return due


_WATCHDOG = _Watchdog()
_current = threading.local()        # .watch: the request this thread is making, if any


class _WatchedPool:
    """Gives the connection it hands out to the watch of the request this thread is making, so
    that its socket can be shut down before any header has arrived."""

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        w = getattr(_current, "watch", None)
        if w is not None:
            w.conn = conn
        return conn


class _FinalResponse(http.client.HTTPResponse):
    """http.client skips only a ``100 Continue`` before the final response: any other 1xx (a
    CDN's or nginx's ``103 Early Hints``) was taken for the answer, its final response left
    in the connection. Informational responses are skipped here (RFC 9110 15.2: a client
    must accept and ignore them), all but ``101``, which wagent never asks for."""

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(_MAX_INFORMATIONAL):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 101 < status < 200:
                return version, status, reason     # 100: begin() skips it itself
            for _ in range(_MAX_HEADER_LINES):     # its header block, up to the blank line
                line = self.fp.readline(_MAX_LINE + 1)
                if line in (b"\r\n", b"\n", b""):
                    break
            else:
                raise http.client.HTTPException("an informational response with too many "
                                                "header lines")
        raise http.client.HTTPException(f"more than {_MAX_INFORMATIONAL} informational "
                                        "responses before the final one")


def _final_responses(connection_cls: type) -> type:
    return type(f"Final{connection_cls.__name__}", (connection_cls,),
                {"response_class": _FinalResponse})


class _HTTPPool(_WatchedPool, HTTPConnectionPool):
    # Hook (agent/yielding/sockets.py): each connection registers its socket once connected, so
    # the backoff loop can clamp the pull's receive windows and read their TCP_INFO.
    ConnectionCls = sockets.registering(_final_responses(HTTPConnection))


class _HTTPSPool(_WatchedPool, HTTPSConnectionPool):
    # the same hook, after TLS
    ConnectionCls = sockets.registering(_final_responses(HTTPSConnection))


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class _Adapter(HTTPAdapter):
    """requests' adapter with watched pools, also behind an HTTP proxy (urllib3 1.26 and 2.x
    both look pools up in ``pool_classes_by_scheme``)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):   # SOCKS managers need pools of their own
            manager.pool_classes_by_scheme = _POOLS
        return manager


# -- the client ---------------------------------------------------------------------------------
class Client:
    """Requests to one source over one Session (one per stream: sessions aren't thread-safe).

    ``stop``: once set, the request in flight is cut within ``_Watchdog.TICK``."""

    def __init__(self, source: Source, timeouts: Timeouts,
                 stop: threading.Event | None = None) -> None:
        self.source = source
        self.timeouts = timeouts
        self.stop = stop
        self._watches: set[_Watch] = set()
        s = requests.Session()
        # One connection per stream; requests' own retries are off (the engine retries, across
        # sources, with backoff).
        s.mount("http://", _Adapter(pool_connections=1, pool_maxsize=1, max_retries=0))
        s.mount("https://", _Adapter(pool_connections=1, pool_maxsize=1, max_retries=0))
        s.headers["User-Agent"] = USER_AGENT
        s.headers["Accept-Encoding"] = "identity"     # byte ranges of the file, never of a gzip
        # Passed with every request: a session-level verify loses to REQUESTS_CA_BUNDLE and
        # CURL_CA_BUNDLE from the environment (requests issue 3829).
        self.verify: str | bool = source.ca_bundle or True
        s.verify = self.verify
        # Also per request: session-level proxies lose to *_PROXY from the environment.
        self.proxies = {"http": source.proxy, "https": source.proxy} if source.proxy else None
        if source.credentials:
            s.headers["Authorization"] = read_credentials(source.credentials)
        self.session = s

    def close(self) -> None:
        for w in self._watches:         # bodies dropped unread
            _WATCHDOG.remove(w)
        self._watches.clear()
        self.session.close()

    def _per_request(self) -> dict[str, Any]:
        return {"verify": self.verify, "proxies": self.proxies,
                "timeout": (self.timeouts.connect, self.timeouts.read)}

    def _watch(self) -> _Watch:
        w = _Watch(self.timeouts.headers_deadline, "the response headers", self.stop,
                   _WATCHDOG.clock())
        self._watches.add(w)
        _WATCHDOG.add(w)
        return w

    def _unwatch(self, w: _Watch) -> None:
        _WATCHDOG.remove(w)
        self._watches.discard(w)

    def _get(self, url: str, w: _Watch, headers: dict[str, str] | None = None
             ) -> requests.Response:
        """The response's headers, in time, or FetchError (``w`` stays watched)."""
        _current.watch = w
        try:
            r = self.session.get(url, headers=headers, stream=True, **self._per_request())
        except requests.RequestException as e:
            raise FetchError(f"{redact(url)}: {_failure(w, e)}") from None
        finally:
            _current.watch = None
        if w.cut is not None:
            # Cut while the headers came: http.client takes EOF for their end, so this looks
            # like a response, with the headers that made it in time.
            r.close()
            raise FetchError(f"{redact(url)}: {w.why()}")
        return r

    def get_small(self, url: str, limit: int) -> bytes:
        """A whole small document (manifest, ``latest``), at most ``limit`` bytes once decoded."""
        w = self._watch()
        try:
            with self._get(url, w) as r:
                if r.status_code != 200:
                    raise _status_error(r, url)
                _WATCHDOG.renew(w, self.timeouts.small_body_deadline(
                    min(limit, _content_length(r) or limit)), "the body")
                try:
                    body = _read_small(r, url, limit)
                except Exception as e:  # urllib3 raises several unrelated types mid-body
                    if w.cut is None and isinstance(e, FetchError):
                        raise
                    raise FetchError(f"{redact(url)}: {_failure(w, e)}") from None
                if w.cut is not None:
                    raise FetchError(f"{redact(url)}: {w.why()}")
                return body
        finally:
            self._unwatch(w)

    def ranged(self, url: str, offset: int, size: int, etag: str | None, chunk: int,
               total: int | None = None, meter: Meter | None = None
               ) -> tuple[str | None, Generator[memoryview, None, None]]:
        """(ETag, body chunks) of bytes [offset, offset+size); every framing rule checked.

        ``total``: the file's size in the manifest; a Content-Range naming another size means
        the source serves another file under that name.

        With ``etag`` the request carries If-Range: a source whose file changed answers 200 with
        the whole new file, which raises ChangedError (never mixed with the old bytes).

        ``meter``: times each read of the body; its ``abort`` is set to break a blocked read.
        """
        headers = {"Range": f"bytes={offset}-{offset + size - 1}"}
        if etag and not etag.startswith("W/"):
            headers["If-Range"] = etag
        w = self._watch()
        try:
            r = self._get(url, w, headers)
        except BaseException:
            self._unwatch(w)
            raise
        # The body's pace is the goodput meter's to judge; the stop event still holds.
        _WATCHDOG.renew(w, None, "the body")
        try:
            new_etag = self._check_range(r, url, offset, size, etag, total)
        except BaseException:
            self._unwatch(w)
            r.close()
            raise
        if meter is not None:
            meter.abort = lambda: _shut_down(r)
        return new_etag, self._body(r, url, size, chunk, meter, w)

    @staticmethod
    def _check_range(r: requests.Response, url: str, offset: int, size: int,
                     etag: str | None, total: int | None) -> str | None:
        """The response's ETag, once its status and framing are those of the range asked for."""
        new_etag = r.headers.get("ETag")
        if r.status_code == 200:
            if etag and new_etag != etag:
                raise ChangedError(f"{redact(url)} changed on the source (ETag {etag} -> "
                                   f"{new_etag})", new_etag)
            if offset == 0 and total is not None and size == total:
                # The request covers the whole file: the whole file is the answer, still
                # checked to the byte (its length here, every piece's hash as it lands).
                length = r.headers.get("Content-Length")
                if length is not None and length.strip() != str(size):
                    raise FetchError(f"{redact(url)}: Content-Length {length} for a file of "
                                     f"{size} bytes")
                return new_etag
            raise NoRangesError(f"{redact(url)}: answered 200 (the whole file) to a Range "
                                "request: this source ignores Range, and wagent fetches "
                                "pieces; serve byte ranges (206) from it, or remove it")
        if r.status_code != 206:
            raise _status_error(r, url)
        encoding = r.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            # Despite "Accept-Encoding: identity": these would be bytes of a compressed
            # stream, not of the file; say so rather than report a hash mismatch.
            raise FetchError(f"{redact(url)}: sent Content-Encoding {encoding} for a byte "
                             "range; the source must serve files uncompressed (e.g. nginx: "
                             "gzip off for them)")
        if etag and new_etag and new_etag != etag:
            raise ChangedError(f"{redact(url)} changed on the source (ETag {etag} -> "
                               f"{new_etag})", new_etag)
        m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != offset or int(m.group(2)) != offset + size - 1:
            raise FetchError(f"{redact(url)}: Content-Range "
                             f"{r.headers.get('Content-Range')!r} is not the range asked "
                             f"for (bytes {offset}-{offset + size - 1})")
        if total is not None and m.group(3) not in ("*", str(total)):
            raise FetchError(f"{redact(url)}: the source's file has {m.group(3)} bytes, the "
                             f"manifest says {total}: it serves another version of the file")
        length = r.headers.get("Content-Length")
        if length is not None and length.strip() != str(size):
            raise FetchError(f"{redact(url)}: Content-Length {length} for a range of {size} "
                             "bytes")
        return new_etag

    def _body(self, r: requests.Response, url: str, size: int, chunk: int, meter: Meter | None,
              w: _Watch) -> Generator[memoryview, None, None]:
        """The body in chunks, each a view of one buffer reused for the next (use it at once).

        The bytes are read straight from http.client's response into that buffer when urllib3
        exposes it (no per-chunk allocation; urllib3's own read copies every chunk once more).
        """
        fp = getattr(r.raw, "_fp", None)
        readinto = getattr(fp, "readinto", None) if r.raw.headers.get(
            "Content-Length") is not None else None
        buf = memoryview(bytearray(min(chunk, size)))
        complete = False
        try:
            left = size
            while left:
                want = min(len(buf), left)
                if meter is not None:
                    meter.begin(want)
                try:
                    if readinto is not None:
                        n = readinto(buf[:want])
                    else:
                        data = r.raw.read(want, decode_content=False)
                        n = len(data)
                        buf[:n] = data
                except Exception as e:  # urllib3 raises several unrelated types mid-body
                    if meter is not None and meter.abandoned:
                        raise FetchError(meter.abandoned) from None
                    raise FetchError(f"{redact(url)}: {_failure(w, e)} after {size - left} of "
                                     f"{size} bytes") from None
                if meter is not None:
                    meter.end(n)
                    if meter.abandoned:
                        raise FetchError(meter.abandoned)
                if w.cut is not None:
                    raise FetchError(f"{redact(url)}: {w.why()} after {size - left} of {size} "
                                     "bytes")
                if not n:
                    raise FetchError(f"{redact(url)}: body ended after {size - left} of {size} "
                                     "bytes")
                left -= n
                yield buf[:n]
            if readinto is None:
                # A body framed by chunks or by closing: make sure it ends where the range does.
                try:
                    extra = r.raw.read(1, decode_content=False)
                except Exception:
                    extra = b""
                if extra:
                    raise FetchError(f"{redact(url)}: sent more bytes than the {size} asked for")
            complete = True
        finally:
            # Unwatched first: once back in the pool, the connection is the next request's.
            self._unwatch(w)
            if meter is not None and meter.close():
                complete = False            # cut: its socket is shut down, never to be reused
            if w.shut:
                complete = False
            if complete and readinto is not None and fp.isclosed():
                # Read to its Content-Length by http.client: the connection is clean for the
                # next request; hand it back to the pool instead of closing it.
                r.raw.release_conn()
            else:
                r.close()


def _content_length(r: requests.Response) -> int | None:
    value = r.headers.get("Content-Length", "").strip()
    return int(value) if value.isdigit() and len(value) < 20 else None


def _read_small(r: requests.Response, url: str, limit: int) -> bytes:
    """The body, decoded, refused beyond ``limit`` bytes. Read raw and inflated here in bounded
    steps: urllib3 1.26 inflates a whole read at once (a 2 MB gzip bomb grew to 4 GB)."""
    encoding = (r.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding in ("identity", ""):
        inflater = None
    elif encoding in ("gzip", "x-gzip", "deflate"):
        inflater = _Inflater()
    else:
        raise FetchError(f"{redact(url)}: sent Content-Encoding {encoding!r}, which wagent does "
                         "not decode; serve it uncompressed (or gzip)")
    out = bytearray()
    received = 0
    while data := r.raw.read(_SMALL_READ, decode_content=False):
        received += len(data)
        if inflater is not None:
            try:
                data = inflater.feed(data, limit + 1 - len(out))
            except zlib.error as e:
                raise FetchError(f"{redact(url)}: its {encoding} body can't be decoded ({e})"
                                 ) from None
        out += data
        if len(out) > limit or received > limit:
            raise FetchError(f"{redact(url)}: larger than {limit} bytes")
    if inflater is not None and inflater.truncated:
        raise FetchError(f"{redact(url)}: its {encoding} body ends half way")
    return bytes(out)


class _Inflater:
    """gzip or zlib decoding (either header, detected) that never produces more than it is
    asked for; gzip members may follow one another, as urllib3 accepts."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(zlib.MAX_WBITS | 32)
        self._fed = False               # the current member has had input

    @property
    def truncated(self) -> bool:
        return self._fed and not self._d.eof

    def feed(self, data: bytes, room: int) -> bytes:
        """What ``data`` decodes to, at most ``room`` bytes (more would be refused anyway)."""
        out = bytearray()
        while data and len(out) < room:
            self._fed = True
            out += self._d.decompress(data, room - len(out))
            if self._d.eof:
                data = self._d.unused_data
                self._d, self._fed = zlib.decompressobj(zlib.MAX_WBITS | 32), False
            else:
                data = self._d.unconsumed_tail
        return bytes(out)


def _shut_down(r: requests.Response) -> None:
    """Break a read blocked on this response's connection (called from another thread)."""
    conn = getattr(r.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is None:
        # http.client's own file object: its socket wrapper holds the socket.
        fp = getattr(getattr(r.raw, "_fp", None), "fp", None)
        sock = getattr(getattr(fp, "raw", None), "_sock", None)
    _shut_socket(sock)


def _shut_socket(sock: object) -> bool:
    """Shut a socket down for both directions; False if there is none (yet)."""
    if not isinstance(sock, socket.socket):
        return False
    with contextlib.suppress(OSError):
        # socket.socket's own shutdown, also for TLS: SSLSocket's drops its TLS state, which a
        # read in another thread may be using right now.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    return True


def _failure(w: _Watch, e: BaseException) -> str:
    return w.why() if w.cut is not None else _why(e)


def _why(e: BaseException) -> str:
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
