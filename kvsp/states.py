"""The state machines of KVSP: instance lifecycle (spec 6.3), prefetch directive states (6.5),
sessions as the PC follows them and as an instance serves them (6.8), reshard phases (6.9) and
session epochs (6.3, 6.8).

Each machine is one transition table below, in the manner of h11's ``_state.py``: a state maps
the events allowed in it to the state they lead to, and every pair not in the table is illegal.
``TransitionTable.next_state`` answers a pair or raises ``ProtocolError("kvsp-invalid-state")``.
The tables hold the states and events only; who observes an event (the PC reading a status
record, a clock, an operator) is written next to each edge.

Every change of a state, on the PC and on a node, asks its table: one row at a time with
``next_state``, and many rows in one conditional UPDATE restricted to ``sources(event)`` and set
to ``target(event)``, so that the database refuses an illegal transition as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Generic, TypeVar

from kvsp.problems import ProtocolError

S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)


class TransitionTable(Generic[S, E]):
    """One state machine: ``transitions[state][event]`` is the next state."""

    __slots__ = ("machine", "states", "events", "transitions")

    def __init__(
        self,
        machine: str,
        states: type[S],
        events: type[E],
        transitions: Mapping[S, Mapping[E, S]],
    ):
        # Every state has a row, even a terminal one, so that a state missing from the table is
        # a mistake in the table and not a silent "nothing allowed".
        if set(transitions) != set(states):
            raise ValueError(f"{machine}: the table must have one row per state")
        self.machine = machine
        self.states = states
        self.events = events
        self.transitions = MappingProxyType(
            {state: MappingProxyType(dict(row)) for state, row in transitions.items()}
        )

    def next_state(self, state: S | str, event: E | str) -> S:
        """The state ``event`` leads to from ``state``; an illegal pair raises."""
        try:
            return self.transitions[state][event]
        except (KeyError, TypeError):
            raise ProtocolError(
                "kvsp-invalid-state",
                f"{self.machine}: {_name(event)!r} is not allowed in state {_name(state)!r}",
            ) from None

    def allows(self, state: S | str, event: E | str) -> bool:
        try:
            return event in self.transitions[state]
        except (KeyError, TypeError):
            return False

    def events_allowed(self, state: S | str) -> frozenset[E]:
        try:
            return frozenset(self.transitions[state])
        except (KeyError, TypeError):
            return frozenset()

    @property
    def terminal_states(self) -> frozenset[S]:
        return frozenset(state for state, row in self.transitions.items() if not row)

    def sources(self, event: E | str) -> frozenset[S]:
        """The states in which ``event`` is allowed: what an UPDATE applying it to many rows
        restricts them to."""
        return frozenset(state for state, row in self.transitions.items() if event in row)

    def target(self, event: E | str) -> S:
        """The one state ``event`` leads to from every state that allows it, for an UPDATE that
        applies it to many rows; an event whose next state depends on the state cannot be one
        UPDATE (ValueError)."""
        targets = {row[event] for row in self.transitions.values() if event in row}
        if len(targets) != 1:
            raise ValueError(f"{self.machine}: {_name(event)!r} leads to {len(targets)} states")
        return targets.pop()

    def event_between(self, state: S | str, next_state: S | str) -> E:
        """An event that leads from ``state`` to ``next_state``, for a party that learns of
        another's transitions from the states it reports (the PC reading a directive's state,
        a node told the PC's decision); a state no event reaches raises."""
        try:
            row = self.transitions.get(state, {})
        except TypeError:
            row = {}
        for event, reached in row.items():
            if reached == next_state:
                return event
        raise ProtocolError(
            "kvsp-invalid-state",
            f"{self.machine}: nothing leads from state {_name(state)!r} to {_name(next_state)!r}",
        )


def _name(value: object) -> str:
    return str(value) if isinstance(value, str) else type(value).__name__


# --- Instance lifecycle (spec 6.3) ------------------------------------------------------------


class InstanceState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


