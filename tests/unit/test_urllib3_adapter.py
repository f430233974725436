"""The urllib3 members agent/pull/urllib3_adapter.py relies on, checked on the installed urllib3
(2.x in the venv, Debian 12's 1.26 under /usr/bin/python3): a release that renames, removes or
reshapes one fails here, naming the member and the version, instead of a pull silently losing
its deadlines, its receive windows or its zero-copy reads. Then the adapter itself against a real
loopback server, a raw socket one so that it can send what nginx would not (103 Early Hints)."""

from __future__ import annotations

import contextlib
import http.client
import inspect
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests
import urllib3
import urllib3.connection
import urllib3.connectionpool
import urllib3.response
from requests.adapters import HTTPAdapter

from agent.pull import urllib3_adapter as adapter
from agent.pull.connections import Connections
from agent.pull.deadlines import Watch
from agent.yielding.sockets import PullSockets

VERSIONS = f"urllib3 {urllib3.__version__}, requests {requests.__version__}"


def relied_on(member: str, problem: str) -> str:
    return (f"{VERSIONS}: {member} {problem}; agent/pull/urllib3_adapter.py relies on it "
            "(adapt the adapter to this release)")


def method(owner: type, name: str, params: tuple[str, ...] = ()) -> None:
    member = f"{owner.__module__}.{owner.__qualname__}.{name}"
    fn = getattr(owner, name, None)
    assert callable(fn), relied_on(member, "is gone")
    names = list(inspect.signature(fn).parameters)
    for p in params:
        assert p in names, relied_on(member, f"takes no {p!r} any more (it takes {names})")


# -- the members, by their shape ---------------------------------------------------------------
@pytest.mark.parametrize("pool", [urllib3.connectionpool.HTTPConnectionPool,
                                  urllib3.connectionpool.HTTPSConnectionPool])
def test_a_pool_hands_out_connections_through_get_conn_and_makes_them_of_connectioncls(pool):
    method(pool, "_get_conn", ("self", "timeout"))
    assert isinstance(getattr(pool, "ConnectionCls", None), type), \
        relied_on(f"{pool.__qualname__}.ConnectionCls", "is not a class attribute")


@pytest.mark.parametrize("conn", [urllib3.connection.HTTPConnection,
                                  urllib3.connection.HTTPSConnection])
def test_a_connection_is_http_clients_with_connect_sock_and_response_class(conn):
    # http.client's connection is what gives .sock (after connect) and response_class.
    assert issubclass(conn, http.client.HTTPConnection), \
        relied_on(conn.__qualname__, "is no longer an http.client.HTTPConnection")
    method(conn, "connect", ("self",))
    assert issubclass(conn.response_class, http.client.HTTPResponse), \
        relied_on(f"{conn.__qualname__}.response_class", "is not http.client's HTTPResponse")


def test_http_clients_response_reads_its_status_and_reads_into_a_buffer():
    method(http.client.HTTPResponse, "_read_status", ("self",))
    assert len(inspect.signature(http.client.HTTPResponse._read_status).parameters) == 1, \
        relied_on("http.client.HTTPResponse._read_status", "takes arguments now")
    method(http.client.HTTPResponse, "readinto", ("self", "b"))
    method(http.client.HTTPResponse, "isclosed", ("self",))


def test_a_urllib3_response_releases_its_connection_and_reads_raw():
    method(urllib3.response.HTTPResponse, "release_conn", ("self",))
    method(urllib3.response.HTTPResponse, "read", ("self", "amt", "decode_content"))


def test_the_pool_managers_look_pools_up_in_pool_classes_by_scheme():
    method(HTTPAdapter, "init_poolmanager")
    method(HTTPAdapter, "proxy_manager_for", ("self", "proxy"))
    pools = {"http": object, "https": object}
    a = adapter.PoolsAdapter(pools)
    got = getattr(a.poolmanager, "pool_classes_by_scheme", None)
    assert got is pools, relied_on("PoolManager.pool_classes_by_scheme", "is not used any more")
    manager = a.proxy_manager_for("http://127.0.0.1:9")
    assert manager.pool_classes_by_scheme is pools, \
        relied_on("ProxyManager.pool_classes_by_scheme", "is not used any more")
    a.close()


