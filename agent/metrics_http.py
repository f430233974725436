"""The metrics endpoint's HTTP server: one thread, a bounded number of connections, and a
deadline on each whole exchange.

Why not ``prometheus_client.start_http_server`` or wsgiref's threaded server (which wagent
used before): they give every connection its own thread and descriptor for as long as the
client keeps it open, and their timeout is per ``recv``, so a client sending one byte every
few seconds is never cut off. Any local user could take all of the daemon's descriptors that
way (issue 21: 1,019 such connections left ``wagent status`` timing out and the control socket
failing to accept), and each connection that did time out printed a traceback to the journal.

Here:

1. One thread serves every connection through a selector; no thread per connection.
2. At most ``max_connections`` are held at once. Accepting one more closes the oldest still
   reading its request: a scraper sends its request as soon as it connects, so the clients
   that lose their place are the ones that have dawdled longest, and a fresh scrape is
   answered even while slow clients keep coming.
3. The request and the answer together must be done within ``deadline`` seconds of the
   accept, however the bytes trickle in or out; the clock that decides it is passed in.
4. A request larger than ``max_request`` bytes is answered 431; only ``GET`` (and ``HEAD``)
   reach the WSGI application, whose answer is sent with ``Connection: close``.
5. Cut connections are logged as one warning line at most a minute, with their count, never
   with a traceback; each one at debug.

    server = ScrapeServer("127.0.0.1", 9464, make_wsgi_app(registry))
    server.start()
    ...
    server.stop()
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

log = logging.getLogger(__name__)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

# Prometheus' default scrape_timeout: a scrape slower than that has failed on its side anyway.
REQUEST_DEADLINE = 10.0
# Prometheus scrapes one target over one connection; a handful covers several scrapers and a
# curl by hand.
MAX_CONNECTIONS = 16
MAX_REQUEST = 8 * 1024       # a scrape's request line and headers are a few hundred bytes
# Connections waiting to be accepted are the kernel's, not descriptors of ours; a deep queue
# lets a burst of connects in without SYN retries, and it drains at once (we accept and evict).
BACKLOG = 128
CUT_LOG_INTERVAL = 60.0
ACCEPT_PAUSE = 0.5           # after an accept() failed for want of descriptors or memory


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None         # set once the request is in: the bytes left to send


class ScrapeServer:
    """Serves ``app`` (a WSGI application, ``prometheus_client.make_wsgi_app``) over HTTP/1.x
    on ``host:port`` until :meth:`stop`. Binds in the constructor, so a taken port raises
    OSError there."""

    def __init__(self, host: str, port: int, app: WSGIApp, *,
                 max_connections: int = MAX_CONNECTIONS, deadline: float = REQUEST_DEADLINE,
                 max_request: int = MAX_REQUEST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.max_connections = max_connections
        self.deadline = deadline
        self.max_request = max_request
        self.clock = clock
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # a reload that moves the endpoint and back must not wait for TIME_WAIT
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.address: tuple[Any, ...] = self._sock.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: dict[socket.socket, _Conn] = {}     # oldest first
        self._cut = {"slow": 0, "over the cap": 0}
        self._cut_logged_at: float | None = None
        self._accept_again_at: float | None = None

    @property
    def port(self) -> int:
        return int(self.address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        else:
            self._close_all()

    # -- the loop ------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._sel.select(self._wait()):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        conn = self._conns.get(key.fileobj)  # type: ignore[call-overload]
                        if conn is not None:
                            self._step(conn)
                self._expire()
                self._resume_accepting()
        except Exception:      # a bug here must not pass silently: the endpoint is gone
            log.exception("the metrics endpoint stopped")
        finally:
            self._close_all()

    def _wait(self) -> float | None:
        times = [self._accept_again_at] if self._accept_again_at is not None else []
        if self._conns:
            times.append(next(iter(self._conns.values())).deadline)   # oldest: earliest due
        return max(0.0, min(times) - self.clock()) if times else None

    def _resume_accepting(self) -> None:
        if self._accept_again_at is not None and self.clock() >= self._accept_again_at:
            self._accept_again_at = None
            self._sel.register(self._sock, selectors.EVENT_READ)

    def _accept(self) -> None:
        # at most a cap's worth per turn, so a flood of connects can't starve the answering
        for _ in range(self.max_connections):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:    # reset while it waited in the backlog
                continue
            except OSError as e:
                # EMFILE and the like: the listener stays readable, so stop watching it for a
                # moment rather than spin; the backlog holds the connects meanwhile
                log.debug("metrics: accept failed: %s", e)
                self._sel.unregister(self._sock)
                self._accept_again_at = self.clock() + ACCEPT_PAUSE
                return
            if len(self._conns) >= self.max_connections:
                self._drop(self._oldest_reading(), "over the cap")
            sock.setblocking(False)
            peer = f"{addr[0]}:{addr[1]}"
            self._conns[sock] = _Conn(sock, peer, self.clock() + self.deadline)
            self._sel.register(sock, selectors.EVENT_READ)

    def _oldest_reading(self) -> _Conn:
        for conn in self._conns.values():
            if conn.answer is None:
                return conn
        return next(iter(self._conns.values()))

    def _expire(self) -> None:
        now = self.clock()
        for conn in list(self._conns.values()):
            if conn.deadline > now:
                break
            self._drop(conn, "slow")

    def _step(self, conn: _Conn) -> None:
        try:
            if conn.answer is None:
                chunk = conn.sock.recv(4096)
                if not chunk:             # gone before its request was whole
                    self._close(conn)
                    return
                conn.request += chunk
                answer = self._answer_for(conn)
                if answer is None:
                    return
                conn.answer = memoryview(answer)
                self._sel.modify(conn.sock, selectors.EVENT_WRITE)
            sent = conn.sock.send(conn.answer)
            conn.answer = conn.answer[sent:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:              # reset, broken pipe: the client's business
            log.debug("metrics: connection from %s: %s", conn.peer, e)
            self._close(conn)
            return
        if not conn.answer:
            self._close(conn)

    # -- HTTP ----------------------------------------------------------------------------------
    def _answer_for(self, conn: _Conn) -> bytes | None:
        """The whole answer once the request's head is in, None while it isn't."""
        end = conn.request.find(b"\r\n\r\n")
        if end < 0:
            end = conn.request.find(b"\n\n")
        if end < 0:
            if len(conn.request) > self.max_request:
                return _response("431 Request Header Fields Too Large", [],
                                 f"request larger than {self.max_request} bytes\n".encode())
            return None
        lines = bytes(conn.request[:end]).decode("latin-1").split("\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response("400 Bad Request", [], b"not an HTTP/1.x request\n")
        method, target, version = parts
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", [("Allow", "GET, HEAD")],
                             b"only GET and HEAD\n")
        path, _, query = target.partition("?")
        host, port = self.address[:2]
        environ: dict[str, Any] = {
            "REQUEST_METHOD": "GET", "SCRIPT_NAME": "", "PATH_INFO": unquote(path),
            "QUERY_STRING": query, "SERVER_NAME": str(host), "SERVER_PORT": str(port),
            "SERVER_PROTOCOL": version, "REMOTE_ADDR": conn.peer.rpartition(":")[0],
            "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(),
            "wsgi.errors": io.StringIO(), "wsgi.multithread": False,
            "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                return _response("400 Bad Request", [], b"malformed header line\n")
            environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        got: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], None]:
            got["status"], got["headers"] = status, headers
            return lambda data: None

        try:
            body = b"".join(self.app(environ, start_response))
        except Exception:     # a bug in a collector: worth its traceback, once a scrape
            log.exception("metrics: building the answer to %s failed", conn.peer)
            return _response("500 Internal Server Error", [], b"see the daemon's log\n")
        # prometheus-client 0.16 answers /favicon.ico with the header ('', '')
        headers = [(k, v) for k, v in got["headers"] if k]
        return _response(got["status"], headers, body, head_only=method == "HEAD")

    # -- closing -------------------------------------------------------------------------------
    def _drop(self, conn: _Conn, why: str) -> None:
        log.debug("metrics: cut the connection from %s (%s)", conn.peer, why)
        self._cut[why] += 1
        self._close(conn)
        now = self.clock()
        if self._cut_logged_at is None or now - self._cut_logged_at >= CUT_LOG_INTERVAL:
            slow, over = self._cut["slow"], self._cut["over the cap"]
            counts = ([f"{slow} too slow (a request and its answer must take under "
                       f"{self.deadline:g} s)"] if slow else []) + \
                ([f"{over} over the cap of {self.max_connections} at once"] if over else [])
            since = "" if self._cut_logged_at is None else \
                f" in the last {now - self._cut_logged_at:.0f} s"
            log.warning("metrics endpoint: cut connections%s: %s", since, ", ".join(counts))
            self._cut_logged_at = now
            self._cut = dict.fromkeys(self._cut, 0)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _close_all(self) -> None:
        for conn in self._conns.values():
            conn.sock.close()
        self._conns.clear()
        self._sel.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()


def _response(status: str, headers: list[tuple[str, str]], body: bytes,
              head_only: bool = False) -> bytes:
    head = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
    if not any(k.lower() == "content-type" for k, _ in headers):
        head.append("Content-Type: text/plain; charset=utf-8")
    head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + (b"" if head_only else body)
