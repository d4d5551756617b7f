"""Wake-ups within a node's worker process. A thread that waits for what another thread of the
same process does (a generation waiting for the prefetch directive of its placement, which this
process loads) sleeps on a condition that the other thread notifies, rather than polling rows.
The rows stay the record: a waiter always re-reads them, and wakes now and then even unnotified,
so that work done elsewhere (a worker restarted meanwhile) is seen too."""

from __future__ import annotations

import threading
import time

# A waiter re-reads its rows at least this often, notified or not.
RECHECK_S = 0.25

_changed = threading.Condition()
_generation = 0


def notify() -> None:
    """Something waiters may be waiting for has happened: every waiter re-reads its rows."""
    global _generation
    with _changed:
        _generation += 1
        _changed.notify_all()


def wait_until(predicate, timeout: float):
    """The first truthy value of ``predicate()`` (read outside the lock), asked again at each
    notification; the last value once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        with _changed:
            seen = _generation
        value = predicate()
        remaining = deadline - time.monotonic()
        if value or remaining <= 0:
            return value
        with _changed:
            if _generation == seen:
                _changed.wait(min(remaining, RECHECK_S))
