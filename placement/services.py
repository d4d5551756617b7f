"""Writes of the Placement Controller (spec 6.3-6.5): instance registration, status reports and
the lifecycle, failure detection, placement and the prefetch directives it sends.

The sessions of an instance that failed or restarted are the sessions app's to move: this module
starts its task by name (``FAIL_OVER_INSTANCE_SESSIONS``), as placement never imports sessions.

Every change of an instance's state goes through ``_transition``, which asks the lifecycle table
of ``kvsp.states``, and every change of a directive's state asks the directive table; views,
tasks, the admin and the dashboard call these functions.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from common.tasks import enqueue, run_now_by_name
from kvsp.hexids import is_hex
from kvsp.problems import ProtocolError
from kvsp.records import InstanceStatusRecord, StateAnswer, base_url_rule_broken
from kvsp.states import DIRECTIVE_STATES, INSTANCE_LIFECYCLE, DirectiveEvent, InstanceEvent
from placement import policy
from placement.models import Directive, Instance, InstanceState, StatusSample

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")


def check_instance_name(name: str) -> str:
    """Instance names become queue names (``ii.<name>``): lowercase, digits, '.', '_', '-'."""
    if not _NAME.fullmatch(name):
        raise ProtocolError(
            "kvsp-malformed-request",
            f"instance name {name!r}: use 1-100 of a-z, 0-9, '.', '_', '-', starting alnum",
        )
    return name


def check_base_url(url: str) -> str:
    """An instance's URL is a base URL by the rules its status records are held to."""
    broken = base_url_rule_broken(url)
    if broken is not None:
        raise ProtocolError(
            "kvsp-malformed-request",
            f"{url!r} is not an http(s) base URL ending with '/': {broken}",
        )
    return url


def do_register_instance(name: str, url: str, *, compat_ids=()) -> Instance:
    check_instance_name(name)
    check_base_url(url)
    for compat_id in compat_ids:
        if not is_hex(compat_id, 32):
            raise ProtocolError("kvsp-malformed-request", f"{compat_id!r} is not a hex32 id")
    if Instance.objects.filter(name=name).exists():
        raise ProtocolError("kvsp-conflict", f"an instance named {name!r} exists already")
    if Instance.objects.filter(url=url).exists():
        raise ProtocolError("kvsp-conflict", f"an instance with URL {url} exists already")
    return Instance.objects.create(name=name, url=url, compat_ids=list(compat_ids))


def _transition(instance: Instance, event: InstanceEvent, now: datetime) -> bool:
    """Apply one lifecycle event to a locked instance row; True when the state changed."""
    new_state = INSTANCE_LIFECYCLE.next_state(instance.state, event)
    if new_state == instance.state:
        return False
    log.info("instance %s: %s -> %s (%s)", instance.name, instance.state, new_state, event)
    instance.state = new_state
    instance.state_changed_at = now
    return True


def _fail_pending_directives(instance: Instance, reason: str, now: datetime) -> None:
    event = DirectiveEvent.LOAD_FAILED
    Directive.objects.filter(instance=instance, state__in=DIRECTIVE_STATES.sources(event)).update(
        state=DIRECTIVE_STATES.target(event), reason=reason, finished_at=now
    )


@dataclass(frozen=True)
class StatusAnswer:
    state: str
    epoch: int
    restarted: bool

    def to_json(self) -> dict:
        return StateAnswer(state=self.state).to_json()


