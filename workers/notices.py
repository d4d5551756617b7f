"""Wake-ups on a node, rather than polling rows.

Within a process: a thread that waits for what another thread of the same process does (a
generation waiting for the prefetch directive of its placement, which this process loads) sleeps
on a condition that the other thread notifies (``notify``, ``wait_until``).

Across processes: a request in the node's HTTP process that waits for what its worker does (a
reshard plan's answer waiting for the worker to load the fetch ranges) listens on a Postgres
channel the worker notifies when its transaction commits (``announce``, ``wait_across``). On a
database without notifications (SQLite, the embedded default) the waiter re-reads its rows
every ``ACROSS_POLL_S`` instead.

The rows stay the record: a waiter always re-reads them, and wakes now and then even unnotified,
so that work done elsewhere (a worker restarted meanwhile) is seen too."""

from __future__ import annotations

import threading
import time

from django.db import connection
from psycopg import sql

# A waiter re-reads its rows at least this often, notified or not.
RECHECK_S = 0.25
# How often a waiter across processes re-reads its rows where the database cannot notify.
ACROSS_POLL_S = 0.01

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


def announce(channel: str) -> None:
    """Wake the waiters on ``channel`` in other processes: when the current transaction commits,
    or at once outside one. Nothing where the database cannot notify."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [channel])


def wait_across(channel: str, predicate, timeout: float, *, recheck_s: float = RECHECK_S):
    """``wait_until`` for work another process does and ``announce``s on ``channel`` (a
    Postgres identifier). The waiter listens on a connection of its own, opened before the
    first look at its rows, so that no announcement between a look and the wait is missed."""
    if connection.vendor != "postgresql":
        return _polled(predicate, timeout)
    listener = connection.get_new_connection(connection.get_connection_params())
    try:
        listener.autocommit = True
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            remaining = deadline - time.monotonic()
            if value or remaining <= 0:
                return value
            for _ in listener.notifies(timeout=min(remaining, recheck_s), stop_after=1):
                pass
    finally:
        listener.close()


def _polled(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(ACROSS_POLL_S)
