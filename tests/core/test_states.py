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
    SERVED_SESSION_STATES,
    SESSION_STATES,
    DirectiveEvent,
    DirectiveState,
    EpochOutcome,
    EpochRole,
    InstanceEvent,
    InstanceState,
    ReshardEvent,
    ReshardPhase,
    ServedSessionEvent,
    ServedSessionState,
    SessionEvent,
    SessionState,
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
EXPECTED_SESSION = {
    ("running", "delivered"): "completed",
    ("running", "fail-over"): "resuming",
    ("running", "nothing-to-resume"): "failed",
    ("resuming", "resumed"): "running",
    ("resuming", "delivered"): "completed",
    ("resuming", "fail-over"): "resuming",
    ("resuming", "nothing-to-resume"): "failed",
    ("completed", "delivered"): "completed",
}
EXPECTED_SERVED_SESSION = {
    ("accepted", "start"): "running",
    ("accepted", "supersede"): "superseded",
    ("accepted", "fail"): "failed",
    ("running", "complete"): "completed",
    ("running", "supersede"): "superseded",
    ("running", "fail"): "failed",
}
EXPECTED_RESHARD = {
    ("preparing", "commit"): "committed",
    ("preparing", "abort"): "aborted",
    ("committed", "commit"): "committed",
    ("aborted", "abort"): "aborted",
}

MACHINES = [
    (INSTANCE_LIFECYCLE, InstanceState, InstanceEvent, EXPECTED_INSTANCE),
    (DIRECTIVE_STATES, DirectiveState, DirectiveEvent, EXPECTED_DIRECTIVE),
    (SESSION_STATES, SessionState, SessionEvent, EXPECTED_SESSION),
    (SERVED_SESSION_STATES, ServedSessionState, ServedSessionEvent, EXPECTED_SERVED_SESSION),
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
    assert SESSION_STATES.terminal_states == {"failed"}
    assert SERVED_SESSION_STATES.terminal_states == {"completed", "superseded", "failed"}


@given(st.data())
def test_many_rows_change_together_only_where_the_table_allows(data):
    # A conditional UPDATE applies an event to the rows in sources(event) and sets target(event):
    # the same as asking next_state of each row, and nothing for a row in any other state.
    table, states, events, expected = data.draw(st.sampled_from(MACHINES))
    event = data.draw(st.sampled_from(list(events)))
    allowed = {state for (state, on), _ in expected.items() if on == event.value}
    assert table.sources(event) == allowed
    assert table.sources(event.value) == allowed
    targets = {next_state for (_, on), next_state in expected.items() if on == event.value}
    if len(targets) == 1:
        assert table.target(event) == targets.pop()
        for state in allowed:
            assert table.next_state(state, event) == table.target(event)
    else:
        with pytest.raises(ValueError, match="leads to"):
            table.target(event)


def test_the_bulk_changes_the_code_makes_have_one_target():
    assert DIRECTIVE_STATES.sources("load-failed") == {"pending"}
    assert DIRECTIVE_STATES.target("load-failed") == "failed"
    assert SESSION_STATES.sources("fail-over") == {"running", "resuming"}
    assert SESSION_STATES.target("fail-over") == "resuming"
    # An instance's restart keeps each state but failed: no single UPDATE for it.
    with pytest.raises(ValueError):
        INSTANCE_LIFECYCLE.target("restarted")


@given(st.data())
def test_the_event_between_two_states(data):
    table, states, events, expected = data.draw(st.sampled_from(MACHINES))
    state = data.draw(st.sampled_from(list(states)))
    reported = data.draw(st.sampled_from(list(states)))
    leading = {on for (start, on), end in expected.items() if (start, end) == (state, reported)}
    if leading:
        event = table.event_between(state.value, reported.value)
        assert event in leading
        assert table.next_state(state, event) == reported
    else:
        with pytest.raises(ProtocolError) as caught:
            table.event_between(state, reported)
        assert caught.value.problem == "kvsp-invalid-state"
        assert state.value in caught.value.detail and reported.value in caught.value.detail


@pytest.mark.parametrize("junk", ["", "unknown", None, ["active"]])
def test_the_event_between_unknown_states_is_refused(junk):
    for pair in [(junk, "active"), ("active", junk)]:
        with pytest.raises(ProtocolError) as caught:
            INSTANCE_LIFECYCLE.event_between(*pair)
        assert caught.value.problem == "kvsp-invalid-state"


def test_a_node_follows_the_pcs_decisions_only_along_the_lifecycle():
    # The PC's answer names a state; the node takes the event that leads there. Sleep comes
    # only after draining, and a sleeping node does not go back to draining.
    assert INSTANCE_LIFECYCLE.event_between("active", "draining") in {
        InstanceEvent.SLEEP_ACCEPTED,
        InstanceEvent.DRAIN,
    }
    assert INSTANCE_LIFECYCLE.event_between("draining", "sleeping") == InstanceEvent.DRAINED
    assert INSTANCE_LIFECYCLE.event_between("sleeping", "active") == InstanceEvent.ACTIVATE
    for state, decided in [("active", "sleeping"), ("sleeping", "draining")]:
        with pytest.raises(ProtocolError, match=f"nothing leads from state '{state}'"):
            INSTANCE_LIFECYCLE.event_between(state, decided)


def test_spec_rules_of_sessions():
    # 6.8: a session is resumed elsewhere from its latest checkpoint; one that ended is not.
    assert SESSION_STATES.sources(SessionEvent.FAIL_OVER) == {"running", "resuming"}
    assert not SESSION_STATES.allows("completed", "fail-over")
    assert not SESSION_STATES.allows("failed", "fail-over")
    # Running again only once the instance it resumes on checkpoints under the new epoch.
    into_running = {
        (state, event)
        for (state, event), next_state in EXPECTED_SESSION.items()
        if next_state == "running"
    }
    assert into_running == {("resuming", "resumed")}
    # Tokens posted again after the last one change nothing; a failed session takes none.
    assert SESSION_STATES.next_state("completed", "delivered") == "completed"
    with pytest.raises(ProtocolError, match="'delivered' is not allowed in state 'failed'"):
        SESSION_STATES.next_state("failed", "delivered")
    # A served session is taken up once, and ends once.
    with pytest.raises(ProtocolError, match="'start' is not allowed in state 'running'"):
        SERVED_SESSION_STATES.next_state("running", "start")
    with pytest.raises(ProtocolError, match="'fail' is not allowed in state 'completed'"):
        SERVED_SESSION_STATES.next_state("completed", "fail")


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