class InstanceEvent(StrEnum):
    # A status record asked for "requested_state": "sleeping" and the PC accepted, answering the
    # status PUT with {"state": "draining"}. (A refusal answers {"state": "active"} and changes
    # nothing, so it is not an event.)
    SLEEP_ACCEPTED = "sleep-accepted"
    # The PC decided on its own (an operator, a scale-down policy) to drain the instance and sent
    # PUT state with "draining".
    DRAIN = "drain"
    # A draining instance has no in-flight sessions left and reports "state": "sleeping".
    DRAINED = "drained"
    # The PC changed the state to active with PUT state: the only way out of sleeping.
    ACTIVATE = "activate"
    # The instance's status record expired without a refresh: the PC considers it failed.
    EXPIRED = "expired"
    # A status record arrived with an epoch higher than any seen for the instance: it restarted.
    RESTARTED = "restarted"


_I = InstanceState
_IE = InstanceEvent

INSTANCE_LIFECYCLE: TransitionTable[InstanceState, InstanceEvent] = TransitionTable(
    "instance lifecycle",
    InstanceState,
    InstanceEvent,
    {
        _I.ACTIVE: {
            _IE.SLEEP_ACCEPTED: _I.DRAINING,
            _IE.DRAIN: _I.DRAINING,
            _IE.EXPIRED: _I.FAILED,
            # A restart noticed before the old record expired: the new incarnation has lost the
            # old one's sessions (the PC resumes them elsewhere) but is otherwise ready to serve.
            _IE.RESTARTED: _I.ACTIVE,
        },
        _I.DRAINING: {
            _IE.DRAINED: _I.SLEEPING,
            # The PC may take a drain back when it needs the capacity again.
            _IE.ACTIVATE: _I.ACTIVE,
            _IE.EXPIRED: _I.FAILED,
            # The PC's decision to drain outlives a restart; it answers the new incarnation's
            # status PUT with {"state": "draining"}, and with no sessions left the instance
            # reports sleeping at once.
            _IE.RESTARTED: _I.DRAINING,
        },
        _I.SLEEPING: {
            # "A sleeping instance becomes active only on a state change from the PC."
            _IE.ACTIVATE: _I.ACTIVE,
            _IE.EXPIRED: _I.FAILED,
            # A restart does not wake a sleeping instance, for the same reason.
            _IE.RESTARTED: _I.SLEEPING,
        },
        _I.FAILED: {
            # Only a new incarnation comes back. A record of the old epoch arriving after expiry
            # is refused: the PC has already resumed that incarnation's sessions elsewhere under
            # higher session epochs, and the instance must restart to rejoin.
            _IE.RESTARTED: _I.ACTIVE,
        },
    },
)

# "The PC MUST NOT assign new requests or send prefetch directives to an instance that is not
# active."
ASSIGNABLE_INSTANCE_STATES = frozenset({InstanceState.ACTIVE})

# The only state an instance may ask for in "requested_state" (6.3): it may ask to sleep, but
# waking is the PC's decision alone.
REQUESTABLE_INSTANCE_STATES = frozenset({InstanceState.SLEEPING})

# The states an operator or the PC may set with PUT state (6.3): "failed" is the PC's view of an
# instance whose record expired, never a state it is asked to take.
SETTABLE_INSTANCE_STATES = frozenset(
    {InstanceState.ACTIVE, InstanceState.DRAINING, InstanceState.SLEEPING}
)


# --- Prefetch directive states (spec 6.5, DESIGN.md section 3) --------------------------------


class DirectiveState(StrEnum):
    """The state of a prefetch directive, as its status resource reports it
    (``records.DirectiveStatusRecord``)."""

    PENDING = "pending"
    PARTIAL = "partial"
    COMPLETE = "complete"
    FAILED = "failed"


class DirectiveEvent(StrEnum):
    # Every block of the directive is held by the instance (loaded now or held before).
    ALL_LOADED = "all-loaded"
    # The deadline expired: the instance stops loading and reports "partial" with the keys it
    # loaded (possibly none); the request is served with that prefix (6.5).
    DEADLINE_EXPIRED = "deadline-expired"
    # The directive cannot be carried out at all: no source of the first missing block could
    # serve it, the instance is not authorized for the scope, or the instance is not active.
    LOAD_FAILED = "load-failed"


_D = DirectiveState
_DE = DirectiveEvent

