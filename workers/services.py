"""Writes of the node: admitting blocks to the tier store and evicting them (6.1, 6.7), leases
(6.6), prefetch directives (6.5), reshard moves (6.9), the instance's state and epoch (6.3),
and the upkeep of its Replica Records.

Every change to which blocks the node holds, and every lease, happens with the node's row locked
(``select_for_update``), so no eviction races a lease or another placement. An evicted replica
is withdrawn inside that lock, before its row is deleted (6.1). A new or moved replica's record
is published as soon as the change is committed, outside the lock (a round trip to the IS would
hold up every other placement), and then checked under the lock: a block that left meanwhile
has its record withdrawn again, one that moved again is published again, so the IS is never
left describing a state the node has left.

A block fetched for a reshard move still preparing is pending (``StoredBlock.pending_move``): it
takes room and is never evicted, but it is not a replica yet, so it is not published, served or
leased. The move's commit makes it held and publishes it; its abort discards it. Anything else
that asks the node to hold a pending block (a prefetch, a PUT, an engine's export) makes it
held at once, so that an abort never takes a block somebody else wanted.

Eviction is fair between scopes (tenant isolation on a holder). Each scope has a quota on the
node: ``KVSP_SCOPE_QUOTA_OCTETS`` when set, otherwise an equal share of the node's capacity
(host and disk) among the scopes holding blocks there, the storing scope included, so that a
lone scope may use everything and a newcomer may take back up to its share. A store for scope S
evicts, least recently used first and never a leased or pending block, only blocks of S itself
or of a scope holding more than its quota, and never takes another scope below its quota. What
a scope holds counts all its blocks on the node, in either tier, pending ones too. A move from
host to disk is not an eviction and may move any scope's block, but the disk room it needs is
made under the same rule. When no block the rule allows makes room, the store is refused
(``kvsp-unavailable``) and nothing changes. A quota is what a scope keeps against others, not a
cap: free room goes to whoever stores first.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from index.authz import may_read_scope
from kvsp.container import Container
from kvsp.problems import ProtocolError
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest, PrefetchDirective
from kvsp.registries import RAW_CODEC, lookup_codec
from kvsp.states import (
    INSTANCE_LIFECYCLE,
    RESHARD_PHASES,
    SERVED_SESSION_STATES,
    InstanceEvent,
    ReshardEvent,
    ServedSessionEvent,
)
from kvspsite.celery import instance_queue
from workers import control, notices, selectors, tiers
from workers.models import (
    Directive,
    Lease,
    MeasuredLink,
    MovePhase,
    Node,
    NodeState,
    PendingWithdrawal,
    ReshardMove,
    ServedSession,
    ServedSessionState,
    StoredBlock,
)

log = logging.getLogger(__name__)

# After a failed publish, the next attempt.
PUBLISH_RETRY = timedelta(seconds=5)
# A file in a tier directory with no row younger than this may belong to a placement still in
# its transaction.
ORPHAN_GRACE_S = 300

BlockIds = tiers.BlockIds


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


# --- Replica Records ---------------------------------------------------------------------------


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
    as the IS takes (``control.publish_replicas``), and make sure the IS is not left with a
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
        outcomes = control.publish_replicas([selectors.replica_record(b) for b in blocks])
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
                _withdraw_many(name, replicas, "evicted meanwhile", timezone.now())
        if not pending:
            break
    return current


def publish_current(pk: int) -> bool:
    """``publish_all`` of one block: True when the IS has its current record."""
    return publish_all([pk]) == 1


def _publish_on_commit(block: StoredBlock) -> None:
    pk = block.pk
    # Robust: the change is committed; a failure to tell the IS is retried by the keeper.
    transaction.on_commit(lambda: publish_current(pk), robust=True)


def _withdraw(name: str, ids: BlockIds, reason: str, now: datetime) -> None:
    _withdraw_many(name, [ids], reason, now)


def _withdraw_many(name: str, replicas: list[BlockIds], reason: str, now: datetime) -> None:
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
    errors = control.withdraw_replicas([ids_of[o.pk] for o in due]) if due else []
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


# --- Placement and eviction ----------------------------------------------------------------------


def _leased_block_ids(name: str, now: datetime) -> set[int]:
    return set(
        StoredBlock.objects.filter(instance=name, leases__expires_at__gt=now).values_list(
            "pk", flat=True
        )
    )


def _protected_block_ids(name: str, now: datetime) -> set[int]:
    """Blocks no eviction may take: leased ones (6.6), and those pending for a reshard move
    (the node acknowledged the plan on the strength of them)."""
    pending = StoredBlock.objects.filter(instance=name, pending_move__isnull=False)
    return _leased_block_ids(name, now) | set(pending.values_list("pk", flat=True))


def _evict(block: StoredBlock, reason: str, now: datetime) -> None:
    _evict_many([block], reason, now)


def _evict_many(blocks: list[StoredBlock], reason: str, now: datetime) -> None:
    """Withdraw, then forget blocks of one node; their files go once the deletion is
    committed, so a reader never finds a committed row without its file."""
    if not blocks:
        return
    for block in blocks:
        log.info("evicting %s: %s", block, reason)
    _withdraw_many(blocks[0].instance, [block.ids for block in blocks], reason, now)
    paths = [tiers.stored_path(block) for block in blocks]
    StoredBlock.objects.filter(pk__in=[block.pk for block in blocks]).delete()

    def unlink() -> None:
        for path in paths:
            tiers.unlink_quietly(path)

    transaction.on_commit(unlink, robust=True)


def _demote(block: StoredBlock) -> None:
    """Move a block's serving copy from the host tier to disk and publish its new residency."""
    source = tiers.stored_path(block)
    tiers.copy_file(source, tiers.block_path(tiers.DISK, block.instance, block.ids))
    block.tier = tiers.DISK
    block.save(update_fields=["tier"])
    transaction.on_commit(lambda: tiers.unlink_quietly(source), robust=True)
    _publish_on_commit(block)


