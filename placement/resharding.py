"""Resharding of sequence-sharded caches (spec 6.9), coordinated by the PC as a two-phase commit.

Prepare: every member of either version gets its plan with POST reshard and acknowledges with
200 once it has loaded its ``fetch`` ranges. Version v stays authoritative until all have
acknowledged within ``deadline_ms``; then the PC commits (the map moves to v+1 in the same
transaction that records the decision) and tells every member. If any member misses the
deadline, the PC aborts and the members discard what they fetched. The decision is a row before
it is a message, and telling members is retried until each has heard it, so a PC that crashes
at any point resumes the operation from its row (``drive``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
from django.db import IntegrityError, transaction
from django.utils import timezone

from kvsp import sharding
from kvsp.problems import ProtocolError
from kvsp.records import ShardMap as ShardMapRecord
from kvsp.states import RESHARD_PHASES, ReshardEvent
from kvspsite.celery import enqueue
from kvspsite.peers import PeerUnreachable, call, peer_client
from placement.models import ReshardOperation, ReshardPhase, ShardMap

log = logging.getLogger(__name__)

MAX_DEADLINE_MS = 600_000


def _record(row: ShardMap) -> ShardMapRecord:
    return ShardMapRecord.from_json(row.document())


def do_put_shard_map(map_id: str, body: object) -> tuple[ShardMap, bool]:
    """Create a Shard Map, or set it anew while no reshard of it is under way.

    A version at or below the current one must be the same document (an idempotent repeat);
    moving between versions is what POST reshard is for, so this only sets a map directly when
    nothing is in flight (an operator taking over a group).
    """
    record = ShardMapRecord.from_json(body)
    if record.map != map_id:
        raise ProtocolError("kvsp-malformed-request", "map in the body differs from the path")
    document = record.to_json()
    with transaction.atomic():
        row = ShardMap.objects.select_for_update().filter(map=map_id).first()
        if row is None:
            try:
                with transaction.atomic():
                    row = ShardMap.objects.create(
                        map=map_id, version=record.version, shards=document["shards"]
                    )
                return row, True
            except IntegrityError:
                row = ShardMap.objects.select_for_update().get(map=map_id)
        if record.version <= row.version:
            if row.document() == document:
                return row, False
            raise ProtocolError(
                "kvsp-conflict", f"version {record.version} of {map_id} differs from what is stored"
            )
        if row.operations.filter(phase=ReshardPhase.PREPARING).exists():
            raise ProtocolError("kvsp-conflict", f"a reshard of {map_id} is under way")
        row.version, row.shards = record.version, document["shards"]
        row.save()
    return row, False


def do_start_reshard(map_id: str, body: object) -> ReshardOperation:
    """POST shardmaps/{map}/reshard: plan the move to the next version and start preparing."""
    if not isinstance(body, dict):
        raise ProtocolError("kvsp-malformed-request", "the body must be a JSON object")
    deadline_ms = body.get("deadline_ms")
    if type(deadline_ms) is not int or not 1 <= deadline_ms <= MAX_DEADLINE_MS:
        raise ProtocolError(
            "kvsp-invalid-record", f"deadline_ms: an integer from 1 to {MAX_DEADLINE_MS}"
        )
    shards = body.get("shards")
    if not isinstance(shards, list):
        raise ProtocolError("kvsp-invalid-record", "shards: must be an array of shards")
    now = timezone.now()
    with transaction.atomic():
        row = ShardMap.objects.select_for_update().filter(map=map_id).first()
        if row is None:
            raise ProtocolError("kvsp-not-found", f"no shard map {map_id!r}")
        if row.operations.filter(phase=ReshardPhase.PREPARING).exists():
            raise ProtocolError("kvsp-conflict", f"a reshard of {map_id} is under way")
        current = _record(row)
        following = ShardMapRecord.from_json(
            {"map": map_id, "version": current.version + 1, "shards": shards}
        )
        plans = sharding.plan_reshard(current, following.shards, deadline_ms)
        operation = ReshardOperation.objects.create(
            shard_map=row,
            from_version=current.version,
            to_version=following.version,
            next_shards=following.to_json()["shards"],
            deadline_ms=deadline_ms,
            plans=[plan.to_json() for plan in plans],
            started_at=now,
            deadline_at=now + timedelta(milliseconds=deadline_ms),
        )
        transaction.on_commit(lambda: _drive_later(operation.pk))
    return operation


def _drive_later(operation_id: int) -> None:
    from placement.tasks import drive_reshard

    enqueue(drive_reshard, operation_id)


def _decide(operation_id: int, event: ReshardEvent, reason: str = "") -> ReshardOperation:
    """Record the outcome once; commit also moves the map to v+1 in the same transaction."""
    now = timezone.now()
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        phase = RESHARD_PHASES.next_state(operation.phase, event)
        if phase == operation.phase:
            return operation  # a repeated decision: harmless
        if event is ReshardEvent.COMMIT:
            moved = ShardMap.objects.filter(
                pk=operation.shard_map_id, version=operation.from_version
            ).update(version=operation.to_version, shards=operation.next_shards)
            if not moved:
                raise ProtocolError("kvsp-conflict", "the map moved on during the reshard")
        operation.phase, operation.decided_at = phase, now
        operation.reason = reason
        operation.save()
        log.info("reshard %s: %s (%s)", operation, phase, reason or "all acknowledged")
        return operation


def do_abort_reshard(operation_id: int, reason: str = "aborted by an operator") -> ReshardOperation:
    """An operator's abort of a reshard still preparing; members are told by the driver."""
    operation = _decide(operation_id, ReshardEvent.ABORT, reason)
    transaction.on_commit(lambda: _drive_later(operation_id))
    return operation


