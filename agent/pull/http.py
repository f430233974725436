"""HTTP for pulls: the only module that imports requests.

One ``requests.Session`` per stream (connection reuse, no sharing across threads). TLS verification
is always on, with an optional CA bundle per source; a per-source proxy; per-source credentials read
from a file (``bearer TOKEN`` or ``basic USER:PASSWORD``), never logged nor put in an error message.
Range responses are checked to the byte: status 206 (a 200 is a full body, refused), no
``Content-Encoding``, a ``Content-Range`` naming exactly the bytes asked for, and exactly that many
bytes in the body. The read timeout bounds every read of a body, so a server that stalls mid-body
costs one timeout, then the piece moves to the next source; a server that trickles is caught by
the request's goodput ``Meter``, whose watcher shuts the connection's socket down.
"""

from __future__ import annotations

import base64
import contextlib
import re
import socket
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter

from agent.policy_model import Source
from agent.pull.goodput import Meter

USER_AGENT = "wagent"
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class FetchError(Exception):
    """One request failed (network, status, framing); the pull may try another source."""


class ChangedError(FetchError):
    """The file changed on the source (its ETag is not the one recorded)."""

    def __init__(self, message: str, etag: str | None) -> None:
        super().__init__(message)
        self.etag = etag


class CredentialsError(Exception):
    """A credentials file that can't be read or parsed (its content is never shown)."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    read: float = 30.0


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


def redact(url: str) -> str:
    """A URL without user:password, for messages."""
    return re.sub(r"//[^/@]*@", "//", url)


class Client:
    """Requests to one source over one Session (one per stream: sessions aren't thread-safe)."""

    def __init__(self, source: Source, timeouts: Timeouts) -> None:
        self.source = source
        self.timeouts = timeouts
        s = requests.Session()
        # One connection per stream; requests' own retries are off (the engine retries, across
        # sources, with backoff).
        s.mount("http://", HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0))
        s.mount("https://", HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0))
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
        self.session.close()

    def _per_request(self) -> dict[str, Any]:
        return {"verify": self.verify, "proxies": self.proxies,
                "timeout": (self.timeouts.connect, self.timeouts.read)}

    def get_small(self, url: str, limit: int) -> bytes:
        """A whole small document (manifest, ``latest``), at most ``limit`` bytes."""
        try:
            with self.session.get(url, stream=True, **self._per_request()) as r:
                if r.status_code != 200:
                    raise FetchError(f"{redact(url)}: HTTP {r.status_code} {r.reason}")
                body = r.raw.read(limit + 1, decode_content=True)
                if len(body) > limit:
                    raise FetchError(f"{redact(url)}: larger than {limit} bytes")
                return body
        except requests.RequestException as e:
            raise FetchError(f"{redact(url)}: {_why(e)}") from None

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
        try:
            r = self.session.get(url, headers=headers, stream=True, **self._per_request())
        except requests.RequestException as e:
            raise FetchError(f"{redact(url)}: {_why(e)}") from None
        new_etag = r.headers.get("ETag")
        try:
            if r.status_code == 200:
                if etag and new_etag != etag:
                    raise ChangedError(f"{redact(url)} changed on the source (ETag {etag} -> "
                                       f"{new_etag})", new_etag)
                raise FetchError(f"{redact(url)}: answered 200 (the whole file) to a Range "
                                 "request; the source must serve byte ranges")
            if r.status_code != 206:
                raise FetchError(f"{redact(url)}: HTTP {r.status_code} {r.reason}")
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
        except BaseException:
            r.close()
            raise
        if meter is not None:
            meter.abort = lambda: _shut_down(r)
        return new_etag, self._body(r, url, size, chunk, meter)

    @staticmethod
    def _body(r: requests.Response, url: str, size: int, chunk: int, meter: Meter | None
              ) -> Generator[memoryview, None, None]:
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
                    raise FetchError(f"{redact(url)}: {_why(e)} after {size - left} of {size} "
                                     "bytes") from None
                if meter is not None:
                    meter.end(n)
                    if meter.abandoned:
                        raise FetchError(meter.abandoned)
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
            if meter is not None and meter.close():
                complete = False            # cut: its socket is shut down, never to be reused
            if complete and readinto is not None and fp.isclosed():
                # Read to its Content-Length by http.client: the connection is clean for the
                # next request; hand it back to the pool instead of closing it.
                r.raw.release_conn()
            else:
                r.close()


def _shut_down(r: requests.Response) -> None:
    """Break a read blocked on this response's connection (called from another thread)."""
    conn = getattr(r.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is None:
        # http.client's own file object: its socket wrapper holds the socket.
        fp = getattr(getattr(r.raw, "_fp", None), "fp", None)
        sock = getattr(getattr(fp, "raw", None), "_sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


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
        return "connection failed or was reset"
    return type(e).__name__