# -- the adapter against a real server ---------------------------------------------------------
class RawServer:
    """Answers each request on a connection with ``reply`` (whole, as bytes); counts
    connections."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._open: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            self._threads.append(threading.Thread(target=self._answer, args=(conn,),
                                                  daemon=True))
            self._threads[-1].start()

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\r\n\r\n" in buf:
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    conn.sendall(self.reply)
        except OSError:
            return

    def close(self) -> None:
        # shutdown, not close alone: it wakes the threads blocked in accept and recv.
        for sock in [self.sock, *self._open]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)
        for sock in [self.sock, *self._open]:
            sock.close()


BODY = b"x" * 5000
PLAIN = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY
HINTED = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n" + PLAIN
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n0\r\n\r\n")


@pytest.fixture
def serve() -> Iterator:
    servers: list[RawServer] = []

    def make(reply: bytes) -> RawServer:
        servers.append(RawServer(reply))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def session() -> Iterator:
    made: list[tuple[requests.Session, Connections]] = []

    def make() -> tuple[requests.Session, Connections]:
        c = Connections(PullSockets())
        s = requests.Session()
        s.mount("http://", c.adapter())
        made.append((s, c))
        return s, c

    yield make
    for s, _ in made:
        s.close()


def test_the_request_gets_its_connection_and_the_registry_its_socket(serve, session):
    srv = serve(PLAIN)
    s, c = session()
    w = Watch(10.0, "the response headers", None, 0.0)
    with c.requesting(w), s.get(srv.url, stream=True) as r:
        assert isinstance(getattr(w.conn, "sock", None), socket.socket), \
            relied_on("HTTPConnectionPool._get_conn", "no longer hands out the connection used")
        assert c.sockets.sample().streams == 1, \
            relied_on("HTTPConnection.connect", "is not where the socket is made any more")
        assert adapter.socket_of(r.raw) is w.conn.sock, \
            relied_on("HTTPResponse._connection", "no longer holds the connection")
        # socket_of's other way, for a response whose connection urllib3 no longer names.
        assert r.raw._fp.fp.raw._sock is w.conn.sock, \
            relied_on("HTTPResponse._fp.fp.raw._sock", "does not lead to the socket any more")


def test_the_body_is_read_straight_into_a_buffer_and_its_connection_reused(serve, session):
    srv = serve(PLAIN)
    s, _ = session()
    for one in (False, True):          # a whole buffer per read, then one receive per read
        r = s.get(srv.url, stream=True)
        readinto = adapter.readinto_of(r.raw)
        assert readinto is not None, relied_on("HTTPResponse._fp.readinto", "is gone")
        if one:
            # One receive per call, with http.client's own length and close kept by hand.
            fp = r.raw._fp
            assert isinstance(fp.length, int) and not fp.chunked, \
                relied_on("http.client.HTTPResponse.length/chunked", "are not what they were")
            assert callable(fp._close_conn) and callable(fp.fp.readinto1), \
                relied_on("http.client.HTTPResponse._close_conn/fp.readinto1", "are gone")
            readinto = adapter.readinto1_of(r.raw)
            assert readinto is not None
        buf = bytearray(len(BODY))
        view, got = memoryview(buf), 0
        while got < len(BODY):
            n = readinto(view[got:])
            assert n, "the body ended early"
            got += n
        assert bytes(buf) == BODY
        assert adapter.read_to_its_length(r.raw), \
            relied_on("HTTPResponse._fp.isclosed", "is not true once the body is read")
        adapter.release(r.raw)
    assert srv.connections == 1, relied_on("HTTPResponse.release_conn",
                                           "did not hand the connection back to its pool")


def test_a_body_without_length_is_read_through_urllib3(serve, session):
    srv = serve(CHUNKED)
    s, _ = session()
    with s.get(srv.url, stream=True) as r:
        assert adapter.readinto_of(r.raw) is None and adapter.readinto1_of(r.raw) is None
        assert adapter.socket_of(r.raw) is not None
        assert r.raw.read(100, decode_content=False) == b"hello"


def test_control_without_the_adapter_a_hint_is_taken_for_the_answer(serve):
    # What FinalResponse is for: plain requests stops at the 103 (while http.client does so).
    srv = serve(HINTED)
    with requests.Session() as s, s.get(srv.url, stream=True) as r:
        if r.status_code == 200:
            pytest.skip(f"http.client skips informational responses itself on {VERSIONS}")
        assert r.status_code == 103


def test_informational_responses_are_skipped(serve, session):
    srv = serve(HINTED)
    s, _ = session()
    with s.get(srv.url, stream=True) as r:
        assert r.status_code == 200, relied_on("http.client.HTTPResponse._read_status",
                                               "is not called through response_class any more")
        assert r.raw.read(len(BODY) + 1, decode_content=False) == BODY


def test_each_owner_has_its_own_pools():
    a, b = Connections(PullSockets()), Connections(PullSockets())
    assert a.adapter().pools["http"] is not b.adapter().pools["http"]
    assert a.adapter().pools is a.adapter().pools


@contextlib.contextmanager
def halves(first: bytes, second: bytes) -> Iterator[tuple[str, threading.Event]]:
    """A server that answers one request with ``first``, then ``second`` once the event is
    set."""
    listener = socket.create_server(("127.0.0.1", 0))
    more = threading.Event()

    def answer() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.sendall(first)
            if more.wait(5):
                conn.sendall(second)
            with contextlib.suppress(OSError):
                conn.recv(1)                     # until the client is done
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/", more
    finally:
        more.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        t.join(5)


def test_a_held_reader_waits_for_bytes_without_taking_them(session):
    """``OneReceive.ready``: once http.client's buffer provably holds nothing of the body, it
    waits on the socket until bytes are there and takes none (a reader the fast path holds
    leaves them there, its window where it was); before, it can't know and says so."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 20000\r\n\r\n"
    s, _ = session()
    with halves(head + b"a" * 10000, b"b" * 10000) as (url, more), \
            s.get(url, stream=True, timeout=5) as r:
        one = adapter.readinto1_of(r.raw)
        assert one is not None and not one.ready()   # the header's read may have read body too
        buf, got = memoryview(bytearray(20000)), 0
        while got < 10000:
            got += one(buf[got:])
        threading.Timer(0.1, more.set).start()
        started = time.monotonic()
        assert one.ready() and time.monotonic() - started >= 0.05   # waited for the second half
        sock = adapter.socket_of(r.raw)
        assert sock is not None and sock.recv(1, socket.MSG_PEEK) == b"b"   # still there
        while got < 20000:
            got += one(buf[got:])
        assert bytes(buf) == b"a" * 10000 + b"b" * 10000


def test_a_held_readers_wait_ends_at_the_read_timeout(session):
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 20000\r\n\r\n"
    s, _ = session()
    with halves(head + b"a" * 10000, b"") as (url, _more), \
            s.get(url, stream=True, timeout=(5, 0.2)) as r:
        one = adapter.readinto1_of(r.raw)
        assert one is not None
        buf, got = memoryview(bytearray(20000)), 0
        while got < 10000:
            got += one(buf[got:])
        with pytest.raises(TimeoutError):
            one.ready()                          # as the receive itself would have raised
        assert adapter.describe(TimeoutError("timed out")) == "timed out reading"
