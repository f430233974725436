"""The testbed itself: real namespaces, veths, HTB, nginx, iperf3, and that it cleans up."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.modelgen import generate
from tests.testbed import REPO, WAGENT, Testbed
from tests.testbed.owners import STATE_DIR, list_netns, sweep

pytestmark = [pytest.mark.netns, pytest.mark.debian]


def sparse_file(path: Path, size: int) -> Path:
    """A big file that costs nothing to make: nginx sends its zero pages like any others."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def curl(host, url: str, *args: str) -> subprocess.CompletedProcess:
    return host.run(["curl", "-sSfg", "--max-time", "20", *args, url], text=False)


def test_range_fetch_of_a_generated_shard(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="1gbit")
    www = testbed.tmpdir("www")
    spec = generate(www / "m" / "v1", layers=4, hidden=64, shards=2, seed=5)
    srv = testbed.nginx(origin, root=www, port=8080)
    shard = spec.shards()[1]
    t = next(x for x in spec.tensors if x.file == shard and x.size > 1000)
    url = f"{srv.url_for(link.a)}/m/v1/{shard}"
    res = curl(node, url, "-r", f"{t.begin}-{t.end - 1}")
    with open(www / "m" / "v1" / shard, "rb") as f:
        f.seek(t.begin)
        want = f.read(t.size)
    assert hashlib.sha256(res.stdout).hexdigest() == hashlib.sha256(want).hexdigest()
    # Headers a resuming client relies on: 206, Content-Range, an ETag.
    head = node.run(["curl", "-sS", "-D", "-", "-o", "/dev/null", "-r", "0-7", url]).stdout
    assert " 206 " in head.splitlines()[0]
    assert f"bytes 0-7/{(www / 'm' / 'v1' / shard).stat().st_size}" in head
    assert "etag:" in head.lower()
    last = srv.requests()[-1]
    assert last["status"] == 206 and last["range"] == "bytes=0-7" and last["bytes"] == 8
    assert srv.bytes_sent("/m/v1/") == t.size + 8


def test_nginx_serves_symlinks_like_a_store(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node)
    store = testbed.tmpdir("store")
    (store / "blobs").mkdir()
    (store / "blobs" / "abc").write_bytes(b"blob bytes")
    (store / "models" / "m" / "v1").mkdir(parents=True)
    os.symlink("../../../blobs/abc", store / "models" / "m" / "v1" / "w.bin")
    srv = testbed.nginx(origin, root=store / "models", port=80)
    assert curl(node, f"{srv.url_for(link.a)}/m/v1/w.bin").stdout == b"blob bytes"


def test_bottleneck_100mbit_goodput(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="100mbit")
    www = testbed.tmpdir("www")
    sparse_file(www / "big.bin", 1 << 30)
    srv = testbed.nginx(origin, root=www)
    bps = testbed.goodput(node, f"{srv.url_for(link.a)}/big.bin", seconds=5)
    print(f"goodput through a 100mbit HTB bottleneck: {bps / 1e6:.1f} Mbit/s")
    assert 90e6 <= bps <= 100e6


def test_ipv6_between_hosts(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node)
    www = testbed.tmpdir("www")
    (www / "hello.txt").write_text("hello over v6\n")
    srv = testbed.nginx(origin, root=www)
    url = srv.url_for(link.a.ip6)
    assert url.startswith("http://[fd77:")
    assert curl(node, f"{url}/hello.txt").stdout == b"hello over v6\n"
    assert srv.requests()[-1]["remote"] == link.b.ip6


def test_switch_with_three_hosts(testbed):
    sw = testbed.switch("sw")
    hosts = [testbed.host(f"h{i}") for i in range(3)]
    eps = [testbed.attach(h, sw) for h in hosts]
    assert len({ep.ip4 for ep in eps}) == 3
    www = testbed.tmpdir("www")
    (www / "f").write_text("on the segment\n")
    servers = [testbed.nginx(h, root=www, port=8000) for h in hosts]
    for i, client in enumerate(hosts):
        for j, srv in enumerate(servers):
            if i != j:
                for target in (eps[j].ip4, eps[j].ip6):
                    assert curl(client, f"{srv.url_for(target)}/f").stdout == b"on the segment\n"


