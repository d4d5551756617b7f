"""The node's changes of state, each through its table in ``kvsp.states``: the PC's decisions
along the instance lifecycle (6.3), and the sessions it serves, taken up and ended once (6.8)."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from kvsp.problems import ProtocolError
from kvsp.states import ServedSessionEvent
from workers import instance
from workers.models import Node, ServedSession
from workers.served_sessions import do_finish, do_start

pytestmark = pytest.mark.django_db

NAME = "ii-states"


def node_state() -> str:
    return Node.objects.get(name=NAME).state


def test_the_node_follows_the_pcs_decisions_along_the_lifecycle():
    assert instance.ensure_node(NAME).state == "active"
    for decided in ("draining", "sleeping", "active", "draining", "active"):
        assert instance.do_apply_pc_state(NAME, decided).state == decided
        assert node_state() == decided


@pytest.mark.parametrize(
    ("state", "decided"),
    [
        # Sleep comes only after draining (6.3).
        ("active", "sleeping"),
        # A sleeping instance is woken by the PC, not sent back to draining.
        ("sleeping", "draining"),
    ],
)
def test_a_decision_the_lifecycle_does_not_allow_is_refused_and_changes_nothing(state, decided):
    instance.ensure_node(NAME)
    Node.objects.filter(name=NAME).update(state=state)
    with pytest.raises(ProtocolError) as caught:
        instance.do_apply_pc_state(NAME, decided)
    assert caught.value.problem == "kvsp-invalid-state"
    assert f"nothing leads from state '{state}' to '{decided}'" in caught.value.detail
    assert node_state() == state
    assert Node.objects.get(name=NAME).state_changed_at is None


def served(state: str, *, node_epoch: int = 0) -> ServedSession:
    return ServedSession.objects.create(
        instance=NAME,
        session=uuid.uuid4(),
        epoch=1,
        kind="generate",
        scope_id=bytes(16),
        compat_id=bytes(32),
        body={},
        state=state,
        node_epoch=node_epoch,
        received_at=timezone.now(),
    )


def test_a_served_session_is_taken_up_once_and_ends_once():
    row = served("accepted")
    assert do_start(row.pk, node_epoch=7)
    assert not do_start(row.pk, node_epoch=8)  # a task delivered again
    assert do_finish(row.pk, ServedSessionEvent.COMPLETE, produced=4) == "completed"
    with pytest.raises(ProtocolError) as caught:
        do_finish(row.pk, ServedSessionEvent.FAIL, "late")
    assert caught.value.problem == "kvsp-invalid-state"
    row.refresh_from_db()
    assert (row.state, row.node_epoch, row.produced, row.reason) == ("completed", 7, 4, "")


def test_an_accepted_session_cannot_complete_before_it_runs():
    row = served("accepted")
    with pytest.raises(ProtocolError, match="'complete' is not allowed in state 'accepted'"):
        do_finish(row.pk, ServedSessionEvent.COMPLETE)
    assert ServedSession.objects.get(pk=row.pk).state == "accepted"


def test_a_restart_fails_only_what_the_earlier_incarnation_was_running():
    rows = {
        "running before": served("running", node_epoch=1),
        "running now": served("running", node_epoch=2),
        "accepted": served("accepted"),
        "completed": served("completed", node_epoch=1),
    }
    assert instance.do_fail_interrupted_sessions(NAME, node_epoch=2) == 1
    states = {key: ServedSession.objects.get(pk=row.pk).state for key, row in rows.items()}
    assert states == {
        "running before": "failed",
        "running now": "running",
        "accepted": "accepted",
        "completed": "completed",
    }
