"""The piece server: what a node's neighbours (and, on a cache node, its cluster) fetch from it.

It serves the origin's layout, so a peer is just another source to the pull's client, and
what a neighbour needs to choose its next piece (``agent.pull.picker``)::

    GET /{model}/latest                         the version in flight, else the newest complete
    GET /{model}/{version}/manifest.json        the manifest (of a version in flight too)
    GET /{model}/{version}/{path}  Range: ...    bytes of a file, verified pieces only
    GET /.wagent/have/{model}/{version}         the have-map: pieces verified here, per file,
                                                a line now and one at each change (a stream)
    GET /.wagent/look/{model}                   the cluster's cache started a version of the
                                                model: poll now (``agent.pull.tell``)

A file's bytes come from its blob when the store has it, else from its partial file, and only
pieces verified and journaled (``agent.pull.demand``). Headers go out once the first piece is
there; a server that can't go on mid-body closes the connection, and the client keeps every
piece it verified. Bytes go by ``sendfile`` (no copy through Python) within ``peers.upload``
(a token bucket) and the HTB egress class the backoff moves, like every distribution byte.

Who waits, and for what (``agent.peers.swarm`` says why):

* a **neighbour in the swarm** is never held: it asks for what the have-map listed, and a
  piece that isn't here after all is 503 at once. Pieces go out ``SEND_AT_ONCE`` at a time;
  one more request is 429 at once, and the neighbour asks another holder. (A node that held
  its neighbours' streams while its own waited on them could deadlock with them.)
* a **cache** (a node outside the swarm) waits on no node: it holds its cluster's requests
  until the piece lands (up to ``peers.wait``; the piece goes first in its pull), and only
  then queues them for its send slots: its uplink is the cluster's way in, and it must
  never idle, nor keep a piece that is here waiting behind one that is not.
* anyone else is held while a stream here has the piece in hand.

Bounded: at most ``peers.connections`` connections at once (more are closed at once: the
client asks its next source), an idle keep-alive connection closed after ``IDLE``; names only
from a manifest (``agent.peers.catalog``).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from agent.manifest import FileEntry, Piece
from agent.peers.catalog import Catalog, Offer
from agent.peers.swarm import SEND_AT_ONCE
from agent.pull.demand import Demand, NotYet
from agent.store import Store
from agent.yielding.ratelimit import TokenBucket

log = logging.getLogger(__name__)

IDLE = 15.0
SEND_CHUNK = 256 * 1024      # what one sendfile may send between two takes from the bucket
# A request held for a piece in flight here is looked at again this often: once no stream has
# it in hand (its source failed it, or it was put aside), the client hears 503 and asks later.
HOLD_CHECK = 0.1
HAVE_POLL = 5.0              # a have-map stream sends a line within this, changed or not
HAVE_COALESCE = 0.05         # ...and this long after a change, to take in the ones that follow
HAVE_STREAM = 60.0           # and ends after this (the neighbour asks again)
# How long a request waits for its piece (``PeerServer.where``): not at all, while a stream
# here has it in hand, or until it lands (up to peers.wait)
NO, IN_HAND, ANY = "", "in hand", "any"
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{0,19})$")


@dataclass
class Served:
    """What the server sent, for status and metrics (under the server's lock)."""

    bytes: int = 0
    requests: int = 0
    waited: int = 0                  # pieces served from a partial file (still being pulled)
    refused: int = 0                 # 404/503/closed for want of a piece or a connection
    busy: int = 0                    # 429: sending a piece to another peer already


class PeerServer:
    """``store``: the daemon's store now; ``wait``: ``peers.wait`` now."""

    def __init__(self, listen: str, port: int, catalog: Catalog, demand: Demand,
                 store: Callable[[], Store], *, upload: TokenBucket,
                 wait: Callable[[], float], max_connections: int,
                 is_peer: Callable[[str], bool] = lambda address: False,
                 in_swarm: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.demand = demand
        self.store = store
        self.upload = upload
        self.wait = wait
        self.is_peer = is_peer
        self.in_swarm = in_swarm
        self.clock = clock
        self.served = Served()
        self.lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        # A few pieces at a time to the swarm, each near the link's rate (agent.peers.swarm).
        self.sending = threading.BoundedSemaphore(SEND_AT_ONCE)
        self._stop = threading.Event()
        server = self
        family = socket.AF_INET6 if ":" in listen else socket.AF_INET

        class _Server(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            request_queue_size = 128

            def process_request(self, request: socket.socket, client: object) -> None:
                if not server._slots.acquire(blocking=False):
                    with server.lock:
                        server.served.refused += 1
                    self.shutdown_request(request)
                    return
                super().process_request(request, client)

            def handle_error(self, request: object, client: object) -> None:
                # A client that went away (a neighbour restarted, a pull cut a request) is
                # no news; anything else is a bug worth its traceback, once per request.
                e = sys.exc_info()[1]
                if isinstance(e, OSError):
                    log.debug("peer %s: %s", client, e)
                else:
                    log.exception("serving peer %s", client)

            def process_request_thread(self, request: socket.socket, client: object) -> None:
                try:
                    super().process_request_thread(request, client)
                finally:
                    server._slots.release()

        self.httpd = _Server((listen, port), _handler(self))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.5,),
                                        name="peer-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def count(self, **add: int) -> None:
        with self.lock:
            for k, v in add.items():
                setattr(self.served, k, getattr(self.served, k) + v)

    # -- the bytes of a file ------------------------------------------------------------------
    def where(self, blob: str, f: FileEntry, piece: Piece, offer: Offer, hold: str = IN_HAND
              ) -> str | None:
        """"blob" or "part" once ``piece`` is verified here; None when it won't come soon
        (it is put first in this node's pull all the same, and the client asks again).

        ``hold`` says how long the request may wait (never beyond ``peers.wait``): ``NO``, a
        neighbour's (it asked for what the have-map listed; held, its stream could wait on
        this node while this node's streams wait on it); ``IN_HAND``, while one of this
        node's streams is receiving the piece (that stream waits on no one who waits here);
        ``ANY``, until it lands (a cache's: it waits on no node of its cluster)."""
        store = self.store()

        def in_blob() -> bool:
            return store.has_blob(blob, f.size)

        deadline = self.clock() + self.wait()
        # A version in flight whose transfer hasn't started yet (its plan, its reservation):
        # its blobs attach in a moment.
        while not self.demand.pulling(blob) and not in_blob():
            if not hold or not offer.in_flight or self.clock() >= deadline \
                    or self._stop.wait(0.05):
                return None
        if not hold:
            deadline = self.clock()
        while True:
            try:
                return self.demand.wait(blob, piece, min(deadline, self.clock() + HOLD_CHECK),
                                        in_blob, lambda: "not in time", waiting=False)
            except NotYet:
                pass
            if not hold or self.clock() >= deadline or self._stop.is_set() \
                    or (hold == IN_HAND and not self.demand.fetching(blob, piece)):
                return None

    def have_map(self, offer: Offer) -> dict[str, str]:
        """blob id -> hex bitmap of its verified pieces (bit i: piece i, most significant
        first), for every file of the version with at least one."""
        store = self.store()
        out: dict[str, str] = {}
        for blob, f in offer.blobs:
            if store.has_blob(blob, f.size):
                done = None
            else:
                done = self.demand.verified(blob)
                if not done:
                    continue
            bits = bytearray((len(f.pieces) + 7) // 8)
            for i, p in enumerate(f.pieces):
                if done is None or p.offset in done:
                    bits[i // 8] |= 0x80 >> (i % 8)
            out[blob] = bits.hex()
        return out

    def open(self, blob: str, where: str) -> int | None:
        store = self.store()
        paths = [store.partial / f"{blob}.part"] if where == "part" else []
        paths.append(store.blob_path(blob))        # a part file renamed into blobs/ since
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                return os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        return None

    def send(self, sock: socket.socket, fd: int, offset: int, size: int) -> None:
        # os.sendfile on the socket made blocking, the wait bounded by SO_SNDTIMEO: the kernel
        # sends each chunk whole in one call. socket.sendfile on a socket with a timeout (non-
        # blocking underneath) polls, and wakes this thread each time a third of the send
        # buffer frees: with the small windows the pulls' receivers advertise (a millisecond
        # of the link; agent.yielding.sockets), a wakeup every few kilobytes. (On the emulated
        # cluster the CPU it saved was within the noise: the receivers' wakeups are the cost.)
        timeout = sock.gettimeout()
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(IDLE), 0))
        try:
            while size > 0:
                n = min(size, SEND_CHUNK)
                self.upload.consume(n, self._stop)
                try:
                    sent = os.sendfile(sock.fileno(), fd, offset, n)
                except BlockingIOError:           # SO_SNDTIMEO passed with nothing sent
                    raise TimeoutError(f"nothing sent for {IDLE:g} s") from None
                if sent <= 0:
                    raise ConnectionError("the file ended early")
                offset += sent
                size -= sent
                self.count(bytes=sent)
        finally:
            sock.settimeout(timeout)


def _handler(server: PeerServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "wagent-peer"
        timeout = IDLE

        def log_message(self, format: str, *args: object) -> None:
            log.debug("peer %s: " + format, self.client_address[0], *args)

        def do_HEAD(self) -> None:
            self._get(head=True)

        def do_GET(self) -> None:
            self._get(head=False)

        def _answer(self, code: int, body: bytes = b"", head: bool = False,
                    headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and not head:
                self.wfile.write(body)
            if code >= 400:
                server.count(refused=1)

        def _get(self, head: bool) -> None:
            server.count(requests=1)
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/") if p]
            if len(parts) == 4 and parts[:2] == [".wagent", "have"]:
                return self._have(parts[2], parts[3], head)
            if len(parts) == 3 and parts[:2] == [".wagent", "look"]:
                if not server.catalog.look_when_told(parts[2]):
                    return self._answer(404, b"not a model pulled here\n", head)
                return self._answer(200, b"looking\n", head, {"Content-Type": "text/plain"})
            if len(parts) == 2 and parts[1] == "latest":
                version = server.catalog.latest(parts[0])
                if version is None:
                    return self._answer(404, b"no version\n", head)
                return self._answer(200, f"{version}\n".encode(), head,
                                    {"Content-Type": "text/plain", "Cache-Control": "no-store"})
            if len(parts) < 3:
                return self._answer(404, b"not found\n", head)
            model, version, path = parts[0], parts[1], "/".join(parts[2:])
            offer = server.catalog.find(model, version)
            if offer is None and server.catalog.look_now(model):
                # A cache asked for a version it hasn't seen: it looks at once (pull-through),
                # and the request waits for its pull to start.
                deadline = server.clock() + server.wait()
                while offer is None and server.clock() < deadline \
                        and not server._stop.wait(0.1):
                    offer = server.catalog.find(model, version)
            if offer is None:
                return self._answer(404, b"version not here\n", head)
            if path == "manifest.json":
                return self._answer(200, offer.raw, head, {"Content-Type": "application/json"})
            found = server.catalog.blob_of(offer, path)
            if found is None:
                return self._answer(404, b"no such file\n", head)
            f, blob = found
            start, end = 0, f.size - 1
            ranged = self.headers.get("Range")
            if ranged is not None:
                m = _RANGE.match(ranged.strip())
                if m is None or int(m.group(1)) >= max(1, f.size):
                    return self._answer(416, b"", head, {"Content-Range": f"bytes */{f.size}"})
                start = int(m.group(1))
                end = min(f.size - 1, int(m.group(2))) if m.group(2) else f.size - 1
                if end < start:
                    return self._answer(416, b"", head, {"Content-Range": f"bytes */{f.size}"})
            pieces = [p for p in f.pieces if p.offset <= end and p.offset + p.size > start]
            if f.size == 0 or not pieces:
                return self._answer(200, b"", head)
            # A neighbour in the swarm asks for what this node's have-map listed: never held
            # (a node holding its neighbours' streams while its own wait on them could
            # deadlock with them), and answered 429 while this node sends its share of
            # pieces already: it asks another holder. A cache (outside the swarm) holds the
            # peers' requests for the pieces it is fetching, and queues them for its send
            # slots: it waits on no node, and its uplink is the cluster's one way in.
            peer = server.is_peer(self.client_address[0])
            swarmed = peer and server.in_swarm()
            first: str | None = None
            if peer and not swarmed and not head:
                # A cache waits for the piece before it takes a send slot: a slot held for a
                # piece still on its way from the origin kept the pieces already here (and
                # their nodes, and every node behind those) waiting, while the uplink sent
                # fewer pieces at once than it could.
                first = server.where(blob, f, pieces[0], offer, hold=ANY)
                if first is None:
                    return self._answer(503, b"not verified here in time\n", head,
                                        {"Retry-After": "1"})
            if peer:
                got = server.sending.acquire(blocking=False) if swarmed \
                    else server.sending.acquire(timeout=server.wait())
                if not got:
                    server.count(busy=1)
                    return self._answer(429, b"sending\n", head, {"Retry-After": "1"})
            # How long a request may wait here for its piece: a node outside the swarm (a
            # cache) waits on no node, so it holds any request until the piece lands; a
            # swarm member holds a non-peer's only while the piece is in hand, a peer's not.
            hold = ANY if not server.in_swarm() else NO if peer else IN_HAND
            try:
                self._send_file(f, blob, offer, pieces, start, end, ranged, head, hold, first)
            finally:
                if peer:
                    server.sending.release()
            return None

        def _send_file(self, f: FileEntry, blob: str, offer: Offer, pieces: list[Piece],
                       start: int, end: int, ranged: str | None, head: bool,
                       hold: str, first: str | None = None) -> None:
            """``first``: where the first piece is, when the caller waited for it already."""
            if first is None:
                first = server.where(blob, f, pieces[0], offer, hold=hold)
            if first is None:
                return self._answer(503, b"not verified here in time\n", head,
                                    {"Retry-After": "1"})
            if first != "blob":
                server.count(waited=1)
            self.send_response(206 if ranged is not None else 200)
            if ranged is not None:
                self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if head:
                return None
            self.wfile.flush()
            where: str | None = first
            for i, p in enumerate(pieces):
                if i:
                    where = server.where(blob, f, p, offer, hold=hold)
                if where is None:
                    # Headers are out: only a short body can say it. The child keeps what it
                    # verified and asks the next source for the rest.
                    server.count(refused=1)
                    self.close_connection = True
                    return None
                fd = server.open(blob, where)
                if fd is None:
                    self.close_connection = True
                    return None
                try:
                    lo, hi = max(start, p.offset), min(end + 1, p.offset + p.size)
                    server.send(self.connection, fd, lo, hi - lo)
                finally:
                    os.close(fd)
            return None

        def _have(self, model: str, version: str, head: bool) -> None:
            """The version's have-map, followed: for each of its files being pulled or held
            here, the pieces verified, as a bitmap in the manifest's piece order (hex), one
            JSON line at once and one more each time pieces land (a chunk each, so a neighbour
            hears of a piece when it lands), or after ``HAVE_POLL`` seconds without one (the
            client's sign that the connection lives); the stream ends after ``HAVE_STREAM``
            seconds, or when the version goes. One request per neighbour for the whole pull:
            a long poll per change cost a request (and a thread's wakeups at both ends) per
            landing, to every neighbour, the larger part of a node's CPU in a swarm."""
            offer = server.catalog.find(model, version)
            if offer is None:
                return self._answer(404, b"version not here\n", head)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Cache-Control", "no-store")
            if head:
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            until = time.monotonic() + HAVE_STREAM
            gen = server.demand.generation
            while offer is not None and not server._stop.is_set():
                line = json.dumps({"gen": gen, "have": server.have_map(offer)}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                left = until - time.monotonic()
                if left <= 0:
                    break
                if server.demand.changed(gen, min(HAVE_POLL, left)) != gen:
                    # Pieces land in bursts (a file's last, a batch synced together): one
                    # line for the burst, not one per piece.
                    server._stop.wait(HAVE_COALESCE)
                gen = server.demand.generation
                offer = server.catalog.find(model, version)
            self.wfile.write(b"0\r\n\r\n")
            return None

    return Handler
