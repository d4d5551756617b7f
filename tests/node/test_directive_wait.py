"""A generation that carries the request_ref of a placement waits for that placement's prefetch
directive (``workers.generation.wait_for_directive``): until every block of it is in the
instance's tiers, or until it ends, and not for the records still on their way to the IS."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.support.waiting import in_thread
from workers import notices
from workers.generation import wait_for_directive
from workers.models import Directive, DirectiveState

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = [f"{index:064x}" for index in range(1, 5)]


def pending_directive(loaded: list[str]) -> Directive:
    now = timezone.now()
    return Directive.objects.create(
        instance="ii1",
        directive=uuid.uuid4(),
        request_ref="placement-1",
        compat_id=b"\x01" * 32,
        scope_id=b"\x02" * 16,
        body={"blocks": [{"block_key": key, "sources": ["http://h/kvsp/"]} for key in KEYS]},
        loaded=loaded,
        received_at=now,
        # Far beyond the test: a wait that lasted until the deadline would never end here.
        deadline_at=now + timedelta(seconds=600),
    )


def waiting() -> tuple[threading.Thread, list]:
    return in_thread(lambda: wait_for_directive("ii1", "placement-1"))


def end(row: Directive) -> None:
    Directive.objects.filter(pk=row.pk).update(state=DirectiveState.COMPLETE)
    notices.notify()


def test_a_directive_with_every_block_loaded_lets_the_generation_go_while_still_pending():
    row = pending_directive(loaded=list(KEYS))
    thread, answers = waiting()
    thread.join(timeout=30)
    try:
        assert not thread.is_alive(), "the generation waited for the directive to end"
        assert answers[0].pk == row.pk and answers[0].state == DirectiveState.PENDING
    finally:
        end(row)
        thread.join(timeout=30)


def test_a_generation_waits_while_blocks_are_missing_and_goes_once_the_rest_are_admitted():
    row = pending_directive(loaded=KEYS[:2])
    thread, answers = waiting()
    thread.join(timeout=0.5)
    try:
        assert thread.is_alive() and not answers
        # What the loader does when it has admitted a batch (workers.directives).
        Directive.objects.filter(pk=row.pk).update(loaded=list(KEYS))
        notices.notify()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert answers[0].loaded == KEYS
    finally:
        end(row)
        thread.join(timeout=30)
