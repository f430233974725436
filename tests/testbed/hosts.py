"""Hosts (network namespaces), their link endpoints, and commands run inside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# The wagent command a test runs inside a host. Under the venv that is the venv's console script;
# under Debian's python3 a launcher that runs this tree's `agent` package with that python.
WAGENT_CMD = [sys.executable, "-m", "agent"]
_venv_wagent = Path(sys.executable).parent / "wagent"
WAGENT = (str(_venv_wagent) if sys.prefix != sys.base_prefix and _venv_wagent.exists()
          else str(Path(__file__).with_name("wagent")))


class CommandFailed(subprocess.CalledProcessError):
    """A command inside a host exited non-zero; the message carries the host and stderr."""

    def __init__(self, host: str, returncode: int, cmd: list[str], output: str | None,
                 stderr: str | None) -> None:
        super().__init__(returncode, cmd, output, stderr)
        self.host = host

    def __str__(self) -> str:
        tail = (self.stderr or self.output or "").strip()[-2000:]
        return (f"on host {self.host!r}: {' '.join(map(str, self.cmd))} exited "
                f"{self.returncode}" + (f"\n{tail}" if tail else ""))


@dataclass(frozen=True)
class Endpoint:
    """One end of a link as seen from its host: the interface and its addresses (no prefix)."""

    host: Host
    ifname: str
    ip4: str
    ip6: str
    prefix4: int = 24
    prefix6: int = 64


@dataclass(frozen=True)
class Link:
    """A veth pair; `a` is the first host given to connect(), `rate` shapes a -> b."""

    a: Endpoint
    b: Endpoint
    rate: int | None = None  # bits/s, HTB on a's interface
    rate_back: int | None = None  # bits/s, HTB on b's interface


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for commands in hosts: ours, plus what the wagent launcher needs."""
    env = dict(os.environ)
    env["WAGENT_PYTHON"] = sys.executable
    env["WAGENT_REPO"] = str(REPO)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if extra:
        env.update(extra)
    return env


@dataclass(eq=False)
class Host:
    """A network namespace with lo up. Commands run in it through `ip netns exec`."""

    name: str
    ns: str
    bed: Any = field(repr=False)  # the Testbed; Any to avoid an import cycle
    endpoints: list[Endpoint] = field(default_factory=list, repr=False)

    def __hash__(self) -> int:
        return hash(self.ns)

    @property
    def ip4(self) -> str:
        """The address of this host's first link (convenient for single-link hosts)."""
        return self._first().ip4

    @property
    def ip6(self) -> str:
        return self._first().ip6

    def _first(self) -> Endpoint:
        if not self.endpoints:
            raise ValueError(f"host {self.name!r} has no links yet; connect() or attach() it")
        return self.endpoints[0]

    def wrap(self, argv: list[str]) -> list[str]:
        """The command line that runs `argv` inside this host."""
        return ["ip", "netns", "exec", self.ns, *map(str, argv)]

    def run(self, argv: list[str], check: bool = True, timeout: float | None = 60,
            input: str | None = None, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, text: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run to completion inside the host; stdout/stderr captured (text unless text=False)."""
        kwargs.setdefault("capture_output", "stdout" not in kwargs and "stderr" not in kwargs)
        res = subprocess.run(self.wrap(argv), input=input, timeout=timeout, text=text,
                             env=command_env(env), cwd=cwd, check=False, **kwargs)
        if check and res.returncode != 0:
            raise CommandFailed(self.name, res.returncode, list(map(str, argv)), res.stdout,
                                res.stderr)
        return res

    def popen(self, argv: list[str], env: dict[str, str] | None = None,
              cwd: str | Path | None = None, log: str | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start in the background inside the host, in its own process group; killed on exit.

        Unless stdout/stderr are given, both go to a log file in the run's temp dir; its path is
        on the returned object as `.log_path`.
        """
        log_path = None
        if "stdout" not in kwargs and "stderr" not in kwargs:
            log_path = self.bed.log_path(log or f"{self.name}-{Path(str(argv[0])).name}")
            out = open(log_path, "wb")  # handed to the child, closed below
            kwargs["stdout"], kwargs["stderr"] = out, subprocess.STDOUT
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        try:
            proc = subprocess.Popen(self.wrap(argv), env=command_env(env), cwd=cwd,
                                    start_new_session=True, **kwargs)
        finally:
            if log_path is not None:
                out.close()
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.bed.track(proc)
        return proc

    def sysctl(self, **values: str | int) -> None:
        """Set sysctls in this namespace: host.sysctl(**{"net.ipv4.ip_forward": 1})."""
        self.run(["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items())])

    def add_route(self, dst: str, via: str) -> None:
        """A static route, e.g. through a router host with several links."""
        self.run(["ip", "-6" if ":" in dst else "-4", "route", "replace", dst, "via", via])


def netloc(target: Endpoint | Host | str, port: int) -> str:
    """``IP:PORT`` of a server at an endpoint, a host's first address or an IP ([v6]:PORT)."""
    if isinstance(target, Host):
        target = target.ip4
    ip = target.ip4 if isinstance(target, Endpoint) else target
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def stop_process(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds, reap the leader."""
    stop_processes([proc], grace)


def stop_processes(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """stop_process() for many at once: one grace period for all, not one each."""
    # Only groups whose leader is still unreaped: a pid reaped long ago may belong to someone
    # else by now. Stray members of old groups live in our namespaces and die with them.
    procs = [p for p in procs if p.poll() is None]
    for proc in procs:
        _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        # Children of the leader may outlive it; the group's SIGKILL takes them too.
        _killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_listening(proc: subprocess.Popen, ns: str, port: int, what: str,
                   timeout: float = 20.0, log: Path | None = None) -> None:
    """Wait until `proc`'s namespace has a TCP listener on `port`.

    /proc/PID/net/tcp shows the sockets of that process's network namespace, so this costs no
    subprocess per poll. Until `ip netns exec` has switched namespaces the process still sees the
    root namespace, hence the inode check first.
    """
    ns_inode = os.stat(f"/run/netns/{ns}").st_ino
    hexport = f":{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on "
                               f"port {port}\n{detail}")
        for table in ("tcp", "tcp6"):
            try:
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != ns_inode:
                    break
                lines = Path(f"/proc/{proc.pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                cols = line.split()
                if cols[1].endswith(hexport) and cols[3] == "0A":  # 0A = LISTEN
                    return
        time.sleep(0.03)
    raise RuntimeError(f"{what} not listening on port {port} after {timeout:.0f} s")