def test_switch_port_rate_back_caps_downloads(testbed):
    sw = testbed.switch("sw")
    origin, node = testbed.host("origin"), testbed.host("node")
    o = testbed.attach(origin, sw)
    testbed.attach(node, sw, rate_back="50mbit")
    www = testbed.tmpdir("www")
    sparse_file(www / "big.bin", 1 << 30)
    srv = testbed.nginx(origin, root=www)
    bps = testbed.goodput(node, f"{srv.url_for(o)}/big.bin", seconds=2)
    assert 40e6 <= bps <= 52e6


def test_router_between_two_links(testbed):
    a, r, b = testbed.host("a"), testbed.host("r"), testbed.host("b")
    ar, rb = testbed.connect(a, r), testbed.connect(r, b)
    a.add_route(f"{rb.b.ip4}/32", ar.b.ip4)
    b.add_route(f"{ar.a.ip4}/32", rb.a.ip4)
    a.add_route(f"{rb.b.ip6}/128", ar.b.ip6)
    b.add_route(f"{ar.a.ip6}/128", rb.a.ip6)
    www = testbed.tmpdir("www")
    (www / "f").write_text("routed\n")
    srv = testbed.nginx(b, root=www)
    assert curl(a, f"{srv.url_for(rb.b)}/f").stdout == b"routed\n"
    assert curl(a, f"{srv.url_for(rb.b.ip6)}/f").stdout == b"routed\n"


def test_limit_rate_caps_one_connection(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node)
    www = testbed.tmpdir("www")
    sparse_file(www / "big.bin", 1 << 30)
    srv = testbed.nginx(origin, root=www, limit_rate="4m")  # 4 MiB/s = 33.5 Mbit/s
    cap = 4 * 2**20 * 8
    seconds = 2
    one = testbed.goodput(node, f"{srv.url_for(link.a)}/big.bin", seconds=seconds)
    # nginx grants each connection a one-second head start: rate * (t + 1) / t at most.
    assert 0.8 * cap <= one <= cap * (seconds + 1) / seconds * 1.05
    four = testbed.goodput(node, f"{srv.url_for(link.a)}/big.bin", seconds=seconds, streams=4)
    assert four >= 3 * one


def test_iperf3_reverse_flows_from_server(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="50mbit")  # origin -> node only
    testbed.iperf3_server(origin, port=29500)
    rev = testbed.iperf3(node, server=link.a.ip4, port=29500, seconds=2, reverse=True)
    assert 40e6 <= rev.bps <= 52e6
    assert rev.intervals and all(end > start for start, end, _ in rev.intervals)
    fwd = testbed.iperf3(node, server=link.a.ip4, port=29500, seconds=1)
    assert fwd.bps > 2 * rev.bps  # the other direction has no bottleneck


def test_names_and_commands(testbed):
    host = testbed.host("n1")
    assert host.ns.startswith(testbed.prefix + "-") and host.ns in list_netns()
    with pytest.raises(ValueError, match="already used"):
        testbed.host("n1")
    with pytest.raises(ValueError, match="host name"):
        testbed.host("Bad_Name")
    res = host.run(["ip", "-o", "link", "show", "lo"])
    assert "UP" in res.stdout
    with pytest.raises(subprocess.CalledProcessError, match="on host 'n1'"):
        host.run(["sh", "-c", "echo nope >&2; exit 3"])
    assert host.run(["false"], check=False).returncode == 1
    d = testbed.tmpdir("x")
    assert d.is_dir() and d.is_relative_to(testbed.root)


def test_wagent_runs_inside_a_host(testbed):
    host = testbed.host("n1")
    out = host.run([WAGENT, "--version"]).stdout
    assert out.startswith("wagent ")


