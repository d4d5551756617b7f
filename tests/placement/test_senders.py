"""The threads that send directives and state changes to instances keep their database
connection while work keeps coming, and give it back when idle or closed."""

import threading

import pytest
from django.db import connection

from placement.delivery import Senders
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def backend_of_sender(senders: Senders) -> int:
    """The Postgres backend that served one piece of work on ``senders``."""
    done = threading.Event()
    found = []

    def work():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            found.append(cursor.fetchone()[0])
        done.set()

    senders.submit(work)
    assert done.wait(10)
    return found[0]


def backends_of(pid: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone()[0]


def test_a_busy_sender_keeps_its_connection_and_an_idle_one_closes_it():
    senders = Senders(1, idle_s=0.3)
    try:
        first = backend_of_sender(senders)
        assert backend_of_sender(senders) == first
        # Idle for longer than idle_s: the backend goes, and the next work opens another.
        wait_until(lambda: backends_of(first) == 0, "the idle sender's backend to go", timeout=10)
        assert backend_of_sender(senders) != first
    finally:
        senders.close()


def test_closed_senders_end_their_threads_and_connections():
    before = set(threading.enumerate())
    senders = Senders(2, idle_s=60)
    backend = backend_of_sender(senders)
    senders.close()
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("kvsp-")]
    wait_until(lambda: backends_of(backend) == 0, "the closed sender's backend to go", timeout=10)
    with pytest.raises(RuntimeError):
        senders.submit(lambda: None)


def test_work_that_raises_leaves_the_sender_serving():
    senders = Senders(1, idle_s=60)
    try:

        def broken():
            raise ValueError("the instance answered nonsense")

        senders.submit(broken)
        assert backend_of_sender(senders) > 0
    finally:
        senders.close()


def test_a_slow_message_does_not_hold_up_the_next_one():
    """A send that waits on an unresponsive instance leaves the next directive to another
    sender, up to the pool's size."""
    senders = Senders(2, idle_s=60)
    stuck, released, later = threading.Event(), threading.Event(), threading.Event()
    try:
        senders.submit(lambda: (stuck.set(), released.wait(30)))
        assert stuck.wait(10)
        senders.submit(later.set)
        assert later.wait(10), "the second message waited for the first"
    finally:
        released.set()
        senders.close()
