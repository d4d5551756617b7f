"""Waiting in tests for something another process does."""

from __future__ import annotations

import time


def wait_until(predicate, what: str, timeout: float = 60, interval: float = 0.05):
    """The first truthy value of ``predicate()``, asked every ``interval`` seconds;
    TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"no {what} after {timeout}s")
