"""A threaded Python origin, the shape of the team's server in issue 25: ``http.server``'s
``ThreadingHTTPServer``, a thread per connection, each body sent with ``sendall`` in small
chunks. Its threads share one interpreter lock, so it slows each connection as connections
grow, and past some count its aggregate falls: the path on which a chosen stream count must
not settle beyond the best one.

GET and HEAD of files under ROOT, one byte range (206, Content-Range) or the whole file (200),
an ETag, keep-alive (HTTP/1.1).

    python -m tests.testbed.threaded_origin ROOT PORT [CHUNK]
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[first, last] of ``bytes=a-b`` (or ``a-``) within ``size``; None: the whole file.

    >>> byte_range("bytes=10-19", 100), byte_range("bytes=90-", 100), byte_range(None, 5)
    ((10, 19), (90, 99), None)
    """
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[len("bytes="):].partition("-")
    a = int(first)
    b = min(int(last), size - 1) if last else size - 1
    return a, b


def handler(root: Path, chunk: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = (root / unquote(urlsplit(self.path).path).lstrip("/")).resolve()
            if root not in path.parents or not path.is_file():
                self.send_error(404)
                return
            st = path.stat()
            rng = byte_range(self.headers.get("Range"), st.st_size)
            first, last = rng if rng is not None else (0, st.st_size - 1)
            if first > last:
                self.send_error(416)
                return
            self.send_response(206 if rng is not None else 200)
            if rng is not None:
                self.send_header("Content-Range", f"bytes {first}-{last}/{st.st_size}")
            self.send_header("Content-Length", str(last - first + 1))
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if not body:
                return
            with open(path, "rb") as f:
                f.seek(first)
                left = last - first + 1
                while left:
                    data = f.read(min(chunk, left))
                    if not data:
                        return
                    self.connection.sendall(data)
                    left -= len(data)

    return Handler


def main(argv: list[str]) -> int:
    root, port = Path(argv[0]).resolve(), int(argv[1])
    chunk = int(argv[2]) if len(argv) > 2 else 8192
    server = ThreadingHTTPServer(("0.0.0.0", port), handler(root, chunk))
    server.daemon_threads = True
    print(f"serving {root} on {port}, {chunk}-byte sendall", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
