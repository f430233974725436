"""Helpers for the daemon's integration tests: a policy file, a running `wagent run` (on this
host, or as a node inside a testbed host), and a systemd-like notify socket that records what
the daemon sends and who sent it."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.testbed import WAGENT as TESTBED_WAGENT  # the CLI a testbed host runs

WAGENT = [sys.executable, "-m", "agent"]
ROOT = Path(__file__).resolve().parents[1]


def write_policy(path: Path, tmp: Path, **sections: object) -> Path:
    doc: dict = {
        "version": 1,
        "sources": [{"url": "http://127.0.0.1:9"}],
        "models": [],
        "store": {"path": str(tmp / "store")},
        "state_dir": str(tmp / "state"),
        "metrics": {"listen": None},
        "control": {"socket": str(tmp / "control.sock")},
        "backoff": {"nccl_processes": False},
    }
    doc.update(sections)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class NotifySocket:
    """An AF_UNIX datagram socket like systemd's, with SO_PASSCRED: every message comes with
    the sender's pid as the kernel saw it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.messages: list[tuple[int, str]] = []      # (sender pid, message)

    def receive(self, timeout: float) -> tuple[int, str] | None:
        self.sock.settimeout(timeout)
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("3i", payload[:12])
        msg = (pid, data.decode())
        self.messages.append(msg)
        return msg

    def wait_for(self, prefix: str, timeout: float = 10.0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.receive(max(0.01, deadline - time.monotonic()))
            if msg is not None and any(line.startswith(prefix) for line in msg[1].split("\n")):
                return msg
        raise AssertionError(f"no {prefix!r} within {timeout} s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


def start_daemon(policy: Path, *extra: str, env: dict[str, str] | None = None,
                 log: Path | None = None) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT))
    full_env.update(env or {})
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([*WAGENT, "run", "--policy", str(policy), *extra], env=full_env,
                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wagent(*args: str, timeout: float = 30, user: str | None = None, group: str | None = None
           ) -> subprocess.CompletedProcess:
    """The CLI; with ``user``, run as that user (and ``group``) with no supplementary groups."""
    cmd = [*WAGENT, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={group or user}", "--clear-groups",
               *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and wagent("status", "--socket", str(path)).returncode in (0, 1):
            return
        if proc.poll() is not None:
            raise AssertionError(f"wagent run exited with {proc.returncode}")
        time.sleep(0.1)
    raise AssertionError(f"no control socket at {path} within {timeout} s")


# -- a control socket someone else replaced -------------------------------------------------
_IMPOSTOR = r"""
import json, os, socket, sys
path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)            # before bind and listen: SO_PEERCRED reports who listened
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o666)
srv.listen(8)
print("ready", flush=True)
answers = {"reload": {"reloaded": True, "path": "/etc/wagent/policy.yaml", "sha256": "0" * 64},
           "pause": {"paused": True}, "resume": {"paused": False}, "ping": {"pong": True}}
while True:
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(5)
        try:
            line = conn.makefile("rb").readline()
            if not line.strip():
                continue          # the client hung up without asking anything
            print("heard", line.decode().strip(), flush=True)
            cmd = json.loads(line).get("cmd")
            reply = {"ok": True, "result": answers.get(cmd, {"schema": 1})}
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except (OSError, ValueError):
            pass
"""


class Impostor:
    """A control socket at ``path`` served by another user (nobody by default), answering
    success to everything, as a user who replaced the daemon's socket would. :meth:`heard`
    lists the requests that reached it. The directory must let that user create the socket."""

    def __init__(self, path: Path, uid: int = 65534, gid: int = 65534) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", _IMPOSTOR, str(path), str(uid),
                                      str(gid)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the impostor didn't start: {ready!r}")

    def heard(self) -> list[str]:
        """Stops the impostor; the requests it was sent."""
        self.close()
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("heard ")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Impostor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- nodes on the testbed --------------------------------------------------------------------
@dataclass
class Node:
    name: str
    hostname: str
    host: object
    ifname: str
    dir: Path
    policy: Path
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "control.sock"

    @property
    def store(self) -> Path:
        return self.dir / "store"


def node_policy(node: Node, sources: list[str], *, role_hosts: dict[str, str],
                shaping: bool = True, cache_lead: str = "0s", serve_ports: list[int] = (),
                ceil: str = "40mbit", model: str = "llama", streams: int = 4) -> dict:
    """A node's policy for the testbed: waves of seconds, one model following "latest", an
    ingress cap on the node's link and a backoff that reacts within a tick."""
    return {
        "version": 1,
        "roles": {role: {"hosts": [pattern]} for role, pattern in role_hosts.items()},
        "default_role": "training",
        "cache_role": "cache",
        "waves": {"order": ["inference", "evaluation", "training"], "gap": "4s",
                  "spread": "1s", "cache_lead": cache_lead},
        "sources": [{"url": s} for s in sources],
        "models": [{"name": model, "version": "latest"}],
        "poll_interval": "1s",
        "store": {"path": str(node.store), "keep_versions": 2},
        "pulls": {"streams": streams, "piece_size": "1MiB", "retries": 2,
                  "connect_timeout": "2s", "read_timeout": "5s"},
        "shaping": {"enabled": shaping, "interfaces": [node.ifname], "link_rate": "1gbit",
                    "pull_ports": [8080], "serve_ports": list(serve_ports),
                    "rate": "1mbit", "ceil": ceil},
        "backoff": {"tick": "200ms", "floor": "4mbit", "increase": "20mbit", "quiet": "1s",
                    "link_threshold": "10gbit", "training_ports": [29500],
                    "nccl_processes": False},
        "metrics": {"listen": None},
        "control": {"socket": str(node.socket)},
        "state_dir": str(node.dir / "state"),
    }


def start(node: Node) -> None:
    node.proc = node.host.popen([TESTBED_WAGENT, "-v", "run", "--policy", str(node.policy),
                                 "--hostname", node.hostname, "--node-id", node.hostname],
                                log=f"wagent-{node.name}")


def status(node: Node) -> tuple[int, dict]:
    r = subprocess.run([TESTBED_WAGENT, "status", "--json", "--socket", str(node.socket)],
                       capture_output=True, text=True, timeout=20)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}


def wait_until(what: str, cond, timeout: float, nodes=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    logs = "\n".join(f"--- {n.name}\n{Path(n.proc.log_path).read_text()[-3000:]}"
                     for n in nodes if n.proc is not None)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def pull_state(node: Node) -> dict | None:
    code, doc = status(node)
    if code == 3 or not doc.get("pulls"):
        return None
    return doc["pulls"][0]