def do_report_status(principal, name: str, body: object, *, now=None) -> StatusAnswer:
    """Accept an Instance Status Record (spec 6.3) and answer with the state the PC decided.

    Reports of one instance are serialized on its row; a record with a lower epoch than the
    highest seen is discarded, as is one of an epoch whose record already expired. The common
    report (same epoch, nothing asked for) is one conditional UPDATE; anything else takes the
    row lock and walks the lifecycle table.
    """
    if principal.instance != name:
        raise ProtocolError("kvsp-forbidden", f"not the principal of instance {name!r}")
    record = InstanceStatusRecord.from_json(body)
    now = now or timezone.now()
    heartbeat = _heartbeat(name, record, now)
    if heartbeat is not None:
        return heartbeat
    with transaction.atomic():
        instance = Instance.objects.select_for_update().filter(name=name).first()
        if instance is None:
            raise ProtocolError("kvsp-not-found", f"no instance {name!r} is registered")
        if record.instance != instance.url:
            raise ProtocolError(
                "kvsp-invalid-record", f"instance: {record.instance} is not {instance.url}"
            )
        restarted = instance.epoch is None or record.epoch > instance.epoch
        if not restarted and record.epoch < instance.epoch:
            raise ProtocolError(
                "kvsp-stale-epoch",
                f"epoch {record.epoch} is lower than {instance.epoch}: the record is discarded",
            )
        if not restarted and instance.state == InstanceState.FAILED:
            raise ProtocolError(
                "kvsp-stale-epoch",
                f"epoch {record.epoch} expired and the instance was failed: restart to rejoin",
            )
        if restarted:
            _transition(instance, InstanceEvent.RESTARTED, now)
            if instance.epoch is not None:
                instance.restarts += 1
                _fail_pending_directives(instance, "the instance restarted", now)
                transaction.on_commit(lambda: _instance_lost_sessions(instance.pk))
            instance.epoch = record.epoch
        _apply_figures(instance, record, now)
        if instance.state == InstanceState.DRAINING and record.state == InstanceState.SLEEPING:
            _transition(instance, InstanceEvent.DRAINED, now)
        if (
            record.requested_state == InstanceState.SLEEPING
            and instance.state == InstanceState.ACTIVE
            and policy.accept_sleep(instance, record)
        ):
            _transition(instance, InstanceEvent.SLEEP_ACCEPTED, now)
        sample = instance.last_sample_at is None or instance.last_sample_at <= _sample_due(now)
        if sample:
            instance.last_sample_at = now
        instance.save()
        if sample:
            _sample(instance.pk, instance.state, record, now)
    return StatusAnswer(instance.state, instance.epoch, restarted)


_HEARTBEAT = """
UPDATE placement_instance SET
    running = %s, queued = %s, batch_size = %s, kv_utilization = %s,
    prefill_tokens_per_s = %s, decode_tokens_per_s = %s, reported_compat_ids = %s,
    requested_state = '', ttl_ms = %s, last_status = %s, last_report_at = %s, expires_at = %s,
    last_sample_at = CASE WHEN last_sample_at IS NULL OR last_sample_at <= %s
                          THEN %s ELSE last_sample_at END
WHERE name = %s AND url = %s AND epoch = %s AND state <> 'failed'
    AND NOT (state = 'draining' AND %s = 'sleeping')
RETURNING id, state, last_sample_at = %s
"""


def _heartbeat(name: str, record: InstanceStatusRecord, now: datetime) -> StatusAnswer | None:
    """The steady-state report in one statement: same epoch, live, nothing to decide."""
    if record.requested_state is not None:
        return None
    json_field = Instance._meta.get_field("last_status")
    adapt = connection.ops.adapt_datetimefield_value
    stamp = adapt(now)
    params = [
        record.running,
        record.queued,
        record.batch_size,
        record.kv_utilization,
        record.prefill_tokens_per_s,
        record.decode_tokens_per_s,
        json_field.get_db_prep_value(
            None if record.compat_ids is None else list(record.compat_ids), connection
        ),
        record.ttl_ms,
        json_field.get_db_prep_value(record.to_json(), connection),
        stamp,
        adapt(now + timedelta(milliseconds=record.ttl_ms)),
        adapt(_sample_due(now)),
        stamp,
        name,
        record.instance,
        record.epoch,
        record.state,
        stamp,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_HEARTBEAT, params)
        row = cursor.fetchone()
    if row is None:
        return None
    instance_id, state, sampled = row
    if sampled:
        _sample(instance_id, state, record, now)
    return StatusAnswer(state, record.epoch, False)


def _apply_figures(instance: Instance, record: InstanceStatusRecord, now: datetime) -> None:
    instance.running = record.running
    instance.queued = record.queued
    instance.batch_size = record.batch_size
    instance.kv_utilization = record.kv_utilization
    instance.prefill_tokens_per_s = record.prefill_tokens_per_s
    instance.decode_tokens_per_s = record.decode_tokens_per_s
    instance.reported_compat_ids = None if record.compat_ids is None else list(record.compat_ids)
    instance.requested_state = record.requested_state or ""
    instance.ttl_ms = record.ttl_ms
    instance.last_status = record.to_json()
    instance.last_report_at = now
    instance.expires_at = now + timedelta(milliseconds=record.ttl_ms)


def _sample_due(now: datetime) -> datetime:
    """Keep a figure for the dashboard at most every KVSP_STATUS_SAMPLE_S per instance."""
    return now - timedelta(seconds=settings.KVSP_STATUS_SAMPLE_S)


