"""Commands the policy runs when something happens on the node: ``models[].on_ready``.

A hook runs through ``/bin/sh -c`` (operators write shell: ``systemctl reload vllm``), in a
session of its own so that a timeout kills everything it started, with the event in its
environment. Its outcome comes back as one line for ``wagent status``; a failing hook is logged
and shown, and never fails the pull.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping

TAIL = 200          # characters of the hook's output kept in its result


def run_hook(command: str, env: Mapping[str, str], timeout: float,
             clock: Callable[[], float] = time.monotonic) -> tuple[bool, str]:
    """(succeeded, what happened in one line)."""
    started = clock()
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], env={**os.environ, **env},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return False, f"could not start: {e.strerror or e}"
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):     # the group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return False, f"killed after {timeout:g} s (on_ready_timeout)"
    took = clock() - started
    text = out.decode("utf-8", "replace").strip().splitlines()
    last = text[-1][-TAIL:] if text else ""
    if proc.returncode == 0:
        return True, f"exit 0 after {took:.1f} s"
    return False, f"exit {proc.returncode} after {took:.1f} s" + (f": {last}" if last else "")