@dataclass
class RoomPlan:
    """Where a new block goes and what makes room for it, decided before anything is done, so
    that a block that does not fit changes nothing."""

    tier: str
    demote: list[StoredBlock]
    evict: list[StoredBlock]


@dataclass
class ScopeShares:
    """The fairness rule of eviction (see the module docstring) for a store of scope
    ``storing``: the octets each scope holds on the node, kept current as a plan evicts, and
    the quota every scope keeps against the others."""

    storing: bytes
    held: dict[bytes, int]
    quota: int

    @classmethod
    def of(cls, storing: bytes, held: dict[bytes, int]) -> ScopeShares:
        quota = settings.KVSP_SCOPE_QUOTA_OCTETS
        if not quota:
            capacity = tiers.capacity(tiers.HOST) + tiers.capacity(tiers.DISK)
            quota = capacity // len(held.keys() | {storing})
        return cls(storing, dict(held), quota)

    def may_evict(self, block: StoredBlock) -> bool:
        """The storing scope's own blocks, and another scope's while it keeps its quota."""
        owner = bytes(block.scope_id)
        return owner == self.storing or self.held.get(owner, 0) - block.size >= self.quota

    def evicted(self, block: StoredBlock) -> None:
        owner = bytes(block.scope_id)
        self.held[owner] = self.held.get(owner, 0) - block.size


class _Disk:
    """The disk tier as a plan sees it: its use, and the blocks a store may evict from it in
    LRU order (unleased, not pending, and allowed by ``ScopeShares``)."""

    def __init__(self, name: str, now: datetime, shares_of: Callable[[], ScopeShares]):
        self.cap = tiers.capacity(tiers.DISK)
        self.used = selectors.used_octets(name, tiers.DISK)
        self._name, self._now, self._shares_of = name, now, shares_of
        self._shares: ScopeShares | None = None
        self._victims: list[StoredBlock] | None = None
        self._next = 0
        self.evict: list[StoredBlock] = []

    def make_room(self, needed: int) -> bool:
        if self.used + needed <= self.cap:
            return True
        if self._victims is None:
            protected = _protected_block_ids(self._name, self._now)
            self._shares = self._shares_of()
            self._victims = [
                block
                for block in StoredBlock.objects.filter(
                    instance=self._name, tier=tiers.DISK
                ).order_by("last_access", "pk")
                if block.pk not in protected
            ]
        # One pass suffices: evicting only ever lowers what a scope holds, so a block the rule
        # passes over stays out of reach for the rest of the plan.
        while self.used + needed > self.cap and self._next < len(self._victims):
            victim = self._victims[self._next]
            self._next += 1
            if not self._shares.may_evict(victim):
                continue
            self._shares.evicted(victim)
            self.evict.append(victim)
            self.used -= victim.size
        return self.used + needed <= self.cap


def _plan_room(name: str, scope_id: bytes, size: int, now: datetime) -> RoomPlan:
    """The tier for a new block of scope ``scope_id`` and ``size`` octets, and how to make room
    there.

    The host tier first: its least recently used blocks move to disk (a move is not an
    eviction, so leased blocks, and any scope's, may move), and disk makes room by evicting its
    least recently used blocks that ``ScopeShares`` allows and no lease or reshard move keeps.
    A block too large for the host tier goes to disk directly.
    """
    held: dict[bytes, int] | None = None

    def shares() -> ScopeShares:
        # One query per store however many plans ask: what every scope holds on the node.
        nonlocal held
        if held is None:
            held = selectors.octets_by_scope(name)
        return ScopeShares.of(scope_id, held)

    host_cap = tiers.capacity(tiers.HOST)
    if size <= host_cap:
        used = selectors.used_octets(name, tiers.HOST)
        disk = _Disk(name, now, shares)
        demote = []
        if used + size > host_cap:
            candidates = StoredBlock.objects.filter(instance=name, tier=tiers.HOST).order_by(
                "last_access", "pk"
            )
            for candidate in candidates:
                if not disk.make_room(candidate.size):
                    break
                demote.append(candidate)
                disk.used += candidate.size
                used -= candidate.size
                if used + size <= host_cap:
                    break
        if used + size <= host_cap:
            return RoomPlan(tiers.HOST, demote, disk.evict)
    disk = _Disk(name, now, shares)
    if size <= disk.cap and disk.make_room(size):
        return RoomPlan(tiers.DISK, [], disk.evict)
    raise ProtocolError(
        "kvsp-unavailable",
        f"no room for a block of {size} octets: the blocks in the way are leased, pending, or "
        "other scopes' within their quota, or the tiers are too small",
    )


@dataclass(frozen=True)
class BlockFields:
    """What the node records of a block it admits, all taken from the octets it received."""

    codec: int
    size: int
    token_count: int
    layer_count: int
    layer_digests: list[bytes]
    repr_sha256: bytes

    @classmethod
    def of(cls, container: Container, repr_sha256: bytes, *, threads: int | None = None):
        return cls(
            codec=container.codec,
            size=container.size,
            token_count=container.token_count,
            layer_count=container.layer_count,
            layer_digests=container.layer_digests(threads=threads),
            repr_sha256=repr_sha256,
        )


def _stored_block(
    name: str, ids: BlockIds, fields: BlockFields, tier: str, now, pending_move_id=None
) -> StoredBlock:
    return StoredBlock(
        instance=name,
        compat_id=ids[0],
        scope_id=ids[1],
        block_key=ids[2],
        codec=fields.codec,
        size=fields.size,
        token_count=fields.token_count,
        layer_count=fields.layer_count,
        digest=selectors.replica_digest_octets(fields.layer_digests),
        layer_digests=b"".join(fields.layer_digests),
        repr_sha256=fields.repr_sha256,
        tier=tier,
        stored_at=now,
        last_access=now,
        refresh_due_at=now,
        pending_move_id=pending_move_id,
    )


def _hold_pending(block: StoredBlock) -> None:
    """A pending block becomes held: a replica like any other, published once committed."""
    block.pending_move = None
    block.refresh_due_at = timezone.now()
    block.save(update_fields=["pending_move", "refresh_due_at"])
    _publish_on_commit(block)