def test_background_flow_and_rsyncd(testbed):
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="200mbit")
    testbed.iperf3_server(origin, port=29500)
    flow = testbed.iperf3_start(node, server=link.a.ip6, port=29500, seconds=1, reverse=True)
    www = testbed.tmpdir("www")
    generate(www / "m", layers=2, hidden=32, shards=2)
    rsyncd = testbed.rsyncd(origin, root=www, port=8730)
    dst = testbed.tmpdir("dst")
    node.run(["rsync", "-a", f"{rsyncd.url_for(link.a)}/m/", str(dst)])
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in (www / "m").iterdir())
    res = flow.result()
    assert 0 < res.bps <= 200e6


# --- cleanup ---------------------------------------------------------------------------------
LEAKY_TEST = '''
import os, signal, time
from pathlib import Path

def test_leaky(testbed):
    a, b = testbed.host("a"), testbed.host("b")
    link = testbed.connect(a, b, rate="10mbit")
    www = testbed.tmpdir("www")
    testbed.nginx(a, root=www, port=8080)
    testbed.iperf3_server(a, port=int(os.environ["TB_PORT"]))
    b.popen(["sh", "-c", "echo leaky-log-line; exec sleep 300"])
    Path(os.environ["TB_INFO"]).write_text(f"{testbed.prefix} {testbed.root}")
    if os.environ["TB_MODE"] == "hang":
        time.sleep(120)
    assert False, "fails on purpose"
'''


def leftovers(prefix: str, root: str, port: int) -> list[str]:
    found = [ns for ns in list_netns() if ns.startswith(prefix)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [line for line in links.splitlines() if prefix in line]
    for pattern in (root, f"iperf3 -s -p {port}$"):
        ps = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
        found += [line for line in ps.splitlines() if "pgrep" not in line]
    if Path(root).exists():
        found.append(root)
    if (STATE_DIR / f"{prefix}.json").exists():
        found.append(str(STATE_DIR / f"{prefix}.json"))
    return found


def run_leaky(tmp_path: Path, mode: str,
              sig: int | None = None) -> tuple[str, str, int, int, str]:
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    info = tmp_path / "info"
    port = random.randrange(20000, 30000)  # concurrent runs of this test must not see each other
    env = dict(os.environ, TB_INFO=str(info), TB_MODE=mode, TB_PORT=str(port),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A shell without job control starts background jobs with SIGINT ignored, and python
        # keeps it so; the child must feel Ctrl-C as an interactive pytest would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if sig is not None:
        deadline = time.monotonic() + 30
        while not info.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        sweep()  # what the killed run left
        raise
    assert info.exists(), out
    prefix, root = info.read_text().split()
    return prefix, root, port, proc.returncode, out


def test_cleanup_after_a_failing_test(tmp_path):
    prefix, root, port, rc, out = run_leaky(tmp_path, "fail")
    assert rc == 1
    assert "leaky-log-line" in out  # the failed test's report shows its processes' logs
    assert leftovers(prefix, root, port) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cleanup_after_an_interrupt(tmp_path, sig):
    prefix, root, port, rc, _ = run_leaky(tmp_path, "hang", sig)
    assert rc != 0
    assert leftovers(prefix, root, port) == []


def test_sweeper_removes_what_a_killed_run_left(tmp_path):
    prefix, root, port, rc, _ = run_leaky(tmp_path, "hang", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert leftovers(prefix, root, port)  # SIGKILL leaves everything behind ...
    with Testbed():  # ... until the next testbed starts and sweeps it
        pass
    assert leftovers(prefix, root, port) == []


def test_sweeper_leaves_live_runs_alone(testbed):
    host = testbed.host("alive")
    with Testbed() as other:  # sweeps on start
        assert other.prefix != testbed.prefix
        assert host.ns in list_netns()
    assert host.ns in list_netns() and testbed.root.exists()
