"""A wait in one process for work another process does (a reshard plan's request waiting for
the worker to load its fetch ranges) is woken by a Postgres notification when that work
commits, not found by re-reading rows every few milliseconds (``workers.notices``)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from tests.support.waiting import in_thread, wait_until
from workers import notices

pytestmark = pytest.mark.django_db(transaction=True)

# Longer than any test here may wait: a wait that is not woken does not end in time.
NEVER_S = 600


def waiting(channel: str, predicate) -> tuple[threading.Thread, list]:
    return in_thread(lambda: notices.wait_across(channel, predicate, NEVER_S, recheck_s=NEVER_S))


def listening(channel: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s", [f'LISTEN "{channel}"']
        )
        return cursor.fetchone()[0] == 1


def test_an_announcement_wakes_the_waiter_once_its_transaction_commits():
    done, looks = [], []

    def settled():
        looks.append(len(done))
        return bool(done)

    thread, answers = waiting("kvsp_test_move_1", settled)
    try:
        wait_until(lambda: listening("kvsp_test_move_1"), "the waiter to listen")
        with transaction.atomic():
            done.append(True)
            notices.announce("kvsp_test_move_1")
            # Not before the commit: the waiter would read rows that do not say so yet.
            thread.join(timeout=0.5)
            assert thread.is_alive()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the announcement did not wake the waiter"
        assert answers == [True]
        # One look before the announcement, one after it: no polling in between.
        assert looks == [0, 1]
    finally:
        done.append(True)
        notices.announce("kvsp_test_move_1")
        thread.join(timeout=30)


def test_another_channel_does_not_wake_the_waiter():
    done = []
    thread, answers = waiting("kvsp_test_move_2", lambda: bool(done))
    try:
        wait_until(lambda: listening("kvsp_test_move_2"), "the waiter to listen")
        done.append(True)
        notices.announce("kvsp_test_move_3")
        thread.join(timeout=1)
        assert thread.is_alive() and not answers
    finally:
        notices.announce("kvsp_test_move_2")
        thread.join(timeout=30)
    assert answers == [True]


def test_a_wait_ends_at_its_timeout_with_the_last_look():
    assert notices.wait_across("kvsp_test_move_4", lambda: None, 0.2) is None