DIRECTIVE_STATES: TransitionTable[DirectiveState, DirectiveEvent] = TransitionTable(
    "prefetch directive",
    DirectiveState,
    DirectiveEvent,
    {
        _D.PENDING: {
            _DE.ALL_LOADED: _D.COMPLETE,
            _DE.DEADLINE_EXPIRED: _D.PARTIAL,
            _DE.LOAD_FAILED: _D.FAILED,
        },
        # Terminal: the deadline has passed or loading has ended, so nothing more is loaded for
        # this directive; the PC sends a new directive if it wants more.
        _D.PARTIAL: {},
        _D.COMPLETE: {},
        _D.FAILED: {},
    },
)


# --- Sessions, as the PC follows them (spec 6.8) -----------------------------------------------


class SessionState(StrEnum):
    """A session as the PC follows it, under the epochs it issues (``accept_epoch``)."""

    RUNNING = "running"
    # The serving instance failed; the PC raised the epoch and is resuming it elsewhere.
    RESUMING = "resuming"
    COMPLETED = "completed"
    # No checkpoint to resume from.
    FAILED = "failed"


class SessionEvent(StrEnum):
    # The instance the session resumes on sent a checkpoint under the new epoch: it serves the
    # session now.
    RESUMED = "resumed"
    # The front end holds every output token up to the one the instance marked final. Tokens
    # posted again after that change nothing.
    DELIVERED = "delivered"
    # The serving instance failed or restarted, or the one chosen to resume the session on
    # refused or never answered: the PC resumes it elsewhere from its latest checkpoint (or
    # waits, resuming, for an instance to resume it on).
    FAIL_OVER = "fail-over"
    # The same, for a session without a checkpoint: there is nothing to resume from.
    NOTHING_TO_RESUME = "nothing-to-resume"


_SS = SessionState
_SE = SessionEvent

SESSION_STATES: TransitionTable[SessionState, SessionEvent] = TransitionTable(
    "session",
    SessionState,
    SessionEvent,
    {
        _SS.RUNNING: {
            _SE.DELIVERED: _SS.COMPLETED,
            _SE.FAIL_OVER: _SS.RESUMING,
            _SE.NOTHING_TO_RESUME: _SS.FAILED,
        },
        _SS.RESUMING: {
            _SE.RESUMED: _SS.RUNNING,
            # A deterministic sampler's tokens need no acknowledged checkpoint: the resumed
            # instance may deliver the last of them before it checkpoints.
            _SE.DELIVERED: _SS.COMPLETED,
            # The instance chosen refused or never answered, or none was found yet.
            _SE.FAIL_OVER: _SS.RESUMING,
            _SE.NOTHING_TO_RESUME: _SS.FAILED,
        },
        _SS.COMPLETED: {_SE.DELIVERED: _SS.COMPLETED},
        _SS.FAILED: {},
    },
)


# --- Sessions, as an instance serves them (spec 6.8) -------------------------------------------


