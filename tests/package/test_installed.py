"""The installed package as a fleet node runs it: /usr/bin/wagent (Debian's python3, Debian's
packaged libraries, the modules dpkg put in /usr/share/wagent) as the `wagent` user holding
CAP_NET_ADMIN and CAP_BPF and nothing else, on the testbed.

packaging/check-deb.sh runs this right after `apt-get install ./wagent_*.deb`:

    PYTHONPATH=. /usr/bin/python3 -m pytest -p no:cacheprovider tests/package

PYTHONPATH only serves the test itself (the testbed, the model generator): the launcher runs
``python3 -I``, which ignores it. A subcommand that still answers "not implemented yet" skips its
test with that reason, so each test turns itself on as the CLI lands. Without the package installed
the tests skip (fail under CI=true: check-deb.sh always installs it first).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed import Host, Testbed

INSTALLED = "/usr/bin/wagent"
PRIVATE_DIR = Path("/usr/share/wagent")
CAP_NET_ADMIN, CAP_BPF = 1 << 12, 1 << 39
# The service's identity, as wagent.service gives it: user wagent, CAP_NET_ADMIN and CAP_BPF in
# every set (ambient, so they survive the exec), nothing else in the bounding set, no way to gain
# more.
AS_WAGENT = ["setpriv", "--reuid", "wagent", "--regid", "wagent", "--init-groups",
             "--inh-caps", "-all,+net_admin,+bpf", "--ambient-caps", "-all,+net_admin,+bpf",
             "--bounding-set", "-all,+net_admin,+bpf", "--no-new-privs"]
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
NOT_YET = "not implemented yet"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _installed_version() -> str | None:
    res = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", "wagent"],
                         capture_output=True, text=True, check=False)
    parts = res.stdout.split()
    return parts[-1] if res.returncode == 0 and "installed" in parts[:3] else None


@pytest.fixture(scope="module")
def installed() -> str:
    """The installed package's version; skips (fails in CI) when the package isn't installed."""
    version = _installed_version()
    reason = None
    if version is None:
        reason = "the wagent package is not installed (make deb-check installs it)"
    elif os.geteuid() != 0:
        reason = "needs root (setpriv to the wagent user, network namespaces)"
    elif subprocess.run(["getent", "passwd", "wagent"], capture_output=True).returncode != 0:
        pytest.fail("the package is installed but the wagent user is missing (sysusers?)")
    if reason:
        if _in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    return version


def wagent(*args: str, host: Host | None = None, timeout: float = 60,
           as_wagent: bool = True) -> subprocess.CompletedProcess:
    """Run the installed wagent, as the service's user unless told otherwise, in `host` if any."""
    argv = [*(AS_WAGENT if as_wagent else []), INSTALLED, *args]
    if host is not None:
        argv = host.wrap(argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=CLEAN_ENV, check=False)