def _place_locked(
    name: str,
    ids: BlockIds,
    spool: Path,
    fields: BlockFields,
    *,
    exists_ok: bool,
    device: Callable[[], tiers.DeviceAdmission] | None,
    placed: list[Path],
    pending_move_id: int | None = None,
) -> tuple[StoredBlock, bool]:
    """Place one received block, inside a transaction that holds the node's lock; the file
    it puts in place is added to ``placed`` (the caller removes it if the transaction fails).

    With ``pending_move_id`` the block is placed pending for that reshard move and not
    published. An existing pending copy serves any other caller, and becomes held."""
    existing = selectors.stored_block(name, *ids)
    if existing is not None:
        if existing.pending_move_id is not None and pending_move_id is None:
            _hold_pending(existing)
            return existing, False
        if exists_ok:
            return existing, False
        raise ProtocolError(
            "kvsp-precondition-failed",
            "this holder already has a replica of the block and keeps its copy",
        )
    now = timezone.now()
    plan = _plan_room(name, ids[1], fields.size, now)
    # Files first, and the Index Service last: a failure before the evictions leaves every
    # record as it was.
    for victim in plan.demote:
        _demote(victim)
    tier = plan.tier
    path = tiers.block_path(tier, name, ids)
    tiers.place_file(spool, path)
    placed.append(path)
    _evict_many(plan.evict, "evicted for room (least recently used, unleased, within quotas)", now)
    block = _stored_block(name, ids, fields, tier, now, pending_move_id)
    block.save(force_insert=True)
    PendingWithdrawal.objects.filter(
        instance=name, compat_id=ids[0], scope_id=ids[1], block_key=ids[2]
    ).delete()
    if device is not None:
        _admit_to_device(name, block, device())
    return block, True


def _admit(
    name: str,
    ids: BlockIds,
    spool: Path,
    fields: BlockFields,
    *,
    exists_ok: bool,
    device: Callable[[], tiers.DeviceAdmission] | None = None,
) -> tuple[StoredBlock, bool]:
    """Place a received block (its container in ``spool``) and publish its replica.

    An existing replica of the key stays as it is (6.7): ``exists_ok`` returns it, otherwise
    the answer is 412. The spool file is gone afterwards either way.
    """
    placed: list[Path] = []
    try:
        with transaction.atomic():
            lock_node(name)
            block, created = _place_locked(
                name, ids, spool, fields, exists_ok=exists_ok, device=device, placed=placed
            )
            if created:
                _publish_on_commit(block)
        placed.clear()
        return block, created
    finally:
        tiers.unlink_quietly(spool)
        for path in placed:
            tiers.unlink_quietly(path)


def _admit_to_device(name: str, block: StoredBlock, admission) -> None:
    block.device_layers = admission.layers
    block.device_octets = admission.octets
    block.save(update_fields=["device_layers", "device_octets"])
    _drop_device_copies(name, set(admission.dropped) - {block.ids})


def _drop_device_copies(
    name: str, dropped: set[BlockIds], republish: list[int] | None = None
) -> None:
    """Rows of blocks whose device copies the device tier let go of to make room: one UPDATE
    for all of them, and their records (whose residency no longer lists the device tier)
    published again together, by the caller when it gathers them in ``republish``, else once
    this transaction commits."""
    if not dropped:
        return
    rows = StoredBlock.objects.filter(
        instance=name, block_key__in=[ids[2] for ids in dropped]
    ).only("pk", "compat_id", "scope_id", "block_key")
    pks = [row.pk for row in rows if row.ids in dropped]
    if not pks:
        return
    StoredBlock.objects.filter(pk__in=pks).update(device_layers=0, device_octets=0)
    if republish is not None:
        republish.extend(pks)
    else:
        # Robust: the change is committed; a failure to tell the IS is retried by the keeper.
        transaction.on_commit(lambda: publish_all(pks), robust=True)


def check_container(container: Container, compat_id: bytes) -> None:
    """What a holder requires of a container it stores: a registered codec, every layer from
    layer 0 (a replica's record lists the digests of all its layers), and, when the
    Compatibility Descriptor is registered, the geometry it states."""
    lookup_codec(container.codec)
    if container.first_layer != 0:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"the container starts at layer {container.first_layer}; a stored block holds "
            "its layers from layer 0",
        )
    geometry = control.geometry(compat_id)
    if geometry is not None:
        geometry.check(container)


def do_store_block(ids: BlockIds, spool: Path, container: Container, repr_sha256: bytes):
    """PUT on a block resource with If-None-Match: * (6.7): 412 when a replica exists (a copy
    pending for a reshard move is kept too, and held from then on)."""
    check_container(container, ids[0])
    fields = BlockFields.of(container, repr_sha256, threads=2)
    block, created = _admit(selectors.node_name(), ids, spool, fields, exists_ok=False)
    if not created:
        raise ProtocolError(
            "kvsp-precondition-failed",
            "this holder already has a replica of the block and keeps its copy",
        )
    return block


def do_store_exported(blocks: list[tuple[BlockIds, object]], token_count: int) -> list[int]:
    """Admit blocks of ``token_count`` tokens the instance's engine exported (each an
    ``EncodedContainer`` of every layer, codec raw), in one transaction under one lock; a
    replica already held stays as it is. Returns the ids of the rows newly stored, whose
    records the caller publishes (``publish_all``), so that many publish at once."""
    name = selectors.node_name()
    prepared = []
    for ids, encoded in blocks:
        hasher = hashlib.sha256()
        for part in encoded.parts:
            hasher.update(part)
        fields = BlockFields(
            codec=RAW_CODEC,
            size=encoded.size,
            token_count=token_count,
            layer_count=len(encoded.layer_digests),
            layer_digests=list(encoded.layer_digests),
            repr_sha256=hasher.digest(),
        )
        prepared.append((ids, tiers.write_spool(name, encoded.parts), fields))
    placed: list[Path] = []
    try:
        with transaction.atomic():
            lock_node(name)
            stored = _place_many_locked(name, prepared, placed)
        placed.clear()
        return stored
    finally:
        for _, spool, _ in prepared:
            tiers.unlink_quietly(spool)
        for path in placed:
            tiers.unlink_quietly(path)


