"""A fault-injecting HTTP proxy in front of an S3 server: the answers a store gives when it is
busy or the credentials expired, for real clients over a real connection.

    python -m tests.testbed.s3_fault LISTEN_PORT UPSTREAM_PORT MODE N

MODE ``slowdown``: the first N requests get 503 SlowDown (with Retry-After: 1), then every request
is forwarded unchanged (the Host header too: the signature covers it). MODE ``expired``: every
request gets S3's ExpiredToken answer. The count of requests seen is in the log.
"""

from __future__ import annotations

import http.client
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate.", {"Retry-After": "1"}),
    "expired": (400, "ExpiredToken", "The provided token has expired.", {}),
}


def main() -> None:
    listen, upstream, mode, limit = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                     int(sys.argv[4]))
    seen = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._answer()

        def do_HEAD(self) -> None:
            self._answer()

        def _answer(self) -> None:
            with lock:
                seen[0] += 1
                n = seen[0]
            print(f"request {n}: {self.command} {self.path}", flush=True)
            if mode == "expired" or n <= limit:
                status, code, message, extra = ERRORS[mode]
                body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                        f"<Message>{message}</Message></Error>").encode()
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                return
            conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            r = conn.getresponse()
            self.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in ("connection", "keep-alive", "transfer-encoding"):
                    self.send_header(k, v)
            self.end_headers()
            while self.command != "HEAD" and (chunk := r.read(1 << 20)):
                self.wfile.write(chunk)
            conn.close()

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("0.0.0.0", listen), Handler).serve_forever()


if __name__ == "__main__":
    main()
