"""Helpers for the daemon's integration tests: a policy file, a running `wagent run`, and a
systemd-like notify socket that records what the daemon sends and who sent it."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import yaml

WAGENT = [sys.executable, "-m", "agent"]
ROOT = Path(__file__).resolve().parents[2]


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