def _place_many_locked(
    name: str,
    prepared: list,
    placed: list[Path],
    *,
    pending_move_id: int | None = None,
    devices: dict | None = None,
    refresh_due_at: datetime | None = None,
    republish: list[int] | None = None,
) -> list[int]:
    """Place received blocks under the node's lock (see ``_place_locked``); the ids of the rows
    newly stored. When they all fit in the host tier as it is, nothing moves or leaves, and
    they go in with a few statements in all rather than a few each. ``devices`` maps the ids of
    blocks the device tier takes a working copy of to that copy's installer;
    ``refresh_due_at``, when given, is when the keeper publishes the new rows' records if the
    caller, who publishes them at once, could not; ``republish``, when given, gathers the rows
    whose device copies made room, for the caller to publish with them."""
    devices = devices or {}
    existing = selectors.blocks_with_keys(name, [ids[2] for ids, _, _ in prepared])
    wanted = {ids for ids, _, _ in prepared}
    held = set()
    for block in existing:
        if block.ids in wanted and block.pending_move_id is not None and pending_move_id is None:
            _hold_pending(block)
        held.add(block.ids)
    fresh, seen = [], set()
    for item in prepared:
        if item[0] not in held and item[0] not in seen:
            seen.add(item[0])
            fresh.append(item)
    size = sum(fields.size for _, _, fields in fresh)
    if selectors.used_octets(name, tiers.HOST) + size > tiers.capacity(tiers.HOST):
        stored = []
        for ids, spool, fields in fresh:
            block, created = _place_locked(
                name,
                ids,
                spool,
                fields,
                exists_ok=True,
                device=devices.get(ids),
                placed=placed,
                pending_move_id=pending_move_id,
            )
            if created:
                stored.append(block.pk)
        if refresh_due_at is not None and stored:
            StoredBlock.objects.filter(pk__in=stored).update(refresh_due_at=refresh_due_at)
        return stored
    now = timezone.now()
    rows: dict[BlockIds, StoredBlock] = {}
    dropped: set[BlockIds] = set()
    for ids, spool, fields in fresh:
        path = tiers.block_path(tiers.HOST, name, ids)
        tiers.place_file(spool, path)
        placed.append(path)
        row = _stored_block(name, ids, fields, tiers.HOST, now, pending_move_id)
        if refresh_due_at is not None:
            row.refresh_due_at = refresh_due_at
        device = devices.get(ids)
        if device is not None:
            # Installed before the rows are written, so that each row goes in with its device
            # residency: one INSERT for the batch instead of one UPDATE per block after it.
            admission = device()
            row.device_layers, row.device_octets = admission.layers, admission.octets
            dropped.update(admission.dropped)
        rows[ids] = row
    for ids in dropped & rows.keys():  # a copy of this batch made room for a later one
        rows[ids].device_layers = rows[ids].device_octets = 0
    created = _insert_stored_blocks(list(rows.values()))
    _drop_device_copies(name, dropped - rows.keys(), republish)
    for compat_id, scope_id in {(ids[0], ids[1]) for ids, _, _ in fresh}:
        PendingWithdrawal.objects.filter(
            instance=name,
            compat_id=compat_id,
            scope_id=scope_id,
            block_key__in=[ids[2] for ids, _, _ in fresh if ids[:2] == (compat_id, scope_id)],
        ).delete()
    return created


# The columns of an admitted batch's rows, every row in one statement of one fixed text (so
# that it is planned once per connection): one array parameter per column. The ORM's bulk
# insert compiles a statement of rows x columns placeholders for every batch instead.
_INSERTED_FIELDS = [field for field in StoredBlock._meta.concrete_fields if not field.primary_key]


@functools.cache
def _insert_stored_blocks_sql() -> str:
    columns = ", ".join(field.column for field in _INSERTED_FIELDS)
    arrays = ", ".join(f"%s::{field.db_type(connection)}[]" for field in _INSERTED_FIELDS)
    return (
        f"INSERT INTO {StoredBlock._meta.db_table} ({columns}) "  # noqa: S608
        f"SELECT * FROM unnest({arrays}) RETURNING id"
    )


def _insert_stored_blocks(rows: list[StoredBlock]) -> list[int]:
    """Insert ``rows`` (new StoredBlocks) in one statement; their ids."""
    if connection.vendor != "postgresql":
        return [row.pk for row in StoredBlock.objects.bulk_create(rows)]
    columns = [[getattr(row, field.attname) for row in rows] for field in _INSERTED_FIELDS]
    with connection.cursor() as cursor:
        cursor.execute(_insert_stored_blocks_sql(), columns)
        return [row[0] for row in cursor.fetchall()]


@dataclass
class LoadedBlock:
    """A block a loader retrieved and verified, written to a spool file in the host tier, with
    the device tier's working copy of it when the worker keeps one (``install`` holds it)."""

    ids: BlockIds
    spool: Path
    fields: BlockFields
    install: Callable[[], tiers.DeviceAdmission] | None = None


def prepare_device_copy(ids: BlockIds, container: Container, device_tier) -> Callable | None:
    """The device tier's working copy of a loaded block's leading layers, made before the block
    is admitted (so the copying holds up nobody), when the compat's geometry is known; the
    function that installs it."""
    geometry = control.geometry(ids[0]) if device_tier is not None else None
    if geometry is None:
        return None
    geometry.check(container)
    prepared = device_tier.prepare(container, geometry)
    return lambda: device_tier.install(ids, prepared)