def _sample(instance_id: int, state: str, record: InstanceStatusRecord, now: datetime) -> None:
    StatusSample.objects.create(
        instance_id=instance_id,
        at=now,
        epoch=record.epoch,
        state=state,
        running=record.running,
        queued=record.queued,
        kv_utilization=record.kv_utilization,
        prefill_tokens_per_s=record.prefill_tokens_per_s,
        decode_tokens_per_s=record.decode_tokens_per_s,
    )


# The sessions app's failover (sessions/tasks.py), started by name: sessions builds on
# placement, never the other way round.
FAIL_OVER_INSTANCE_SESSIONS = "sessions.fail_over_instance"


def _instance_lost_sessions(instance_id: int) -> None:
    """The sessions an instance served are gone with it: the sessions app resumes them
    elsewhere, at once. When that fails, its task retries; when the broker is down too, the
    ``retry-stalled-sessions`` sweep finds the sessions of a failed instance."""
    run_now_by_name(FAIL_OVER_INSTANCE_SESSIONS, instance_id)


# What an operator (or the PC itself) may ask for, as lifecycle events.
_REQUESTED_EVENT = {
    InstanceState.ACTIVE: InstanceEvent.ACTIVATE,
    InstanceState.DRAINING: InstanceEvent.DRAIN,
    # An instance only sleeps once drained (6.3): asking for sleep drains it.
    InstanceState.SLEEPING: InstanceEvent.DRAIN,
}


def do_change_state(name: str, requested: str, *, now=None) -> Instance:
    """An operator's or the PC's state change (spec 6.3) to ``requested``, a state a
    ``StateChange`` allows, carried out with PUT state on the instance by a task that retries
    until the instance has it.
    """
    now = now or timezone.now()
    with transaction.atomic():
        instance = Instance.objects.select_for_update().filter(name=name).first()
        if instance is None:
            raise ProtocolError("kvsp-not-found", f"no instance {name!r} is registered")
        event = _REQUESTED_EVENT[requested]
        already = instance.state == requested or (
            requested == InstanceState.SLEEPING and instance.state == InstanceState.DRAINING
        )
        if not already and _transition(instance, event, now):
            instance.state_version += 1
            instance.save()
            if event is InstanceEvent.DRAIN:
                _fail_pending_directives(instance, "the instance is draining", now)
            version = instance.state_version
            transaction.on_commit(lambda: _push_state_later(instance.pk, version))
    return instance


def _push_state_later(instance_id: int, version: int) -> None:
    from placement.tasks import push_state

    enqueue(push_state, instance_id, version)


def do_mark_expired(*, now=None) -> list[int]:
    """Mark failed the instances whose status record expired on the controller's clock.

    Paced like Kubernetes' node lifecycle controller: at most ``KVSP_FAILOVER_MAX_PER_CHECK``
    instances per check (oldest expiry first), and none at all while at least
    ``KVSP_FAILOVER_CUT_OFF_FRACTION`` of the live fleet (of ``KVSP_FAILOVER_MIN_FLEET`` or
    more) has expired together: then it is likelier that the controller is cut off than that
    they all failed, and failing them over would move every session for nothing.

    Returns the ids newly failed; their sessions go to the resume logic.
    """
    now = now or timezone.now()
    live = Instance.objects.exclude(state=InstanceState.FAILED).exclude(expires_at=None)
    expired = live.filter(expires_at__lt=now).order_by("expires_at")
    live_count, expired_count = live.count(), expired.count()
    if (
        live_count >= settings.KVSP_FAILOVER_MIN_FLEET
        and expired_count >= settings.KVSP_FAILOVER_CUT_OFF_FRACTION * live_count
    ):
        log.warning(
            "%d of %d live instances expired at once: the controller looks cut off, "
            "failing none over",
            expired_count,
            live_count,
        )
        return []
    failed = []
    for instance_id in expired.values_list("pk", flat=True)[: settings.KVSP_FAILOVER_MAX_PER_CHECK]:
        with transaction.atomic():
            # Re-read under lock: a report may have arrived since the query.
            instance = (
                Instance.objects.select_for_update()
                .filter(pk=instance_id, expires_at__lt=now)
                .exclude(state=InstanceState.FAILED)
                .first()
            )
            if instance is None:
                continue
            _transition(instance, InstanceEvent.EXPIRED, now)
            instance.failed_at = now
            instance.save()
            _fail_pending_directives(instance, "the instance failed", now)
            failed.append(instance.pk)
            transaction.on_commit(lambda pk=instance.pk: _instance_lost_sessions(pk))
    return failed


def do_prune_samples(*, keep: timedelta = timedelta(hours=1), now=None) -> int:
    now = now or timezone.now()
    deleted, _ = StatusSample.objects.filter(at__lt=now - keep).delete()
    return deleted
