"""``Client.lines``: a streamed document (a neighbour's have-map) read line by line as its chunks
arrive, against a real HTTP server on loopback that sends them when the test says."""

from __future__ import annotations

import http.server
import queue
import threading
import time
from collections.abc import Iterator

import pytest

from agent.policy.model import Source
from agent.pull.client import Client
from agent.pull.connections import Connections
from agent.pull.deadlines import Timeouts
from agent.pull.errors import FetchError


@pytest.fixture
def server() -> Iterator[tuple[str, queue.Queue[bytes | None]]]:
    """An address and the chunks its one answer sends, in order (None: the body ends)."""
    chunks: queue.Queue[bytes | None] = queue.Queue()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            while (c := chunks.get(timeout=10)) is not None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
            self.wfile.write(b"0\r\n\r\n")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", chunks
    finally:
        chunks.put(None)
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def lines(server):
    """``lines(limit, idle)``: the server's answer read by ``Client.lines``, and its chunks."""
    url, chunks = server
    c = Client(Source(url), Timeouts(connect=2, read=5), connections=Connections())
    try:
        yield (lambda limit, idle: c.lines(f"{url}/have", limit, idle)), chunks
    finally:
        c.close()


def test_each_line_comes_as_soon_as_its_chunk_does_and_the_body_ends_them(lines):
    read, chunks = lines
    chunks.put(b'{"a": 1}\n')
    got = read(1024, 5)
    assert next(got) == b'{"a": 1}'                  # the next chunk isn't waited for
    chunks.put(b'{"b":')                             # a line split over two chunks
    chunks.put(b' 2}\n{"c": 3}\n')
    assert next(got) == b'{"b": 2}' and next(got) == b'{"c": 3}'
    chunks.put(None)
    assert list(got) == []


def test_a_line_past_its_limit_is_a_failure(lines):
    read, chunks = lines
    chunks.put(b"x" * 2000)
    with pytest.raises(FetchError, match="longer than 1024"):
        list(read(1024, 5))


def test_a_stream_silent_for_its_idle_time_is_cut(lines):
    read, chunks = lines
    chunks.put(b"one\n")
    got = read(1024, 0.5)
    assert next(got) == b"one"
    t0 = time.monotonic()
    with pytest.raises(FetchError):
        next(got)
    assert time.monotonic() - t0 < 3