def do_admit_loaded(blocks: list[LoadedBlock], pending_move_id: int | None = None):
    """Admit a batch of loaded blocks in one transaction under one lock of the node; a replica
    held already stays as it is. Returns the ids of the rows whose records the caller publishes
    (``publish_all``): those newly stored, then those whose device copies made room for theirs.
    With ``pending_move_id`` the blocks are pending for
    that reshard move (not published); None when the move is no longer preparing (decided while
    the blocks travelled): nothing is kept. The spool files are gone afterwards either way."""
    name = selectors.node_name()
    prepared = [(block.ids, block.spool, block.fields) for block in blocks]
    devices = {block.ids: block.install for block in blocks if block.install is not None}
    placed: list[Path] = []
    try:
        with transaction.atomic():
            lock_node(name)
            if pending_move_id is not None:
                move = ReshardMove.objects.filter(pk=pending_move_id, phase=MovePhase.PREPARING)
                if not move.exists():
                    return None
            # The loader publishes the new rows itself at once; the keeper only if it cannot.
            retry_at = timezone.now() + PUBLISH_RETRY if pending_move_id is None else None
            republish: list[int] = []
            stored = _place_many_locked(
                name,
                prepared,
                placed,
                pending_move_id=pending_move_id,
                devices=devices,
                refresh_due_at=retry_at,
                republish=republish,
            )
            if pending_move_id is not None and stored:
                octets = StoredBlock.objects.filter(pk__in=stored).aggregate(total=Sum("size"))[
                    "total"
                ]
                ReshardMove.objects.filter(pk=pending_move_id).update(
                    fetched_blocks=F("fetched_blocks") + len(stored),
                    fetched_octets=F("fetched_octets") + octets,
                )
        placed.clear()
        return stored + republish
    finally:
        for block in blocks:
            tiers.unlink_quietly(block.spool)
        for path in placed:
            tiers.unlink_quietly(path)


def _intact(block: StoredBlock) -> bool:
    try:
        return tiers.stored_path(block).stat().st_size == block.size
    except FileNotFoundError:
        return False


def do_evict_after_fault(block: StoredBlock, reason: str) -> bool:
    """Drop a block whose serving copy is lost or damaged, leased or not: the record is
    withdrawn first (6.6), then the row goes and the leases no longer name it. The fault is
    confirmed under the node's lock, since a move to another tier looks alike from outside.
    True when the block was dropped."""
    if _intact(block):
        return False
    # "MUST first withdraw" (6.6); outside the lock, as every withdrawal (``_withdraw_many``).
    # One that fails now is owed by the eviction below.
    control.withdraw_replicas([block.ids])
    with transaction.atomic():
        lock_node(block.instance)
        current = StoredBlock.objects.filter(pk=block.pk).first()
        if current is None:
            return False
        if _intact(current):  # it had moved to another tier: its record stands again
            _publish_on_commit(current)
            return False
        log.error("replica %s is lost: %s", current, reason)
        _evict(current, reason, timezone.now())
        return True


def do_check_tier_store(name: str) -> dict:
    """Reconcile the catalog with the files (at worker start): blocks whose file is gone or of
    the wrong size are evicted as faults; files no block names are removed."""
    tiers.ensure_dirs(name)
    lost = []
    known = set()
    for block in StoredBlock.objects.filter(instance=name):
        if not _intact(block) and do_evict_after_fault(
            block, "its serving copy is missing or damaged"
        ):
            lost.append(block.block_key_hex)
    for block in StoredBlock.objects.filter(instance=name):
        known.add(tiers.stored_path(block))
    removed = []
    cutoff = time.time() - ORPHAN_GRACE_S
    for path in tiers.orphan_files(name, known):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:
            pass
    return {"lost": lost, "removed": removed}


def do_republish_all(name: str) -> int:
    """Every record of the node is due now: the keeper publishes them at its next round."""
    return StoredBlock.objects.filter(instance=name, pending_move__isnull=True).update(
        refresh_due_at=timezone.now()
    )