class ServedSessionState(StrEnum):
    """A session an instance serves under one session epoch."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    COMPLETED = "completed"
    # The PC answered with a higher epoch (or another instance): it is served elsewhere now.
    SUPERSEDED = "superseded"
    FAILED = "failed"


class ServedSessionEvent(StrEnum):
    START = "start"  # the worker takes the row up
    COMPLETE = "complete"  # the last output token is delivered
    SUPERSEDE = "supersede"  # the PC answered with a higher epoch or another instance
    FAIL = "fail"  # the instance could not go on


_V = ServedSessionState
_VE = ServedSessionEvent

SERVED_SESSION_STATES: TransitionTable[ServedSessionState, ServedSessionEvent] = TransitionTable(
    "served session",
    ServedSessionState,
    ServedSessionEvent,
    {
        _V.ACCEPTED: {
            _VE.START: _V.RUNNING,
            _VE.SUPERSEDE: _V.SUPERSEDED,
            _VE.FAIL: _V.FAILED,
        },
        _V.RUNNING: {
            _VE.COMPLETE: _V.COMPLETED,
            _VE.SUPERSEDE: _V.SUPERSEDED,
            _VE.FAIL: _V.FAILED,
        },
        _V.COMPLETED: {},
        _V.SUPERSEDED: {},
        _V.FAILED: {},
    },
)


# --- Reshard phases (spec 6.9, DESIGN.md section 3) -------------------------------------------


class ReshardPhase(StrEnum):
    PREPARING = "preparing"
    COMMITTED = "committed"
    ABORTED = "aborted"


class ReshardEvent(StrEnum):
    # POST reshard {"map", "commit": v+1}: every member acknowledged the plan.
    COMMIT = "commit"
    # POST reshard {"map", "abort": v+1}: a member did not acknowledge within deadline_ms.
    ABORT = "abort"


_R = ReshardPhase
_RE = ReshardEvent

RESHARD_PHASES: TransitionTable[ReshardPhase, ReshardEvent] = TransitionTable(
    "reshard",
    ReshardPhase,
    ReshardEvent,
    {
        _R.PREPARING: {_RE.COMMIT: _R.COMMITTED, _RE.ABORT: _R.ABORTED},
        # Commit and abort are idempotent, because the PC repeats them to members that did not
        # answer; the opposite message after either is a late or confused peer and is refused
        # (a commit after an abort would make a discarded version authoritative).
        _R.COMMITTED: {_RE.COMMIT: _R.COMMITTED},
        _R.ABORTED: {_RE.ABORT: _R.ABORTED},
    },
)


# --- Epochs (spec 6.3 instance epochs, 6.8 session epochs) ------------------------------------

# Session epochs start at 1, as in the spec's checkpoint example; the PC raises a session's
# epoch by one each time it resumes the session elsewhere (6.8).
FIRST_SESSION_EPOCH = 1


class EpochRole(StrEnum):
    # The party that raises the epoch itself: the PC for a session's epoch. A message that
    # claims an epoch it never issued is refused.
    ISSUER = "issuer"
    # A party that learns epochs from others: the PC reading instance status records (an
    # instance raises its own epoch on restart), a front end reading output tokens. A higher
    # epoch is adopted.
    OBSERVER = "observer"


class EpochComparison(StrEnum):
    LOWER = "lower"
    SAME = "same"
    HIGHER = "higher"


class EpochOutcome(StrEnum):
    STALE = "stale"  # refused with kvsp-stale-epoch
    KEEP = "keep"  # accepted, the current epoch stays
    ADVANCE = "advance"  # accepted, the received epoch becomes current
    UNISSUED = "unissued"  # refused with kvsp-invalid-state


EPOCH_RULES: Mapping[EpochRole, Mapping[EpochComparison, EpochOutcome]] = MappingProxyType(
    {
        EpochRole.ISSUER: MappingProxyType(
            {
                EpochComparison.LOWER: EpochOutcome.STALE,
                EpochComparison.SAME: EpochOutcome.KEEP,
                EpochComparison.HIGHER: EpochOutcome.UNISSUED,
            }
        ),
        EpochRole.OBSERVER: MappingProxyType(
            {
                EpochComparison.LOWER: EpochOutcome.STALE,
                EpochComparison.SAME: EpochOutcome.KEEP,
                EpochComparison.HIGHER: EpochOutcome.ADVANCE,
            }
        ),
    }
)


def compare_epochs(current: int, received: int) -> EpochComparison:
    if received < current:
        return EpochComparison.LOWER
    if received == current:
        return EpochComparison.SAME
    return EpochComparison.HIGHER


def accept_epoch(role: EpochRole | str, current: int, received: int, what: str = "epoch") -> int:
    """The epoch that is current after a message carrying ``received``; refusals raise.

    An epoch only rises: a message with a lower epoch than the current one is stale
    (``kvsp-stale-epoch``). ``what`` names the thing the epoch belongs to in the detail.
    """
    outcome = EPOCH_RULES[role][compare_epochs(current, received)]
    if outcome is EpochOutcome.STALE:
        raise ProtocolError(
            "kvsp-stale-epoch", f"{what} {received} is lower than the current epoch {current}"
        )
    if outcome is EpochOutcome.UNISSUED:
        raise ProtocolError(
            "kvsp-invalid-state", f"{what} {received} is higher than the current epoch {current}"
        )
    return received if outcome is EpochOutcome.ADVANCE else current


def next_session_epoch(current: int | None) -> int:
    """The epoch the PC gives a new session (``current`` None) or a resumed one (6.8)."""
    return FIRST_SESSION_EPOCH if current is None else current + 1
