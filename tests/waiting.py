"""Waiting in tests for something a background thread does."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 10 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