def do_reset_device_residency(name: str) -> int:
    """A new worker holds no working copies: records are to say so at their next refresh."""
    return StoredBlock.objects.filter(instance=name, device_layers__gt=0).update(
        device_layers=0, device_octets=0, refresh_due_at=timezone.now()
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
    """Deliver withdrawals the node owes (outside its lock, see ``_withdraw_many``); how
    many were delivered."""
    return _deliver_withdrawals(name, limit=limit)


def do_sync_device_tier(name: str, device_tier: tiers.DeviceTier) -> int:
    """Drop working copies of blocks no longer held (evicted by the HTTP process)."""
    stored = {
        (bytes(c), bytes(s), bytes(k))
        for c, s, k in StoredBlock.objects.filter(instance=name, device_layers__gt=0).values_list(
            "compat_id", "scope_id", "block_key"
        )
    }
    return len(device_tier.keep_only(stored))


# --- Leases (6.6) --------------------------------------------------------------------------------


def _quota(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-lease-quota", detail)


def _check_ttl(ttl_ms: int) -> None:
    if ttl_ms > settings.KVSP_LEASE_MAX_TTL_MS:
        raise _quota(
            f"ttl_ms {ttl_ms} exceeds this holder's lease TTL quota of "
            f"{settings.KVSP_LEASE_MAX_TTL_MS} ms"
        )


def _grant(lease: Lease) -> LeaseGrant:
    return LeaseGrant(
        lease=lease.lease,
        compat_id=bytes(lease.compat_id).hex(),
        scope_id=bytes(lease.scope_id).hex(),
        block_keys=tuple(lease.block_key_list),
        ttl_ms=lease.ttl_ms,
        expires_ms=int(lease.expires_at.timestamp() * 1000),
    )


def do_create_lease(principal, request: LeaseRequest) -> LeaseGrant:
    """POST leases (6.6): every block must be held, and the principal's leased octets stay
    within its quota."""
    name = selectors.node_name()
    compat_id, scope_id = bytes.fromhex(request.compat_id), bytes.fromhex(request.scope_id)
    keys = [bytes.fromhex(key) for key in request.block_keys]
    if not may_read_scope(principal, scope_id):
        raise ProtocolError("kvsp-not-found", f"{selectors.MISS_DETAIL} {keys[0].hex()}")
    _check_ttl(request.ttl_ms)
    with transaction.atomic():
        lock_node(name)
        now = timezone.now()
        # Of each block, its row's id and size: all a lease needs of it.
        sizes = selectors.held_sizes(name, compat_id, scope_id, keys)
        for key in keys:
            if key not in sizes:
                raise ProtocolError("kvsp-not-found", f"{selectors.MISS_DETAIL} {key.hex()}")
        octets = sum(size for _, size in sizes.values())
        held = selectors.leased_octets(name, principal.id, now)
        if held + octets > settings.KVSP_LEASE_MAX_OCTETS:
            raise _quota(
                f"leasing {octets} more octets would give this principal "
                f"{held + octets}, over its quota of {settings.KVSP_LEASE_MAX_OCTETS} octets"
            )
        lease = Lease.objects.create(
            lease=secrets.token_urlsafe(18),
            instance=name,
            principal_id=principal.id,
            compat_id=compat_id,
            scope_id=scope_id,
            block_keys=b"".join(keys),
            octets=octets,
            ttl_ms=request.ttl_ms,
            expires_at=now + timedelta(milliseconds=request.ttl_ms),
            created_at=now,
        )
        _link_leased(lease, [pk for pk, _ in sizes.values()])
    return _grant(lease)


def _link_leased(lease: Lease, block_pks: list[int]) -> None:
    """The lease's rows of its blocks (``Lease.blocks``), one statement of fixed text on
    Postgres whatever their number."""
    if connection.vendor != "postgresql":
        lease.blocks.set(block_pks)
        return
    through = Lease.blocks.through
    table = through._meta.db_table
    lease_column = through._meta.get_field("lease").column
    block_column = through._meta.get_field("storedblock").column
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({lease_column}, {block_column}) "  # noqa: S608
            "SELECT %s, unnest(%s::bigint[])",
            [lease.pk, block_pks],
        )


def _owned_lease(principal, lease_id: str, now: datetime) -> Lease:
    lease = (
        Lease.objects.select_for_update()
        .filter(lease=lease_id, instance=selectors.node_name(), principal_id=principal.id)
        .first()
    )
    # A delegated token carries one scope: another scope's leases of its principal are not
    # its to renew or release.
    if lease is None or lease.expires_at <= now or not may_read_scope(principal, lease.scope_id):
        raise ProtocolError("kvsp-not-found", "no such lease (it may have expired)")
    return lease


def do_renew_lease(principal, lease_id: str, renewal: LeaseRenewal) -> LeaseGrant:
    """PUT leases/{id} (6.6): the lease runs ``ttl_ms`` from now."""
    _check_ttl(renewal.ttl_ms)
    with transaction.atomic():
        now = timezone.now()
        lease = _owned_lease(principal, lease_id, now)
        lease.ttl_ms = renewal.ttl_ms
        lease.expires_at = now + timedelta(milliseconds=renewal.ttl_ms)
        lease.renewed_at = now
        lease.save(update_fields=["ttl_ms", "expires_at", "renewed_at"])
    return _grant(lease)


def do_release_lease(principal, lease_id: str) -> None:
    """DELETE leases/{id} (6.6); a release a reshard owes for a block it covered is done now."""
    with transaction.atomic():
        _owned_lease(principal, lease_id, timezone.now()).delete()
    do_release_owed(selectors.node_name())


def do_delete_expired_leases(name: str) -> int:
    deleted, _ = Lease.objects.filter(instance=name, expires_at__lte=timezone.now()).delete()
    return deleted


# --- Prefetch directives (6.5) --------------------------------------------------------------------


def do_accept_directive(directive: PrefetchDirective) -> Directive:
    """Record a directive and queue it for the instance's worker; the same directive sent
    again is the same row, another body under its id a conflict."""
    from workers.tasks import prefetch

    name = selectors.node_name()
    body = directive.to_json()
    directive_id = uuid.UUID(directive.directive)
    with transaction.atomic():
        # Under the node's lock, the same directive sent twice at once (a task and the
        # controller's resend) is one row, never a tripped constraint.
        lock_node(name)
        existing = Directive.objects.filter(instance=name, directive=directive_id).first()
        if existing is not None:
            if existing.body != body:
                raise ProtocolError(
                    "kvsp-conflict", f"directive {directive.directive} exists with another body"
                )
            return existing
        now = timezone.now()
        row = Directive.objects.create(
            instance=name,
            directive=directive_id,
            request_ref=directive.request_ref or "",
            compat_id=bytes.fromhex(directive.compat_id),
            scope_id=bytes.fromhex(directive.scope_id),
            body=body,
            received_at=now,
            deadline_at=now + timedelta(milliseconds=directive.deadline_ms),
        )
        prefetch.apply_async_on_commit(args=[row.pk], queue=instance_queue(name))
    return row


# --- Reshard moves (6.9) --------------------------------------------------------------------------


def _tries_locked(name: str, map_id: str, to_version: int) -> list[ReshardMove]:
    """The tries of one move at this node, the latest first, locked."""
    return list(
        ReshardMove.objects.select_for_update()
        .filter(instance=name, map=map_id, to_version=to_version)
        .order_by("-pk")
    )


def _try_of(tries: list[ReshardMove], attempt: int | None) -> ReshardMove | None:
    """The try a message is about: the one of its attempt number, or the latest when it gives
    none."""
    if attempt is None:
        return tries[0] if tries else None
    return next((move for move in tries if move.attempt == attempt), None)


def _superseded(attempt: int | None, latest: ReshardMove) -> bool:
    """A message of an attempt older than the latest try here: the PC has moved on from it."""
    return attempt is not None and latest.attempt is not None and attempt < latest.attempt


def _clear_for_new_try(
    tries: list[ReshardMove],
    attempt: int | None,
    map_id: str,
    to_version: int,
    now: datetime,
    *,
    older_ok: bool,
) -> ReshardMove | None:
    """Before another try of a move is recorded here: refused when the latest try is committed,
    or newer than ``attempt`` (unless ``older_ok``: an abort of an older try is recorded as it
    is). A latest try still preparing has been given up by the PC, which sent a later one: it
    is aborted, as its abort (perhaps still on its way) would, and returned, so that the caller
    discards its pending blocks once the later try is recorded and what that one wants passes
    to it."""
    latest = tries[0] if tries else None
    if latest is None:
        return None
    if _superseded(attempt, latest):
        if older_ok:
            return None
        raise _late(map_id, to_version, f"is at attempt {latest.attempt} here; {attempt} is older")
    if latest.phase == MovePhase.COMMITTED:
        raise _late(map_id, to_version, "is committed here")
    if latest.phase == MovePhase.PREPARING:
        latest.phase = RESHARD_PHASES.next_state(latest.phase, ReshardEvent.ABORT)
        latest.decided_at = latest.finished_at = now
        latest.save(update_fields=["phase", "decided_at", "finished_at"])
        notices.announce(latest.notice_channel)
        return latest
    return None


def _late(map_id: str, to_version: int, why: str) -> ProtocolError:
    return ProtocolError(
        "kvsp-invalid-state", f"the move of {map_id} to version {to_version} {why}"
    )


def _decided_move(
    name: str, map_id: str, to_version: int, attempt: int | None, event: ReshardEvent
) -> tuple[ReshardMove, bool]:
    """The try a commit or abort (``event``) is about, locked; True when this node has no plan
    of it and recorded it as decided, with nothing to do, so that the opposite decision
    arriving later is refused as the phases say."""
    tries = _tries_locked(name, map_id, to_version)
    move = _try_of(tries, attempt)
    if move is not None:
        return move, False
    now = timezone.now()
    phase = RESHARD_PHASES.next_state(MovePhase.PREPARING, event)
    stopped = _clear_for_new_try(
        tries, attempt, map_id, to_version, now, older_ok=phase == MovePhase.ABORTED
    )
    move = ReshardMove.objects.create(
        instance=name,
        map=map_id,
        to_version=to_version,
        attempt=attempt,
        phase=phase,
        received_at=now,
        decided_at=now,
        finished_at=now,
    )
    if stopped is not None:
        _discard_pending(name, stopped)
    return move, True


@dataclass(frozen=True)
class MoveBlocks:
    """What a plan asks of this node's tier store, by Block Key: the blocks of its fetch
    ranges, of its retain ranges and of its release ranges."""

    compat_id: bytes
    scope_id: bytes
    fetch: tuple[bytes, ...]
    retain: tuple[bytes, ...]
    release: tuple[bytes, ...]


def do_receive_plan(
    map_id: str,
    from_version: int,
    to_version: int,
    document: dict,
    blocks: MoveBlocks | None,
    deadline_ms: int,
    attempt: int | None = None,
) -> tuple[ReshardMove, bool]:
    """Record a reshard plan (6.9), or find it recorded: a repeat is the same move. True when
    its fetch ranges are to be loaded now: a new plan with something to fetch, or a repeat that
    finds loading failed or stopped (a run still loading finishes alone).

    A plan whose blocks the node already holds is loaded at once. A plan of a try decided
    already, or another plan for the same try, is refused. After an abort, a plan is the PC's
    next try of the move (``attempt`` numbers the tries when the PC gives numbers: a plan of an
    older try than the latest here is refused); a try still preparing when a later one arrives
    is aborted, and the blocks it fetched that the later one wants pass to it.
    """
    name = selectors.node_name()
    now = timezone.now()
    deadline_at = now + timedelta(milliseconds=deadline_ms)
    with transaction.atomic():
        lock_node(name)
        tries = _tries_locked(name, map_id, to_version)
        move = _try_of(tries, attempt)
        if move is not None and attempt is None and move.phase == MovePhase.ABORTED:
            move = None  # a plan after an abort, without a number: the PC's next try
        if move is not None:
            if move.phase != MovePhase.PREPARING:
                raise _late(map_id, to_version, f"is {move.phase} here; its plan comes too late")
            if move.plan != document:
                raise ProtocolError(
                    "kvsp-conflict",
                    f"another plan for the move of {map_id} to version {to_version} was "
                    "received before",
                )
            if move.loaded_at is not None:
                return move, False
            move.deadline_at, move.load_error = deadline_at, ""
            move.save(update_fields=["deadline_at", "load_error"])
            return move, True
        stopped = _clear_for_new_try(tries, attempt, map_id, to_version, now, older_ok=False)
        fetch = blocks.fetch if blocks is not None else ()
        held = (
            selectors.held_keys(name, blocks.compat_id, blocks.scope_id, list(fetch))
            if fetch
            else set()
        )
        move = ReshardMove.objects.create(
            instance=name,
            map=map_id,
            from_version=from_version,
            to_version=to_version,
            attempt=attempt,
            plan=document,
            compat_id=None if blocks is None else blocks.compat_id,
            scope_id=None if blocks is None else blocks.scope_id,
            fetch_keys=[key.hex() for key in fetch],
            release_keys=[] if blocks is None else [key.hex() for key in blocks.release],
            deadline_at=deadline_at,
            loaded_at=now if held >= set(fetch) else None,
            received_at=now,
        )
        if stopped is not None:
            _discard_pending(name, stopped)
        if blocks is not None:
            _keep_wanted(name, map_id, {key.hex() for key in (*blocks.fetch, *blocks.retain)})
    return move, move.loaded_at is None


def _keep_wanted(name: str, map_id: str, wanted: set[str]) -> None:
    """A block an earlier move of the map still owes a release of (a lease held it) that this
    move wants again stays: the release was for a version that is being left."""
    for earlier in ReshardMove.objects.select_for_update().filter(
        instance=name, map=map_id, phase=MovePhase.COMMITTED, finished_at__isnull=True
    ):
        remaining = [key for key in earlier.owed_release if key not in wanted]
        if remaining != earlier.owed_release:
            earlier.owed_release = remaining
            if not remaining:
                earlier.finished_at = timezone.now()
            earlier.save(update_fields=["owed_release", "finished_at"])


def do_finish_loading(move_id: int, error: str = "") -> None:
    """Loading of a preparing move ended: every fetch range loaded, or ``error`` says why not."""
    moves = ReshardMove.objects.filter(
        pk=move_id, phase=MovePhase.PREPARING, loaded_at__isnull=True
    )
    if error:
        moves.update(load_error=error)
    else:
        moves.update(loaded_at=timezone.now(), load_error="")
    notices.announce(ReshardMove.channel_of(move_id))


def do_commit_move(map_id: str, to_version: int, attempt: int | None = None) -> ReshardMove:
    """POST reshard {"map", "commit": v+1} (6.9): the blocks fetched for the move become held
    and are published; then the release ranges are released (``do_release_owed``). A repeated
    commit changes nothing; a commit after an abort is refused (``RESHARD_PHASES``), and so is
    one of an attempt older than the latest try here."""
    name = selectors.node_name()
    with transaction.atomic():
        lock_node(name)
        move, recorded = _decided_move(name, map_id, to_version, attempt, ReshardEvent.COMMIT)
        if recorded:
            return move
        phase = RESHARD_PHASES.next_state(move.phase, ReshardEvent.COMMIT)
        fetched = []
        if move.phase == MovePhase.PREPARING:
            now = timezone.now()
            pending = StoredBlock.objects.filter(pending_move=move)
            fetched = list(pending.values_list("pk", flat=True))
            pending.update(pending_move=None, refresh_due_at=now)
            move.phase, move.decided_at = phase, now
            move.owed_release = list(move.release_keys)
            if not move.owed_release:
                move.finished_at = now
            move.save()
            notices.announce(move.notice_channel)
    # A record that cannot be published now is due at once: the keeper publishes it.
    publish_all(fetched)
    do_release_owed(name, move.pk)
    move.refresh_from_db()
    return move


def do_abort_move(map_id: str, to_version: int, attempt: int | None = None) -> ReshardMove:
    """POST reshard {"map", "abort": v+1} (6.9): what was fetched for the move is discarded,
    nothing is released. A repeated abort changes nothing; an abort after a commit is refused
    (``RESHARD_PHASES``); an abort of an attempt older than the latest try here is about a try
    the PC has given up already, and changes nothing."""
    name = selectors.node_name()
    with transaction.atomic():
        lock_node(name)
        move, recorded = _decided_move(name, map_id, to_version, attempt, ReshardEvent.ABORT)
        if recorded:
            return move
        phase = RESHARD_PHASES.next_state(move.phase, ReshardEvent.ABORT)
        if move.phase == MovePhase.PREPARING:
            _discard_pending(name, move)
            move.phase = phase
            move.decided_at = move.finished_at = timezone.now()
            move.save(update_fields=["phase", "decided_at", "finished_at"])
            notices.announce(move.notice_channel)
    return move


def _discard_pending(name: str, move: ReshardMove) -> None:
    """Forget the blocks pending for ``move``. They were never published, so there is nothing
    to withdraw; a block another move still preparing wants passes to that move instead."""
    wanted = {
        key: other.pk
        for other in ReshardMove.objects.filter(instance=name, phase=MovePhase.PREPARING).exclude(
            pk=move.pk
        )
        for key in other.fetch_keys
    }
    for block in StoredBlock.objects.filter(pending_move=move):
        other = wanted.get(block.block_key_hex)
        if other is not None:
            block.pending_move_id = other
            block.save(update_fields=["pending_move"])
            continue
        path = tiers.stored_path(block)
        block.delete()
        transaction.on_commit(lambda path=path: tiers.unlink_quietly(path), robust=True)


def do_release_owed(name: str, move_id: int | None = None) -> int:
    """Release what committed moves owe (6.9: "instances release the ranges listed in
    release"): each block is withdrawn and evicted, unless a lease covers it (6.6), in which
    case it stays owed until the lease ends. Returns how many blocks were released."""
    moves = ReshardMove.objects.filter(
        instance=name, phase=MovePhase.COMMITTED, finished_at__isnull=True
    )
    if move_id is not None:
        moves = moves.filter(pk=move_id)
    released = 0
    for pk in moves.values_list("pk", flat=True):
        with transaction.atomic():
            lock_node(name)
            move = ReshardMove.objects.select_for_update().get(pk=pk)
            if move.finished_at is not None:
                continue
            now = timezone.now()
            leased = _leased_block_ids(name, now)
            blocks = {
                block.block_key_hex: block
                for block in selectors.held_blocks(name).filter(
                    compat_id=move.compat_id,
                    scope_id=move.scope_id,
                    block_key__in=[bytes.fromhex(key) for key in move.owed_release],
                )
            }
            owed, leaving = [], []
            for key in move.owed_release:
                block = blocks.get(key)
                if block is None:
                    continue  # gone already (evicted meanwhile): nothing to release
                if block.pk in leased:
                    owed.append(key)
                    continue
                leaving.append(block)
            reason = f"released by the move of {move.map} to version {move.to_version}"
            _evict_many(leaving, reason, now)
            move.released_blocks += len(leaving)
            released += len(leaving)
            move.owed_release = owed
            if not owed:
                move.finished_at = now
            move.save(update_fields=["owed_release", "released_blocks", "finished_at"])
    return released


# --- The instance: state, epoch, links (6.3) -----------------------------------------------------


def do_set_state(state: object) -> Node:
    """PUT state (6.3): record the state the PC asked for."""
    if state not in NodeState.values:
        raise ProtocolError(
            "kvsp-invalid-record", "state: must be one of " + ", ".join(NodeState.values)
        )
    return do_apply_pc_state(selectors.node_name(), state)


def do_apply_pc_state(name: str, state: str) -> Node:
    """The PC's decision, from PUT state or from its answer to a status report."""
    node = ensure_node(name)
    if node.state == state or state not in NodeState.values:
        return node  # the common answer changes nothing: no write lock taken
    with transaction.atomic():
        node = lock_node(name)
        if state in NodeState.values and node.state != state:
            log.info("node %s: %s -> %s (the PC's decision)", name, node.state, state)
            node.state = INSTANCE_LIFECYCLE.next_state(
                node.state, INSTANCE_LIFECYCLE.event_between(node.state, state)
            )
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
