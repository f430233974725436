"""Requests to one source: the pulls' HTTP client (with ``agent.pull.urllib3_adapter``, the only
module that imports requests).

One ``requests.Session`` per stream (connection reuse, no sharing across threads). TLS
verification is always on, with an optional CA bundle per source; a per-source proxy; per-source
credentials (``agent.pull.credentials``). Range responses are checked to the byte
(``agent.pull.framing``), then their bodies counted to the byte here. The read timeout bounds
every read of a body, so a server that stalls mid-body costs one timeout, then the piece moves to
the next source; a server that trickles is caught by the request's goodput ``Meter``, whose
watcher shuts the connection's socket down. Every request is watched for its deadlines and the
client's stop event (``agent.pull.deadlines``) by its ``Connections``' watchdog, which knows the
request's socket from the moment a pool hands the connection out, before any header arrives.

    client = Client(source, Timeouts(), connections=connections, stop=stop)
    raw = client.get_small(url_for(source, "llama", "v7", "manifest.json"), 64 << 20)
    etag, chunks = client.ranged(url, offset, size, etag, chunk=1 << 20, total=file_size)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any
from urllib.parse import quote

import requests

from agent.policy.model import Source
from agent.pull import urllib3_adapter as adapter
from agent.pull.connections import Connections
from agent.pull.credentials import CredentialsError, read_credentials
from agent.pull.deadlines import Timeouts, Watch, shut_socket
from agent.pull.errors import ChangedError, FetchError
from agent.pull.framing import check_range, content_length, retry_after, status_error
from agent.pull.goodput import Meter
from agent.pull.small_body import read_small
from agent.redact import redact
from agent.s3.auth import S3AuthError
from agent.s3.errors import explain

USER_AGENT = "wagent"
S3_ERROR_BODY = 16 << 10        # an S3 error document is a few hundred bytes


def url_for(source: Source, *parts: str) -> str:
    return source.base.rstrip("/") + "/" + "/".join(quote(p, safe="/") for p in parts)


def shown(source: Source, url: str) -> str:
    """``url`` as messages name it: an s3:// source's object as ``s3://BUCKET/KEY``."""
    base = source.base.rstrip("/")
    if source.is_s3 and url.startswith(base + "/"):
        return source.url.rstrip("/") + url[len(base):]
    return redact(url)