def _acknowledge(operation_id: int, member: str) -> None:
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        if member not in operation.acknowledged:
            operation.acknowledged = [*operation.acknowledged, member]
            operation.save(update_fields=["acknowledged"])


def _inform(operation_id: int, member: str) -> None:
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        if member not in operation.informed:
            operation.informed = [*operation.informed, member]
            if set(operation.informed) >= set(operation.members):
                operation.finished_at = timezone.now()
            operation.save(update_fields=["informed", "finished_at"])


def _prepare(operation: ReshardOperation) -> None:
    """Send every plan not yet acknowledged, all at once, waiting no longer than the deadline."""
    remaining = (operation.deadline_at - timezone.now()).total_seconds()
    pending = [plan for plan in operation.plans if plan["instance"] not in operation.acknowledged]
    if remaining <= 0 or not pending:
        return
    timeout = httpx.Timeout(remaining, connect=min(remaining, 2.0))

    def send(plan: dict) -> None:
        try:
            with peer_client(timeout=timeout) as client:
                response = call(client, "POST", f"{plan['instance']}reshard", json=plan)
        except PeerUnreachable as error:
            log.info("reshard %s: %s did not acknowledge: %s", operation, plan["instance"], error)
            return
        if response.status_code == 200:
            _acknowledge(operation.pk, plan["instance"])
        else:
            log.info(
                "reshard %s: %s answered %s", operation, plan["instance"], response.status_code
            )

    with ThreadPoolExecutor(max_workers=min(len(pending), 16)) as pool:
        list(pool.map(send, pending))


def _tell_outcome(operation: ReshardOperation) -> list[str]:
    """Send commit or abort to each member not yet informed; the members still to tell."""
    body = (
        {"map": operation.shard_map.map, "commit": operation.to_version}
        if operation.phase == ReshardPhase.COMMITTED
        else {"map": operation.shard_map.map, "abort": operation.to_version}
    )
    untold = []
    with peer_client() as client:
        for member in operation.members:
            if member in operation.informed:
                continue
            try:
                response = call(client, "POST", f"{member}reshard", json=body)
            except PeerUnreachable:
                untold.append(member)
                continue
            if response.is_success:
                _inform(operation.pk, member)
            else:
                untold.append(member)
    return untold


def drive(operation_id: int) -> list[str]:
    """Carry an operation as far as it goes now; returns the members still to be told.

    Safe to run any number of times, from any state: that is what makes a PC crash harmless.
    """
    operation = ReshardOperation.objects.select_related("shard_map").get(pk=operation_id)
    if operation.phase == ReshardPhase.PREPARING:
        _prepare(operation)
        operation.refresh_from_db()
        if operation.phase == ReshardPhase.PREPARING:
            missing = set(operation.members) - set(operation.acknowledged)
            if missing:
                reason = "no acknowledgement within deadline_ms from " + ", ".join(sorted(missing))
                operation = _decide(operation_id, ReshardEvent.ABORT, reason)
            else:
                operation = _decide(operation_id, ReshardEvent.COMMIT)
    operation = ReshardOperation.objects.select_related("shard_map").get(pk=operation_id)
    return _tell_outcome(operation)


def operation_json(operation: ReshardOperation) -> dict:
    """The reshard answer of DESIGN.md section 3."""
    return {
        "map": operation.shard_map.map,
        "from": operation.from_version,
        "to": operation.to_version,
        "state": operation.phase,
        "deadline_ms": operation.deadline_ms,
        "plans": operation.plans,
        "acknowledged": operation.acknowledged,
        "informed": operation.informed,
        "reason": operation.reason or None,
    }
