"""The Replica Records of the node's blocks (spec 6.1): publishing them, refreshing them half way
through their TTL, and withdrawing them.

A new or moved replica's record is published as soon as the change is committed, outside the
node's lock (a round trip to the IS would hold up every other placement), and then checked
under the lock: a block that left meanwhile has its record withdrawn again, one that moved again
is published again, so the IS is never left describing a state the node has left. An evicted
replica's withdrawal is owed inside the lock, before its row is deleted, and delivered once
that is committed.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from workers import control_plane, selectors
from workers.instance import lock_node
from workers.models import PendingWithdrawal, StoredBlock
from workers.tiers import BlockIds

log = logging.getLogger(__name__)

# After a failed publish, the next attempt.
PUBLISH_RETRY = timedelta(seconds=5)


def _note_published(blocks: list[StoredBlock], outcomes: list, asked_at: datetime) -> None:
    """Record when each block's record expires at the IS and is next due; one that was not
    published is tried again soon."""
    granted: dict[int, list[int]] = {}
    failed = []
    for block, outcome in zip(blocks, outcomes, strict=True):
        if outcome.published:
            granted.setdefault(outcome.ttl_ms, []).append(block.pk)
        else:
            failed.append((block, outcome.error))
    if failed:
        first, error = failed[0]
        log.warning("publishing %d records failed (%s: %s)", len(failed), first, error)
        StoredBlock.objects.filter(pk__in=[block.pk for block, _ in failed]).update(
            refresh_due_at=asked_at + PUBLISH_RETRY
        )
    for ttl_ms, pks in granted.items():
        StoredBlock.objects.filter(pk__in=pks).update(
            record_expires_at=asked_at + timedelta(milliseconds=ttl_ms),
            refresh_due_at=asked_at + timedelta(milliseconds=ttl_ms / 2),
        )


def _residency_key(block: StoredBlock) -> tuple:
    return (block.tier, block.device_layers)


def publish_all(pks: list[int]) -> int:
    """Publish the records of blocks as they stand, outside the node's lock, in as few requests
    as the IS takes (``control_plane.publish_replicas``), and make sure the IS is not left with a
    record the node no longer stands by: a block evicted while its record travelled is
    withdrawn again; one that moved is published again with its new residency. Blocks gone,
    or not replicas yet (their move's commit publishes them), are skipped. Returns how many
    of the blocks the IS has the current record of."""
    current = 0
    pending = list(pks)
    for _ in range(3):
        blocks = selectors.held_blocks_by_id(pending)
        if not blocks:
            break
        asked_at = timezone.now()
        outcomes = control_plane.publish_replicas([selectors.replica_record(b) for b in blocks])
        _note_published(blocks, outcomes, asked_at)
        published = {b.pk for b, outcome in zip(blocks, outcomes, strict=True) if outcome.published}
        pending = []
        with transaction.atomic():
            for name in sorted({block.instance for block in blocks}):
                lock_node(name)
            now_at = selectors.residencies([block.pk for block in blocks])
            gone: dict[str, list[BlockIds]] = {}
            for block in blocks:
                residency = now_at.get(block.pk)
                if residency is None:
                    if block.pk in published:
                        gone.setdefault(block.instance, []).append(block.ids)
                elif residency != _residency_key(block):
                    pending.append(block.pk)
                elif block.pk in published:
                    current += 1
            for name, replicas in gone.items():
                withdraw_many(name, replicas, "evicted meanwhile", timezone.now())
        if not pending:
            break
    return current


def publish_current(pk: int) -> bool:
    """``publish_all`` of one block: True when the IS has its current record."""
    return publish_all([pk]) == 1


def publish_on_commit(block: StoredBlock) -> None:
    pk = block.pk
    # Robust: the change is committed; a failure to tell the IS is retried by the keeper.
    transaction.on_commit(lambda: publish_current(pk), robust=True)


def withdraw_many(name: str, replicas: list[BlockIds], reason: str, now: datetime) -> None:
    """Owe the withdrawal of these records (6.1) and deliver them, in as few requests as the
    IS takes, as soon as the eviction is committed ("immediately after evicting"), outside
    the node's lock: the IS may share the database, and the embedded default's SQLite has one
    writer at a time, so a DELETE sent while the node holds its lock would wait on the node
    itself. What cannot be delivered then stays owed, and the keeper retries it."""
    if not replicas:
        return
    PendingWithdrawal.objects.bulk_create(
        [
            PendingWithdrawal(
                instance=name,
                compat_id=ids[0],
                scope_id=ids[1],
                block_key=ids[2],
                reason=reason,
                created_at=now,
            )
            for ids in replicas
        ],
        update_conflicts=True,
        unique_fields=["instance", "compat_id", "scope_id", "block_key"],
        update_fields=["reason", "created_at"],
    )
    keys = [ids[2] for ids in replicas]
    transaction.on_commit(lambda: _deliver_withdrawals(name, keys), robust=True)


def _deliver_withdrawals(name: str, block_keys: list[bytes] | None = None, limit: int = 100):
    """Send the withdrawals the node owes (those of ``block_keys``, or the oldest ``limit``)
    in batches; how many were delivered. A block held again meanwhile has its own current
    record: its withdrawal is dropped, or its record published again when the DELETE crossed
    it."""
    owed = PendingWithdrawal.objects.filter(instance=name).order_by("pk")
    if block_keys is not None:
        owed = owed.filter(block_key__in=block_keys)
    owed = list(owed[:limit] if block_keys is None else owed)
    if not owed:
        return 0
    ids_of = {o.pk: (bytes(o.compat_id), bytes(o.scope_id), bytes(o.block_key)) for o in owed}

    def held() -> dict[BlockIds, int]:
        rows = selectors.held_blocks(name).filter(block_key__in=[i[2] for i in ids_of.values()])
        return {block.ids: block.pk for block in rows}

    before = held()
    due = [o for o in owed if ids_of[o.pk] not in before]
    PendingWithdrawal.objects.filter(pk__in=[o.pk for o in owed if ids_of[o.pk] in before]).delete()
    errors = control_plane.withdraw_replicas([ids_of[o.pk] for o in due]) if due else []
    delivered = [o.pk for o, error in zip(due, errors, strict=True) if error is None]
    failed = [o.pk for o, error in zip(due, errors, strict=True) if error is not None]
    if failed:
        log.warning("%d withdrawals failed: retried later", len(failed))
        PendingWithdrawal.objects.filter(pk__in=failed).update(attempts=F("attempts") + 1)
    PendingWithdrawal.objects.filter(pk__in=delivered).delete()
    crossed = [pk for ids, pk in held().items() if ids not in before]
    if crossed:
        publish_all(crossed)
    return len(delivered)


def do_republish_all(name: str) -> int:
    """Every record of the node is due now: the keeper publishes them at its next round."""
    return StoredBlock.objects.filter(instance=name, pending_move__isnull=True).update(
        refresh_due_at=timezone.now()
    )


def do_refresh_replicas(name: str, *, limit: int = 500) -> int:
    """Publish the records that are due (half way through their TTL, or changed)."""
    now = timezone.now()
    due = list(
        StoredBlock.objects.filter(
            instance=name, refresh_due_at__lte=now, pending_move__isnull=True
        )
        .order_by("refresh_due_at")
        .values_list("pk", flat=True)[:limit]
    )
    return publish_all(due)


def do_retry_withdrawals(name: str, *, limit: int = 100) -> int:
    """Deliver withdrawals the node owes (outside its lock, see ``withdraw_many``); how
    many were delivered."""
    return _deliver_withdrawals(name, limit=limit)
