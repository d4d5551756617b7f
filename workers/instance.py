"""This instance's row on the node (spec 6.3 Instance Status and Lifecycle): the row itself and
its lock, the state the PC decides and the draining that ends in sleep, the epoch of each
incarnation, what its engine serves, its reports and the links it measured.

Every change to which blocks the node holds, and every lease, happens with the node's row locked
(``lock_node``, a ``select_for_update``), so no eviction races a lease or another placement.
"""

from __future__ import annotations

import logging
import time

from django.db import IntegrityError, transaction
from django.utils import timezone

from kvsp.states import (
    INSTANCE_LIFECYCLE,
    SERVED_SESSION_STATES,
    InstanceEvent,
    ServedSessionEvent,
)
from workers.models import MeasuredLink, Node, NodeState, ServedSession, ServedSessionState

log = logging.getLogger(__name__)


def ensure_node(name: str) -> Node:
    try:
        node, _ = Node.objects.get_or_create(name=name)
    except IntegrityError:  # created concurrently
        node = Node.objects.get(name=name)
    return node


def lock_node(name: str) -> Node:
    """The node's row, locked until the transaction ends: every change to which blocks the
    node holds, and every lease, happens under it."""
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is None:
        ensure_node(name)
        node = Node.objects.select_for_update().get(name=name)
    return node


def do_apply_pc_state(name: str, state: str) -> Node:
    """The PC's decision, from PUT state or from its answer to a status report."""
    node = ensure_node(name)
    if node.state == state or state not in NodeState.values:
        return node  # the common answer changes nothing: no write lock taken
    with transaction.atomic():
        node = lock_node(name)
        if state in NodeState.values and node.state != state:
            event = INSTANCE_LIFECYCLE.event_between(node.state, state)
            log.info("node %s: %s -> %s (the PC's decision)", name, node.state, state)
            node.state = INSTANCE_LIFECYCLE.next_state(node.state, event)
            node.state_changed_at = timezone.now()
            node.save(update_fields=["state", "state_changed_at"])
    return node


# The sessions an instance has admitted and not finished (6.3: a draining instance completes
# them before it sleeps).
IN_FLIGHT_SESSION_STATES = (ServedSessionState.ACCEPTED, ServedSessionState.RUNNING)


def do_enter_sleep_if_drained(name: str, in_flight: int) -> Node:
    """A draining instance with no work in flight sleeps, and says so in its next report.

    ``in_flight`` counts the worker's tasks; the sessions the instance admitted and has not
    finished count too, whether their task is running or still on its way.
    """
    node = ensure_node(name)
    if node.state != NodeState.DRAINING or in_flight:
        return node  # nothing to decide: no write lock taken (the reporter runs this each time)
    with transaction.atomic():
        node = lock_node(name)
        if node.state == NodeState.DRAINING and in_flight == 0:
            in_flight = ServedSession.objects.filter(
                instance=name, state__in=IN_FLIGHT_SESSION_STATES
            ).count()
        if node.state == NodeState.DRAINING and in_flight == 0:
            node.state = INSTANCE_LIFECYCLE.next_state(node.state, InstanceEvent.DRAINED)
            node.state_changed_at = timezone.now()
            node.save(update_fields=["state", "state_changed_at"])
    return node


def do_begin_incarnation(name: str, *, now_ms: int | None = None) -> int:
    """The epoch of a starting incarnation (6.3): its start time in milliseconds, or one more
    than the last epoch when the clock says less (a clock that moved back)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    with transaction.atomic():
        node = lock_node(name)
        node.epoch = max(now_ms, node.epoch + 1)
        node.started_at = timezone.now()
        node.save(update_fields=["epoch", "started_at"])
    return node.epoch


def do_note_engine(name: str, engine: dict | None) -> None:
    """Record what the worker's engine serves (None while it loads), for the HTTP process."""
    ensure_node(name)
    Node.objects.filter(name=name).update(engine=engine)


def do_fail_interrupted_sessions(name: str, node_epoch: int) -> int:
    """Sessions an earlier incarnation was running when it stopped are over here: the PC
    resumes them elsewhere, since the restart raised the instance's epoch (6.3, 6.8)."""
    return ServedSession.objects.filter(
        instance=name, state=ServedSessionState.RUNNING, node_epoch__lt=node_epoch
    ).update(
        state=SERVED_SESSION_STATES.next_state(ServedSessionState.RUNNING, ServedSessionEvent.FAIL),
        reason="the instance's worker stopped while serving it",
        finished_at=timezone.now(),
    )


def do_note_report(name: str, error: str = "") -> None:
    fields = {"last_report_error": error}
    if not error:
        fields["last_report_at"] = timezone.now()
    Node.objects.filter(name=name).update(**fields)


# Weight of a new measurement in the smoothed link figures.
LINK_SMOOTHING = 0.3


def do_record_link(
    name: str, holder: str, *, rtt_us: float | None = None, mbit_per_s: float | None = None
) -> None:
    """Fold one measurement into the node's figures for its link to ``holder``."""
    now = timezone.now()
    with transaction.atomic():
        # Under the node's lock: two loads measuring a new link at once make one row.
        lock_node(name)
        row = MeasuredLink.objects.select_for_update().filter(instance=name, holder=holder).first()
        if row is None:
            if rtt_us is None or mbit_per_s is None:
                return
            MeasuredLink.objects.create(
                instance=name,
                holder=holder,
                rtt_us=rtt_us,
                mbit_per_s=mbit_per_s,
                samples=1,
                measured_at=now,
            )
            return
        if rtt_us is not None:
            row.rtt_us += LINK_SMOOTHING * (rtt_us - row.rtt_us)
        if mbit_per_s is not None:
            row.mbit_per_s += LINK_SMOOTHING * (mbit_per_s - row.mbit_per_s)
        row.samples += 1
        row.measured_at = now
        row.save()