class Client:
    """Requests to one source over one Session (one per stream: sessions aren't thread-safe).

    ``connections``: the owner's watchdog and pull sockets' registry; ``stop``: once set, the
    request in flight is cut within ``Watchdog.TICK``. Raises ``CredentialsError`` when the
    source's credentials file can't be read."""

    def __init__(self, source: Source, timeouts: Timeouts, *, connections: Connections,
                 stop: threading.Event | None = None) -> None:
        self.source = source
        self.timeouts = timeouts
        self.connections = connections
        self.watchdog = connections.watchdog
        self.stop = stop
        self._watches: set[Watch] = set()
        s = requests.Session()
        s.mount("http://", connections.adapter())
        s.mount("https://", connections.adapter())
        s.headers["User-Agent"] = USER_AGENT
        s.headers["Accept-Encoding"] = "identity"     # byte ranges of the file, never of a gzip
        # Passed with every request: a session-level verify loses to REQUESTS_CA_BUNDLE and
        # CURL_CA_BUNDLE from the environment (requests issue 3829).
        self.verify: str | bool = source.ca_bundle or True
        s.verify = self.verify
        # Also per request: session-level proxies lose to *_PROXY from the environment.
        self.proxies = {"http": source.proxy, "https": source.proxy} if source.proxy else None
        # An s3:// source signs every request (SigV4: agent.s3.auth); its credentials file is
        # the AWS kind, read there.
        try:
            self.s3 = connections.s3.of(source) if source.is_s3 else None
        except S3AuthError as e:
            raise CredentialsError(str(e)) from None
        if source.credentials and self.s3 is None:
            s.headers["Authorization"] = read_credentials(source.credentials)
        self.session = s

    def close(self) -> None:
        for w in self._watches:         # bodies dropped unread
            self.watchdog.remove(w)
        self._watches.clear()
        self.session.close()

    def _per_request(self) -> dict[str, Any]:
        return {"verify": self.verify, "proxies": self.proxies,
                "timeout": (self.timeouts.connect, self.timeouts.read)}

    def _watch(self) -> Watch:
        w = Watch(self.timeouts.headers_deadline, "the response headers", self.stop,
                  self.watchdog.clock())
        self._watches.add(w)
        self.watchdog.add(w)
        return w

    def _unwatch(self, w: Watch) -> None:
        self.watchdog.remove(w)
        self._watches.discard(w)

    def _get(self, url: str, w: Watch, headers: dict[str, str] | None = None
             ) -> requests.Response:
        """The response's headers, in time, or FetchError (``w`` stays watched)."""
        if self.s3 is not None:
            try:
                headers = self.s3.sign("GET", url, headers or {})
            except S3AuthError as e:        # expiring credentials that could not be renewed
                raise FetchError(f"{shown(self.source, url)}: {e}") from None
        try:
            with self.connections.requesting(w):
                r = self.session.get(url, headers=headers, stream=True, **self._per_request())
        except requests.RequestException as e:
            raise FetchError(f"{redact(url)}: {_failure(w, e)}") from None
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
                    raise self._refused(r, url)
                self.watchdog.renew(w, self.timeouts.small_body_deadline(
                    min(limit, content_length(r.headers) or limit)), "the body")
                try:
                    body = read_small(lambda n: r.raw.read(n, decode_content=False),
                                      r.headers.get("Content-Encoding"), url, limit)
                except Exception as e:  # urllib3 raises several unrelated types mid-body
                    if w.cut is None and isinstance(e, FetchError):
                        raise
                    raise FetchError(f"{redact(url)}: {_failure(w, e)}") from None
                if w.cut is not None:
                    raise FetchError(f"{redact(url)}: {w.why()}")
                return body
        finally:
            self._unwatch(w)

    def lines(self, url: str, limit: int, idle: float) -> Generator[bytes, None, None]:
        """The lines of a streamed document (a neighbour's have-map, followed:
        ``agent.peers.server``), each as soon as its chunk arrives, until the body ends.
        FetchError when no line comes for ``idle`` seconds, a line passes ``limit`` bytes, or
        the connection fails."""
        w = self._watch()
        try:
            with self._get(url, w) as r:
                if r.status_code != 200:
                    raise self._refused(r, url)
                self.watchdog.renew(w, idle, "the next line")
                buf = b""
                try:
                    # A chunk at a time as it comes (a chunked body), at most ``limit`` bytes
                    # of it: the next line is never waited for past the one that came.
                    for chunk in r.raw.stream(limit, decode_content=False):
                        buf += chunk
                        *done, buf = buf.split(b"\n")
                        if len(buf) > limit:
                            raise FetchError(f"{redact(url)}: a line longer than {limit} bytes")
                        if done:
                            self.watchdog.renew(w, idle, "the next line")
                        yield from done
                except FetchError:
                    if w.cut is None:
                        raise
                    raise FetchError(f"{redact(url)}: {w.why()}") from None
                except Exception as e:  # urllib3 raises several unrelated types mid-body
                    raise FetchError(f"{redact(url)}: {_failure(w, e)}") from None
                if w.cut is not None:
                    raise FetchError(f"{redact(url)}: {w.why()}")
        finally:
            self._unwatch(w)

    def ranged(self, url: str, offset: int, size: int, etag: str | None, chunk: int,
               total: int | None = None, meter: Meter | None = None,
               pause: Callable[[], bool] | None = None,
               arrived: Callable[[int], None] | None = None,
               wait_cut: Callable[[], None] | None = None
               ) -> tuple[str | None, Generator[memoryview, None, None]]:
        """(ETag, body chunks) of bytes [offset, offset+size); every framing rule checked.

        ``total``: the file's size in the manifest; a Content-Range naming another size means
        the source serves another file under that name.

        With ``etag`` the request carries If-Range: a source whose file changed answers 200 with
        the whole new file, which raises ChangedError (never mixed with the old bytes).

        ``meter``: times each read of the body; its ``abort`` is set to break a blocked read.

        ``pause``: asked between two receives into a chunk, and before a receive once its bytes
        are there; True: hand over what came so far (the fast path's cut is on:
        ``TokenBucket.paused``, and the bucket holds the reader). ``wait_cut`` waits the cut out
        when a chunk is paused before its first receive (nothing to hand over).

        ``arrived``: told the bytes of each receive as it lands (the stream count measures
        goodput by it: a chunk's bytes all at once would be a megabyte's grain).
        """
        headers = {"Range": f"bytes={offset}-{offset + size - 1}"}
        if etag and not etag.startswith("W/"):
            # An object store's way is If-Match: a changed object answers 412 (S3 documents
            # no If-Range for GetObject); HTTP's is If-Range: a changed file answers 200.
            headers["If-Match" if self.s3 is not None else "If-Range"] = etag
        w = self._watch()
        try:
            r = self._get(url, w, headers)
        except BaseException:
            self._unwatch(w)
            raise
        # The body's pace is the goodput meter's to judge; the stop event still holds.
        self.watchdog.renew(w, None, "the body")
        try:
            if self.s3 is not None and r.status_code not in (200, 206):
                raise self._refused(r, url)
            new_etag = check_range(r.status_code, r.headers, url, offset, size, etag, total,
                                   r.reason)
        except BaseException:
            self._unwatch(w)
            r.close()
            raise
        if meter is not None:
            meter.abort = lambda: _shut_down(r)
        return new_etag, self._body(r, url, size, chunk, meter, w, pause, arrived, wait_cut)

    def _refused(self, r: requests.Response, url: str) -> FetchError:
        """The error a response that is not the one asked for raises: an object store's in the
        words of its error document (``agent.s3.errors``)."""
        if self.s3 is None:
            return status_error(r.status_code, r.reason, r.headers, url)
        try:
            # Not decoded: we ask for identity, and a compressed answer would only be a bomb.
            body = r.raw.read(S3_ERROR_BODY, decode_content=False) or b""
        except Exception:       # urllib3 raises several unrelated types mid-body
            body = b""
        failure = explain(r.status_code, body, r.headers, shown(self.source, url),
                          retry_after(r.headers))
        words = failure.words
        if self.s3.anonymous and r.status_code == 403:
            words += " (no credentials were found: the request went unsigned)"
        if failure.code == "PreconditionFailed" or r.status_code == 412:
            return ChangedError(words, None)
        return FetchError(words, failure.retry_after)

    def _body(self, r: requests.Response, url: str, size: int, chunk: int, meter: Meter | None,
              w: Watch, pause: Callable[[], bool] | None = None,
              arrived: Callable[[int], None] | None = None,
              wait_cut: Callable[[], None] | None = None
              ) -> Generator[memoryview, None, None]:
        """The body in chunks, each a view of one buffer reused for the next (use it at once).

        The bytes are read straight from http.client's response into that buffer when urllib3
        exposes it (``adapter.readinto_of``: no per-chunk allocation). With ``pause``, a chunk
        is filled one receive at a time (``adapter.readinto1_of``) and handed over early when
        ``pause()`` says so: a reader the fast path holds has taken at most one receive past the
        cut (a full chunk read would go on for a megabyte: 8 readers carried on through the
        first 150 ms of a 200 ms burst), while the work per chunk (hashing, writing, booking)
        stays once per chunk. With ``arrived``, so too, each receive told as it lands.
        """
        readinto = adapter.readinto_of(r.raw)
        one = adapter.readinto1_of(r.raw) if pause is not None or arrived is not None else None
        buf = memoryview(bytearray(min(chunk, size)))
        complete = False
        try:
            left = size
            while left:
                want = min(len(buf), left)
                if meter is not None:
                    meter.begin(want)
                held = False
                try:
                    if one is not None:
                        n, held = _fill(one, buf, want, pause, arrived, wait_cut is not None)
                    elif readinto is not None:
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
                if held and not n:
                    # Paused before the chunk's first receive: nothing to hand over, so the
                    # cut is waited out here (not timed as the network's).
                    assert wait_cut is not None
                    wait_cut()
                    continue
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
            if complete and readinto is not None and adapter.read_to_its_length(r.raw):
                # Read to its Content-Length by http.client: the connection is clean for the
                # next request; hand it back to the pool instead of closing it.
                adapter.release(r.raw)
            else:
                r.close()


def _shut_down(r: requests.Response) -> None:
    """Break a read blocked on this response's connection (called from another thread)."""
    shut_socket(adapter.socket_of(r.raw))


def _failure(w: Watch, e: BaseException) -> str:
    return w.why() if w.cut is not None else adapter.describe(e)


def _fill(one: Callable[[memoryview], int], buf: memoryview, want: int,
          pause: Callable[[], bool] | None,
          arrived: Callable[[int], None] | None = None,
          before: bool = False) -> tuple[int, bool]:
    """Receives into ``buf[:want]`` until it is full, the body ends, or ``pause()``; each
    receive's bytes told to ``arrived``. Returns the bytes received and whether ``pause()``
    stopped it before a receive: with ``before``, once the bytes of the next one are there
    (``OneReceive.ready``), ``pause()`` is asked before they are taken, and they stay in the
    socket, its window where it was."""
    ready = getattr(one, "ready", None) if before and pause is not None else None
    n = 0
    while n < want:
        if ready is not None and ready() and pause is not None and pause():
            return n, True
        got = one(buf[n:want])
        if not got:
            break
        n += got
        if arrived is not None:
            arrived(got)
        if pause is not None and pause():
            break
    return n, False