def skip_if_pending(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode == 2 and NOT_YET in res.stderr:
        pytest.skip(f"`wagent {what}` is {NOT_YET} in the installed package")


def require_implemented(*commands: str) -> None:
    """Skip unless every command is implemented: stubs say "(not implemented yet)" in --help."""
    listing = wagent("--help", as_wagent=False).stdout
    for command in commands:
        if re.search(rf"^\s+{re.escape(command)}\s+\({NOT_YET}\)", listing, re.M):
            pytest.skip(f"`wagent {command}` is {NOT_YET} in the installed package")


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, (f"{' '.join(res.args)} exited {res.returncode}\n"
                                 f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}")
    return res


@pytest.fixture
def workdir(installed: str) -> Iterator[Path]:
    """A directory the wagent user can reach (the testbed's own temp root is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="wagent-pkgtest-", dir="/var/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def owned_by_wagent(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.chown(path, "wagent", "wagent")
    path.chmod(0o750)
    return path


def tc_state(host: Host) -> list[str]:
    """Qdiscs and links of a host, without counters: what shaping clear must give back."""
    qdiscs = host.run(["tc", "qdisc", "show"]).stdout.splitlines()
    links = [re.sub(r"^\d+: ([^:@]+).*", r"\1", line)
             for line in host.run(["ip", "-o", "link", "show"]).stdout.splitlines()]
    return sorted(qdiscs + links)


def write_policy(path: Path, *, ifname: str, source: str, port: int, work: Path,
                 model: str, version: str) -> Path:
    path.write_text(f"""\
version: 1
default_role: inference
cache_role: null
waves: {{order: [inference], gap: 1s, spread: 1s, cache_lead: 0s}}
sources:
  - url: {source}
models:
  - name: {model}
    version: {version}
poll_interval: 5s
store: {{path: {work / "store"}}}
pulls: {{streams: 4}}
shaping:
  enabled: true
  interfaces: [{ifname}]
  link_rate: 1gbit
  pull_ports: [{port}]
  rate: 10mbit
  ceil: 200mbit
backoff: {{enabled: false}}
metrics: {{listen: null}}
control: {{socket: {work / "run" / "control.sock"}, group: wagent}}
state_dir: {work / "state"}
""")
    path.chmod(0o644)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- without the testbed -----------------------------------------------------------------------


def test_identity_is_wagent_with_net_admin_and_bpf_only(installed: str) -> None:
    status = subprocess.run([*AS_WAGENT, "grep", "-E", "^(Uid|Cap(Eff|Prm|Bnd|Amb)):",
                             "/proc/self/status"], capture_output=True, text=True, check=True)
    fields = dict(line.split(":", 1) for line in status.stdout.splitlines())
    uid = subprocess.run(["id", "-u", "wagent"], capture_output=True, text=True).stdout.strip()
    assert fields["Uid"].split()[0] == uid
    for cap in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == CAP_NET_ADMIN | CAP_BPF, f"{cap} = {fields[cap].strip()}"


def test_version_from_debian_python(installed: str) -> None:
    res = ok(wagent("--version"))
    assert res.stdout.strip() == f"wagent {installed}"
    # The code that ran is the package's, from the private directory, under Debian's python3.
    launcher = Path(INSTALLED).read_text()
    assert launcher.startswith("#!/usr/bin/python3")
    assert str(PRIVATE_DIR) in launcher
    assert (PRIVATE_DIR / "agent" / "cli.py").is_file()
    assert not list(Path("/usr/lib/python3/dist-packages").glob("agent")), \
        "the package's modules belong in /usr/share/wagent, not dist-packages"


def test_shipped_policies_check(installed: str) -> None:
    policies = sorted(str(p) for p in (PRIVATE_DIR / "policies").glob("*.yaml"))
    assert policies, "no policies shipped in /usr/share/wagent/policies"
    require_implemented("policy")
    res = wagent("policy", "check", *policies)
    skip_if_pending(res, "policy check")
    ok(res)


# --- on the testbed ----------------------------------------------------------------------------


@pytest.mark.netns
def test_apply_shaping_as_wagent(installed: str, workdir: Path, testbed: Testbed) -> None:
    require_implemented("shaping")
    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="1gbit")
    owned_by_wagent(workdir / "state")
    owned_by_wagent(workdir / "run")
    policy = write_policy(workdir / "policy.yaml", ifname=link.b.ifname,
                          source=f"http://{link.a.ip4}:8080", port=8080, work=workdir,
                          model="tiny", version="v1")
    before = tc_state(node)

    res = wagent("shaping", "apply", "--policy", str(policy), host=node)
    skip_if_pending(res, "shaping apply")
    ok(res)
    shaped = tc_state(node)
    assert any("ingress" in line for line in shaped if link.b.ifname in line), shaped
    assert any(line.startswith("qdisc htb") for line in shaped), shaped

    # Applying again changes nothing (adopt, don't stack).
    ok(wagent("shaping", "apply", "--policy", str(policy), host=node))
    assert tc_state(node) == shaped

    ok(clear_shaping(node, policy))
    assert tc_state(node) == before


def clear_shaping(node: Host, policy: Path) -> subprocess.CompletedProcess:
    """`wagent shaping clear` as the service's user, with the policy when clear takes one."""
    usage = wagent("shaping", "clear", "--help", as_wagent=False).stdout
    extra = ["--policy", str(policy)] if "--policy" in usage else []
    return wagent("shaping", "clear", *extra, host=node)


@pytest.mark.netns
def test_pull_a_model_as_wagent(installed: str, workdir: Path, testbed: Testbed) -> None:
    require_implemented("manifest", "pull")
    from tests.modelgen import generate

    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="1gbit")
    origin_root = workdir / "origin"
    version_dir = origin_root / "tiny" / "v1"
    generate(version_dir, layers=4, hidden=64, shards=2, seed=7)
    res = wagent("manifest", "build", str(version_dir), as_wagent=False)
    skip_if_pending(res, "manifest build")
    ok(res)
    (origin_root / "tiny" / "latest").write_text("v1\n")
    srv = testbed.nginx(origin, root=origin_root, port=8080)
    store = owned_by_wagent(workdir / "store")

    res = wagent("pull", f"{srv.url_for(link.a)}/tiny/v1", "--store", str(store),
                 host=node, timeout=120)
    skip_if_pending(res, "pull")
    ok(res)

    pulled = store / "models" / "tiny" / "v1"
    sources = [p for p in version_dir.rglob("*") if p.is_file()]
    assert sources
    for src in sources:
        dst = pulled / src.relative_to(version_dir)
        assert dst.is_file(), f"{dst} missing after the pull"
        assert sha256(dst) == sha256(src), f"{dst} differs from the origin's"

    # The operator's tools on that store, as the service user, with no daemon running.
    res = wagent("wait", "tiny", "--version", "v1", "--timeout", "5s", "--store", str(store))
    ok(res)
    assert res.stdout.strip().endswith("/models/tiny/v1")
    res = wagent("store", "ls", "--store", str(store), "--json")
    ok(res)
    doc = json.loads(res.stdout)
    assert [v["version"] for m in doc["models"] for v in m["versions"]] == ["v1"]
    ok(wagent("store", "verify", "--store", str(store)))


