"""Waiting in tests for something another process does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


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


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list]:
    """Start ``call`` on a daemon thread of its own (as a request or a worker would run it,
    with database connections of its own, closed as it ends); the thread, and a list that
    receives what ``call`` returns."""
    from django.db import connections

    answers: list = []

    def run() -> None:
        try:
            answers.append(call())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answers
