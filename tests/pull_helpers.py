"""Real servers for pull tests on loopback: nginx, and a small HTTP server with chosen faults.

The faulty server is a real HTTP/1.1 server (http.server) that serves byte ranges of files under a
root, and misbehaves on purpose for requests matching ``fault_on``: more or fewer bytes than asked,
a wrong Content-Range, a 200 to a Range request, corrupted bytes, a changed ETag, a 500, a gzip
body (a server compressing despite ``Accept-Encoding: identity``), a body that stalls half way, a
body that trickles (a few bytes every fraction of a second, each well inside any read timeout), a
Content-Range naming another file size; ETags that differ per request for identical bytes (backends
behind a load balancer), a file whose bytes changed. Faults in ``ANY_REQUEST`` also hit requests
without a Range (manifest, ``latest``): headers trickled a byte at a time, a body trickled, a gzip
bomb.
"""

from __future__ import annotations

import gzip
import http.server
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import zlib
from pathlib import Path

from agent import manifest
from agent.pull.connections import Connections

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type application/octet-stream;
    log_format bytes '$request_uri $status $body_bytes_sent $connection';
    access_log {dir}/access.log bytes;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        etag on;
        disable_symlinks off;
        {extra}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackNginx:
    """nginx serving ``root`` on 127.0.0.1 (started and stopped by this object)."""

    def __init__(self, root: Path, limit_rate: str | None = None, tls: bool = False,
                 forward_proxy: bool = False) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="wagent-nginx-"))
        self.tls = tls
        extra = f"limit_rate {limit_rate};" if limit_rate else ""
        if tls:
            # A self-signed certificate for 127.0.0.1; ``ca_bundle`` is the file to trust.
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                            "2", "-subj", "/CN=127.0.0.1", "-addext",
                            "subjectAltName=IP:127.0.0.1", "-keyout", str(self.dir / "key.pem"),
                            "-out", str(self.dir / "cert.pem")], check=True,
                           capture_output=True)
            extra += (f"ssl_certificate {self.dir}/cert.pem; "
                      f"ssl_certificate_key {self.dir}/key.pem;")
        if forward_proxy:
            # An HTTP proxy: requests arrive with absolute URIs, go on to the host they name.
            extra += "location / { proxy_pass http://$http_host; }"
        (self.dir / "nginx.conf").write_text(NGINX_CONF.format(
            dir=self.dir, port=f"{self.port}{' ssl' if tls else ''}", root=self.root.resolve(),
            extra=extra))
        user = "user root;\n" if os.geteuid() == 0 else ""
        if user:
            conf = self.dir / "nginx.conf"
            conf.write_text(user + conf.read_text())
        self.proc = subprocess.Popen(["nginx", "-c", str(self.dir / "nginx.conf"),
                                      "-p", str(self.dir), "-e", str(self.dir / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("nginx did not start: "
                                       + (self.dir / "error.log").read_text()) from None
                time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_bundle(self) -> str:
        return str(self.dir / "cert.pem")

    def bytes_sent(self, prefix: str = "") -> int:
        total = 0
        log = self.dir / "access.log"
        if log.exists():
            for line in log.read_text().splitlines():
                uri, _, sent, _ = line.split(" ")
                if uri.startswith(prefix):
                    total += int(sent)
        return total

    def connections(self) -> int:
        """How many TCP connections served the requests logged so far."""
        log = self.dir / "access.log"
        return len({line.split(" ")[3] for line in log.read_text().splitlines()}) \
            if log.exists() else 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LoopbackNginx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FAULTS = ("more", "more_unframed", "fewer", "bad_range", "full_200", "corrupt", "etag_change",
          "error_500", "gzip", "stall", "trickle", "other_total", "etag_flap", "changed",
          "slow_headers", "slow_body", "gzip_bomb", "gzipped", "busy_503", "early_hints")
# Faults that also hit requests without a Range header (the others only hit ranged ones).
ANY_REQUEST = ("slow_headers", "slow_body", "gzip_bomb", "gzipped", "busy_503", "early_hints")
_BOMBS: dict[int, bytes] = {}


def gzip_bomb(size: int) -> bytes:
    """``size`` zero bytes gzipped (about a thousandth of it), made once per size."""
    if size not in _BOMBS:
        c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        block = bytes(2**20)
        parts = [c.compress(block) for _ in range(size // len(block))]
        _BOMBS[size] = b"".join([*parts, c.flush()])
    return _BOMBS[size]


class FaultyServer:
    """A ranged file server on 127.0.0.1; ``fault`` applies to requests whose path matches
    ``fault_on`` (a regex) after the first ``after`` of them, ``times`` times (None: always).
    ``auth``: the Authorization header every request must carry (else 401). ``header_pad``: bytes
    of padding in the headers that "slow_headers" trickles; ``bomb``: what "gzip_bomb" inflates
    to."""

    def __init__(self, root: Path, fault: str | None = None, fault_on: str = r"\.safetensors$",
                 times: int | None = None, after: int = 0, auth: str | None = None,
                 trickle: tuple[int, float] = (16, 0.05), header_pad: int = 200,
                 bomb: int = 2**30, retry_after: int = 1) -> None:
        assert fault is None or fault in FAULTS
        self.retry_after = retry_after            # what "busy_503" says in Retry-After
        self.root = Path(root)
        self.fault = fault
        self.fault_on = re.compile(fault_on)
        self.times = times
        self.faults_done = 0
        self.after = after
        self.matched = 0
        self.auth = auth
        self.trickle = trickle                    # (bytes, seconds between them) for "trickle"
        self.header_pad = header_pad
        self.bomb = bomb
        self.flaps = 0                            # "etag_flap": which backend answers next
        self.requests: list[tuple[str, str | None, int]] = []   # (path, Range, status)
        self.arrivals: list[tuple[str, float]] = []    # (path, time.monotonic()) of each request
        self.lock = threading.Lock()
        self.etag_generation = 0
        self.unstall = threading.Event()          # set on close: stalled bodies end
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._serve(self)

            def finish(self) -> None:
                try:
                    super().finish()
                except OSError:
                    pass                    # the client went away first: that's its right

        class Server(http.server.ThreadingHTTPServer):
            def shutdown_request(self, request: object) -> None:
                try:
                    super().shutdown_request(request)
                except OSError:
                    pass                    # a socket the fault already broke

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _take_fault(self, path: str) -> str | None:
        with self.lock:
            if not (self.fault and self.fault_on.search(path)):
                return None
            self.matched += 1
            if self.matched > self.after and (self.times is None or self.faults_done < self.times):
                self.faults_done += 1
                return self.fault
        return None

    def _serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        with self.lock:
            self.arrivals.append((path, time.monotonic()))
        file = (self.root / path.lstrip("/")).resolve()
        rng = h.headers.get("Range")
        if self.auth is not None and h.headers.get("Authorization") != self.auth:
            self._send(h, path, rng, 401, b"who are you?")
            return
        if not file.is_file() or not str(file).startswith(str(self.root.resolve())):
            self._send(h, path, rng, 404, b"not found")
            return
        data = file.read_bytes()
        etag = f'"{file.stat().st_size:x}-{self.etag_generation}"'
        fault = self._take_fault(path) if rng or self.fault in ANY_REQUEST else None
        if fault == "busy_503":
            # "come back later", as an overloaded origin or S3's SlowDown says it
            self._send(h, path, rng, 503, b"busy", {"Retry-After": str(self.retry_after)})
            return
        if fault == "early_hints":
            # a 103 before the real answer, as nginx (early_hints) or a CDN sends it
            h.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </m/v1/config.json>; "
                          b"rel=preload\r\n\r\n")
            fault = None
        if fault == "etag_change":
            self.etag_generation += 1
            etag = f'"{file.stat().st_size:x}-{self.etag_generation}"'
            fault = None
        elif fault == "etag_flap":
            # Two backends, identical bytes, each its own ETag (its own mtime): they alternate.
            with self.lock:
                self.flaps += 1
                etag = f'"{len(data):x}-backend{self.flaps % 2}"'
            fault = None
        elif fault == "changed":
            # Republished in place: same size, other bytes, another ETag.
            data, etag = data[1:] + data[:1], f'"{len(data):x}-changed"'
            fault = None
        elif fault == "gzip_bomb":
            self._send(h, path, rng, 200, gzip_bomb(self.bomb), {"Content-Encoding": "gzip"})
            return
        elif fault == "gzipped" and not rng:
            # Compressed despite "Accept-Encoding: identity", in two gzip members.
            half = len(data) // 2
            self._send(h, path, rng, 200, gzip.compress(data[:half]) + gzip.compress(data[half:]),
                       {"Content-Encoding": "gzip"})
            return
        elif fault in ANY_REQUEST and not rng:
            self._slow(h, path, rng, 200, data, {"ETag": etag}, fault)
            return
        if_range = h.headers.get("If-Range")
        m = re.match(r"bytes=(\d+)-(\d+)$", rng or "")
        if fault == "error_500":
            self._send(h, path, rng, 500, b"boom")
            return
        if not m or fault == "full_200" or (if_range is not None and if_range != etag):
            self._send(h, path, rng, 200, data, {"ETag": etag})
            return
        start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
        body = data[start:end + 1]
        cr = f"bytes {start}-{end}/{len(data)}"
        if fault in ("more", "more_unframed"):
            body = body + data[end + 1:end + 1 + 4096] + b"x" * 4096
        elif fault == "fewer":
            body = body[:-100]
        elif fault == "other_total":
            cr = f"bytes {start}-{end}/{len(data) + 1}"
        elif fault == "bad_range":
            cr = f"bytes {start + 1}-{end + 1}/{len(data)}"
        elif fault == "corrupt":
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        headers = {"ETag": etag, "Content-Range": cr}
        if fault == "gzip":
            headers["Content-Encoding"] = "gzip"
            body = gzip.compress(body, 1)
        if fault == "stall":
            # Headers and half the body, then nothing (the connection stays open).
            self._send(h, path, rng, 206, body[:len(body) // 2], headers, length=len(body))
            self.unstall.wait(30)
            return
        if fault == "trickle":
            self._trickle(h, path, rng, body, headers)
            return
        if fault in ANY_REQUEST:
            self._slow(h, path, rng, 206, body, headers, fault)
            return
        if fault == "fewer":
            # Claim the full length, send less, then close: a truncated body.
            self._send(h, path, rng, 206, body, headers, length=end + 1 - start, close=True)
        elif fault == "more_unframed":
            # No Content-Length: the body runs until the connection closes.
            self._send(h, path, rng, 206, body, headers, length=None, close=True)
        else:
            self._send(h, path, rng, 206, body, headers)

    def _slow(self, h: http.server.BaseHTTPRequestHandler, path: str, rng: str | None,
              status: int, body: bytes, headers: dict[str, str], fault: str) -> None:
        if fault == "slow_body":
            self._trickle(h, path, rng, body, headers, status)
            return
        # "slow_headers": the header block (padded) a byte every ``self.trickle[1]`` s, each
        # well inside the read timeout; then the body at once.
        with self.lock:
            self.requests.append((path, rng, status))
        block = (f"HTTP/1.1 {status} {h.responses[status][0]}\r\n"
                 f"X-Pad: {'.' * self.header_pad}\r\n"
                 + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                 + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        h.close_connection = True
        try:
            for i in range(len(block)):
                if self.unstall.wait(self.trickle[1]):
                    return
                h.wfile.write(block[i:i + 1])
                h.wfile.flush()
            h.wfile.write(body)
            h.wfile.flush()
        except OSError:
            pass

    def _trickle(self, h: http.server.BaseHTTPRequestHandler, path: str, rng: str | None,
                 body: bytes, headers: dict[str, str], status: int = 206) -> None:
        """Headers, then ``self.trickle[0]`` bytes every ``self.trickle[1]`` s until the body is
        sent, the client goes away, or the server closes."""
        with self.lock:
            self.requests.append((path, rng, status))
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        step, pause = self.trickle
        try:
            h.wfile.flush()
            for i in range(0, len(body), step):
                if self.unstall.wait(pause):
                    break
                h.wfile.write(body[i:i + step])
                h.wfile.flush()
        except OSError:
            pass
        h.close_connection = True

    def _send(self, h: http.server.BaseHTTPRequestHandler, path: str, rng: str | None,
              status: int, body: bytes, headers: dict[str, str] | None = None,
              length: int | None | bool = True, close: bool = False) -> None:
        with self.lock:
            self.requests.append((path, rng, status))
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if length is True:
            h.send_header("Content-Length", str(len(body)))
        elif length is not None:
            h.send_header("Content-Length", str(length))
        if close:
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        try:
            h.wfile.write(body)
            h.wfile.flush()
        except OSError:
            pass

    def close(self) -> None:
        self.unstall.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FaultyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publish(origin: Path, model: str, version: str, piece_size: int | None = None,
            **gen: object) -> Path:
    """Generate a model at ``origin/model/version`` (tests.modelgen), then publish it."""
    from tests import modelgen
    d = origin / model / version
    modelgen.generate(d, **gen)
    return publish_dir(d, piece_size)


def same_files(store_dir: Path, version_dir: Path) -> None:
    """Every file of the published version reads back byte for byte from the store."""
    for f in version_dir.rglob("*"):
        if f.is_file():
            got = store_dir / f.relative_to(version_dir)
            assert got.read_bytes() == f.read_bytes(), f


def publish_dir(d: Path, piece_size: int | None = None) -> Path:
    """Build ``d/manifest.json`` and name ``d`` in ``{model}/latest``, as a publisher does."""
    manifest.write(d, manifest.build(d, piece_size=piece_size or manifest.DEFAULT_PIECE_SIZE))
    (d.parent / "latest").write_text(d.name + "\n")
    return d


def pull_json(url: str, store: str, streams: int = 8, adaptive: bool = False) -> dict:
    """One pull in this process; its figures (for benchmarks run inside a testbed host), with
    the stream counts it chose (``adaptive``) and the last reason."""
    from agent.commands.pull import split_url
    from agent.policy.model import Source
    from agent.pull.engine import PullOptions, pull_version
    from agent.store import Store
    source, model, version = split_url(url)
    chosen: list[int] = []
    why: list[str] = []

    def progress(p: object) -> None:
        n = getattr(p, "streams_chosen", 0)
        if n and (not chosen or chosen[-1] != n):
            chosen.append(n)
        why[:] = [getattr(p, "streams_why", "")]

    r = pull_version([Source(source)], model, version, Store(store),
                     options=PullOptions(streams=streams, adaptive=adaptive),
                     connections=CONNECTIONS, progress=progress)
    return {"seconds": r.seconds, "fetched": r.bytes_fetched, "reused": r.bytes_reused,
            "total": r.bytes_total, "path": str(r.path), "streams": chosen,
            "streams_why": why[0] if why else ""}


def pull_in(host: object, url: str, store: Path, streams: int = 8,
            adaptive: bool = False) -> dict:
    """``pull_json`` run inside a testbed host (a child python in its namespace)."""
    import json
    import sys
    out = host.run([sys.executable, "-m", "tests.pull_helpers", url, str(store), str(streams),
                    "adaptive" if adaptive else "fixed"],
                   timeout=900, cwd=str(Path(__file__).resolve().parents[1]))
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(pull_json(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                               len(sys.argv) > 4 and sys.argv[4] == "adaptive")))


def blob_of(version_dir: Path, rel: str) -> str:
    """The store's name (blob id) for file ``rel`` of a published origin version."""
    from agent.blob_id import blob_id
    from agent.manifest import parse
    m = parse((version_dir / "manifest.json").read_bytes())
    return blob_id(next(f for f in m.files if f.path == rel))