@pytest.mark.netns
def test_daemon_answers_status_as_wagent(installed: str, workdir: Path, testbed: Testbed) -> None:
    require_implemented("run", "status", "shaping", "manifest")
    from tests.modelgen import generate

    origin, node = testbed.host("origin"), testbed.host("node")
    link = testbed.connect(origin, node, rate="1gbit")
    origin_root = workdir / "origin"
    version_dir = origin_root / "tiny" / "v1"
    generate(version_dir, layers=2, hidden=64, shards=1, seed=3)
    ok(wagent("manifest", "build", str(version_dir), as_wagent=False))
    (origin_root / "tiny" / "latest").write_text("v1\n")
    srv = testbed.nginx(origin, root=origin_root, port=8080)
    for sub in ("store", "state", "run"):
        owned_by_wagent(workdir / sub)
    policy = write_policy(workdir / "policy.yaml", ifname=link.b.ifname,
                          source=srv.url_for(link.a), port=8080, work=workdir,
                          model="tiny", version="v1")
    before = tc_state(node)

    daemon = node.popen([*AS_WAGENT, INSTALLED, "run", "--policy", str(policy)],
                        env=CLEAN_ENV, log="wagent-run")
    try:
        status = _wait_status(node, daemon, policy, timeout=30)
        doc = json.loads(status.stdout)
        assert doc["schema"] == 1
        assert doc["daemon"]["version"] == installed
        assert doc["daemon"]["pid"] == daemon.pid   # ip netns exec and setpriv exec, not fork
        assert doc["policy"]["path"] == str(policy)
        assert doc["shaping"]["enabled"] is True
        assert [(i["name"], i["direction"]) for i in doc["shaping"]["interfaces"]] == \
            [(link.b.ifname, "ingress")], doc["shaping"]
        # The caps were in the kernel before the daemon said it was ready.
        assert tc_state(node) != before

        # It pulls the policy's model into its store, as the service's user.
        doc = _wait_pulled(node, daemon, policy, timeout=60)
        pulled = workdir / "store" / "models" / "tiny" / "v1"
        for src in (p for p in version_dir.rglob("*") if p.is_file()):
            assert sha256(pulled / src.relative_to(version_dir)) == sha256(src)

        # `systemctl reload` runs `wagent reload` as the service's user: accepted.
        ok(wagent("reload", *status_target(policy), host=node, timeout=60))

        # SIGTERM: the daemon stops within 5 s and leaves the caps in place.
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=10)
        assert tc_state(node) != before, "the caps went away with the daemon"
        gone = wagent("status", "--json", *status_target(policy), host=node, timeout=15)
        assert gone.returncode == 3, (gone.returncode, gone.stderr)
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(timeout=10)
        ok(clear_shaping(node, policy))
    assert tc_state(node) == before


def status_target(policy: Path) -> list[str]:
    """How `wagent status` finds this test's daemon, whose socket isn't the default one."""
    usage = wagent("status", "--help", as_wagent=False).stdout
    if "--socket" in usage:
        return ["--socket", str(policy.parent / "run" / "control.sock")]
    if "--policy" in usage:
        return ["--policy", str(policy)]
    pytest.fail("`wagent status` takes neither --socket nor --policy: it can't find a daemon "
                "whose policy moved the control socket")


def _wait_pulled(node: Host, daemon: subprocess.Popen, policy: Path, timeout: float) -> dict:
    """The status document once the daemon's first pull is done."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = json.loads(_wait_status(node, daemon, policy, timeout=15).stdout)
        if doc["pulls"] and doc["pulls"][0]["state"] == "done":
            return doc
        time.sleep(0.5)
    pytest.fail(f"the daemon's pull isn't done after {timeout:.0f} s: "
                f"{json.dumps(doc.get('pulls'), indent=1)}\nproblems: {doc.get('problems')}")


def _wait_status(node: Host, daemon: subprocess.Popen, policy: Path,
                 timeout: float) -> subprocess.CompletedProcess:
    """`wagent status --json` from the daemon, once it answers (0 healthy or 1 degraded)."""
    deadline = time.monotonic() + timeout
    res = None
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            log = Path(daemon.log_path).read_text(errors="replace")[-3000:]
            pytest.fail(f"wagent run exited {daemon.returncode} before answering status:\n{log}")
        res = wagent("status", "--json", *status_target(policy), host=node, timeout=15)
        skip_if_pending(res, "status")
        if res.returncode in (0, 1) and res.stdout.strip():
            return res
        time.sleep(0.5)
    log = Path(daemon.log_path).read_text(errors="replace")[-3000:]
    pytest.fail(f"no status within {timeout:.0f} s; last: {res and res.returncode} "
                f"{res and res.stderr}\n{log}")
