"""An nginx origin inside a host: static files with Range, ETag, sendfile, optional limit_rate."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.testbed.hosts import Endpoint, Host, netloc, stop_process, wait_listening

# One JSON object per request, so the log parses without guessing at quoting.
LOG_FORMAT = ('{"uri":"$request_uri","status":$status,"bytes":$body_bytes_sent,'
              '"range":"$http_range","remote":"$remote_addr","msec":$msec,'
              '"request_time":$request_time,"method":"$request_method"}')

CONF = """\
daemon off;
master_process on;
worker_processes {workers};
user root;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    types {{ application/json json; text/plain txt; }}
    default_type application/octet-stream;
    log_format wagent escape=json '{log_format}';
    access_log {dir}/access.log wagent;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    keepalive_timeout 75s;
    server {{
        listen {port};
        listen [::]:{port} ipv6only=on;
        root {root};
        autoindex off;
        etag on;
        disable_symlinks off;
{extra}    }}
}}
"""


@dataclass
class Nginx:
    """A running nginx; its access log records every request (written when a request ends)."""

    host: Host
    root: Path
    port: int
    conf_dir: Path
    proc: subprocess.Popen

    @property
    def access_log(self) -> Path:
        return self.conf_dir / "access.log"

    @property
    def error_log(self) -> Path:
        return self.conf_dir / "error.log"

    def url_for(self, target: Endpoint | Host | str) -> str:
        """Base URL to reach this server at an endpoint, a host's first address, or an IP."""
        return f"http://{netloc(target, self.port)}"

    def requests(self) -> list[dict[str, Any]]:
        """Parsed access-log records: uri, status, bytes, range, remote, msec, request_time."""
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line]

    def bytes_sent(self, path_prefix: str = "") -> int:
        """Sum of $body_bytes_sent of the requests whose URI starts with `path_prefix`."""
        return sum(r["bytes"] for r in self.requests() if r["uri"].startswith(path_prefix))

    def stop(self) -> None:
        stop_process(self.proc)


def nginx_rate(limit_rate: str | int | None) -> str | None:
    """nginx's limit_rate value (bytes/s): '25m' passes as is; '200mbit' or '25MB/s' convert."""
    if limit_rate is None:
        return None
    if isinstance(limit_rate, int):
        return str(limit_rate)
    if re.fullmatch(r"\d+[kKmMgG]?", limit_rate):
        return limit_rate
    from agent.units import parse_rate
    return str(parse_rate(limit_rate) // 8)


def start_nginx(bed: Any, host: Host, root: Path, port: int, limit_rate: str | int | None,
                workers: int = 1, extra_conf: str = "") -> Nginx:
    """Start nginx in `host` serving `root` on `port` (IPv4 and IPv6); return once it listens."""
    root = root.resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"nginx root {root} is not a directory")
    conf_dir = bed.tmpdir(f"nginx-{host.name}-{port}")
    (conf_dir / "tmp").mkdir()
    extra = extra_conf
    rate = nginx_rate(limit_rate)
    if rate:
        extra += f"        limit_rate {rate};\n"
    conf = conf_dir / "nginx.conf"
    conf.write_text(CONF.format(workers=workers, dir=conf_dir, port=port, root=root,
                                log_format=LOG_FORMAT, extra=extra))
    # -e: errors before the config is read go here too, not to /var/log/nginx.
    proc = host.popen(["nginx", "-p", str(conf_dir), "-e", str(conf_dir / "error.log"),
                       "-c", str(conf)], log=f"nginx-{host.name}-{port}")
    wait_listening(proc, host.ns, port, f"nginx on {host.name}", log=conf_dir / "error.log")
    return Nginx(host, root, port, conf_dir, proc)


@dataclass
class Rsyncd:
    """An rsync daemon exporting `root` as module `data` (a peer tool for benchmarks)."""

    host: Host
    root: Path
    port: int
    proc: subprocess.Popen

    def url_for(self, target: Endpoint | Host | str) -> str:
        """rsync://IP:PORT/data; append a path inside `root`."""
        return f"rsync://{netloc(target, self.port)}/data"


def start_rsyncd(bed: Any, host: Host, root: Path, port: int = 873) -> Rsyncd:
    conf_dir = bed.tmpdir(f"rsyncd-{host.name}-{port}")
    conf = conf_dir / "rsyncd.conf"
    conf.write_text(f"pid file = {conf_dir}/rsyncd.pid\nuse chroot = no\n"
                    f"log file = {conf_dir}/rsyncd.log\n"
                    f"[data]\n    path = {root.resolve()}\n    read only = yes\n    uid = root\n"
                    f"    gid = root\n")
    proc = host.popen(["rsync", "--daemon", "--no-detach", f"--config={conf}", f"--port={port}"],
                      log=f"rsyncd-{host.name}-{port}")
    wait_listening(proc, host.ns, port, f"rsyncd on {host.name}", log=conf_dir / "rsyncd.log")
    return Rsyncd(host, root, port, proc)
