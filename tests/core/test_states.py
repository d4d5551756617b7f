"""Tests for kvsp.states: the transition tables of spec 6.3, 6.5, 6.8 and 6.9."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.problems import ProtocolError
from kvsp.states import (
    ASSIGNABLE_INSTANCE_STATES,
    DIRECTIVE_STATES,
    EPOCH_RULES,
    FIRST_SESSION_EPOCH,
    INSTANCE_LIFECYCLE,
    REQUESTABLE_INSTANCE_STATES,
    RESHARD_PHASES,
    DirectiveEvent,
    DirectiveStatus,
    EpochOutcome,
    EpochRole,
    InstanceEvent,
    InstanceState,
    ReshardEvent,
    ReshardPhase,
    TransitionTable,
    accept_epoch,
    next_session_epoch,
)

# The expected tables, written out again from the spec rather than read from the module, so
# that a change to a table has to be made twice: once on purpose, once here.
EXPECTED_INSTANCE = {
    ("active", "sleep-accepted"): "draining",
    ("active", "drain"): "draining",
    ("active", "expired"): "failed",
    ("active", "restarted"): "active",
    ("draining", "drained"): "sleeping",
    ("draining", "activate"): "active",
    ("draining", "expired"): "failed",
    ("draining", "restarted"): "draining",
    ("sleeping", "activate"): "active",
    ("sleeping", "expired"): "failed",
    ("sleeping", "restarted"): "sleeping",
    ("failed", "restarted"): "active",
}
EXPECTED_DIRECTIVE = {
    ("pending", "all-loaded"): "complete",
    ("pending", "deadline-expired"): "partial",
    ("pending", "load-failed"): "failed",
}
EXPECTED_RESHARD = {
    ("preparing", "commit"): "committed",
    ("preparing", "abort"): "aborted",
    ("committed", "commit"): "committed",
    ("aborted", "abort"): "aborted",
}

MACHINES = [
    (INSTANCE_LIFECYCLE, InstanceState, InstanceEvent, EXPECTED_INSTANCE),
    (DIRECTIVE_STATES, DirectiveStatus, DirectiveEvent, EXPECTED_DIRECTIVE),
    (RESHARD_PHASES, ReshardPhase, ReshardEvent, EXPECTED_RESHARD),
]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m[0].machine)
def test_the_table_is_the_expected_one(machine):
    table, states, events, expected = machine
    actual = {
        (state.value, event.value): next_state.value
        for state, row in table.transitions.items()
        for event, next_state in row.items()
    }
    assert actual == expected
    assert set(table.transitions) == set(states)


@given(st.data())
def test_every_state_event_pair(data):
    table, states, events, expected = data.draw(st.sampled_from(MACHINES))
    state = data.draw(st.sampled_from(list(states)))
    event = data.draw(st.sampled_from(list(events)))
    # Plain strings work as well as the enums: records carry states as strings.
    as_given = data.draw(st.sampled_from([(state, event), (state.value, event.value)]))
    if (state.value, event.value) in expected:
        assert table.next_state(*as_given) == expected[(state.value, event.value)]
        assert table.allows(*as_given)
        assert event in table.events_allowed(state)
    else:
        with pytest.raises(ProtocolError) as caught:
            table.next_state(*as_given)
        assert caught.value.problem == "kvsp-invalid-state"
        assert caught.value.status == 409
        assert state.value in caught.value.detail and event.value in caught.value.detail
        assert not table.allows(*as_given)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m[0].machine)
@pytest.mark.parametrize("junk", ["", "ACTIVE", "unknown", None, 3, ["active"]])
def test_unknown_states_and_events_raise(machine, junk):
    table, states, events, _ = machine
    some_state, some_event = next(iter(states)), next(iter(events))
    for pair in [(junk, some_event), (some_state, junk)]:
        with pytest.raises(ProtocolError) as caught:
            table.next_state(*pair)
        assert caught.value.problem == "kvsp-invalid-state"
        assert not table.allows(*pair)


def test_terminal_states():
    assert DIRECTIVE_STATES.terminal_states == {"partial", "complete", "failed"}
    assert INSTANCE_LIFECYCLE.terminal_states == frozenset()
    assert RESHARD_PHASES.terminal_states == frozenset()


def test_spec_rules_of_the_instance_lifecycle():
    # 6.3: a sleeping instance becomes active only on a state change from the PC.
    from_sleeping = {
        event
        for event in InstanceEvent
        if INSTANCE_LIFECYCLE.allows("sleeping", event)
        and INSTANCE_LIFECYCLE.next_state("sleeping", event) == "active"
    }
    assert from_sleeping == {InstanceEvent.ACTIVATE}
    # An instance is failed when its record expires, from any live state.
    for state in ("active", "draining", "sleeping"):
        assert INSTANCE_LIFECYCLE.next_state(state, "expired") == "failed"
    # Only a new incarnation comes back from failed.
    assert INSTANCE_LIFECYCLE.events_allowed("failed") == {InstanceEvent.RESTARTED}
    # Sleeping is reached only by draining first.
    into_sleeping = {
        (state, event)
        for state in InstanceState
        for event in InstanceEvent
        if INSTANCE_LIFECYCLE.allows(state, event)
        and INSTANCE_LIFECYCLE.next_state(state, event) == "sleeping"
        and state != "sleeping"
    }
    assert into_sleeping == {(InstanceState.DRAINING, InstanceEvent.DRAINED)}
    assert ASSIGNABLE_INSTANCE_STATES == {"active"}
    assert REQUESTABLE_INSTANCE_STATES == {"sleeping"}


def test_a_late_commit_after_an_abort_is_refused():
    phase = RESHARD_PHASES.next_state("preparing", "abort")
    assert RESHARD_PHASES.next_state(phase, "abort") == "aborted"  # repeated: idempotent
    with pytest.raises(ProtocolError, match="'commit' is not allowed in state 'aborted'"):
        RESHARD_PHASES.next_state(phase, "commit")
    with pytest.raises(ProtocolError, match="'abort' is not allowed in state 'committed'"):
        RESHARD_PHASES.next_state("committed", "abort")


def test_a_table_needs_a_row_per_state():
    with pytest.raises(ValueError, match="one row per state"):
        TransitionTable("broken", ReshardPhase, ReshardEvent, {ReshardPhase.PREPARING: {}})


# --- Epochs -----------------------------------------------------------------------------------

epochs = st.integers(0, 2**53 - 1)


@given(st.sampled_from(list(EpochRole)), epochs, epochs)
def test_epochs_only_rise(role, current, received):
    if received < current:
        with pytest.raises(ProtocolError) as caught:
            accept_epoch(role, current, received)
        assert caught.value.problem == "kvsp-stale-epoch"
        assert caught.value.status == 409
    elif received == current:
        assert accept_epoch(role, current, received) == current
    elif role == EpochRole.OBSERVER:
        assert accept_epoch(role, current, received) == received
    else:
        with pytest.raises(ProtocolError) as caught:
            accept_epoch(role, current, received)
        assert caught.value.problem == "kvsp-invalid-state"


def test_epoch_rules_table():
    assert {
        (role.value, comparison.value): outcome.value
        for role, row in EPOCH_RULES.items()
        for comparison, outcome in row.items()
    } == {
        ("issuer", "lower"): "stale",
        ("issuer", "same"): "keep",
        ("issuer", "higher"): "unissued",
        ("observer", "lower"): "stale",
        ("observer", "same"): "keep",
        ("observer", "higher"): "advance",
    }
    assert EpochOutcome.STALE == "stale"


def test_session_epochs():
    assert next_session_epoch(None) == FIRST_SESSION_EPOCH == 1
    assert next_session_epoch(1) == 2
    # A resumed session's old instance is refused with the spec's problem type (6.8).
    with pytest.raises(ProtocolError, match="session 6 epoch 1 is lower than the current epoch 2"):
        accept_epoch("issuer", 2, 1, what="session 6 epoch")
    # A front end adopts a higher epoch and then refuses the old one.
    seen = accept_epoch("observer", 1, 2)
    with pytest.raises(ProtocolError):
        accept_epoch("observer", seen, 1)
