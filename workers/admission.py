"""Admitting blocks to the node's tier store (spec 6.7): a PUT on a block resource, the blocks an
engine exported, and those a loader fetched (a prefetch, a resume, a reshard move), with the
device tier's working copies of them.

A block is placed with the node's row locked, after the room it needs is planned
(``workers.eviction``); its record is published once that is committed (``workers.replicas``).
A block fetched for a reshard move still preparing is pending (``StoredBlock.pending_move``): it
takes room and is never evicted, but it is not a replica yet, so it is not published, served or
leased. Anything else that asks the node to hold a pending block (a prefetch, a PUT, an
engine's export) makes it held at once, so that the move's abort never takes a block somebody
else wanted.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.db import connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from kvsp.container import Container
from kvsp.problems import ProtocolError
from kvsp.registries import RAW_CODEC, lookup_codec
from workers import control_plane, eviction, metrics, selectors, tiers
from workers.instance import lock_node
from workers.models import MovePhase, PendingWithdrawal, ReshardMove, StoredBlock
from workers.replicas import PUBLISH_RETRY, publish_all, publish_on_commit
from workers.tiers import BlockIds


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
    publish_on_commit(block)


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
    plan = eviction.plan_room_on_node(name, ids[1], fields.size, now)
    # Files first, and the Index Service last: a failure before the evictions leaves every
    # record as it was.
    for victim in plan.demote:
        eviction.demote(victim)
    tier = plan.tier
    path = tiers.block_path(tier, name, ids)
    tiers.place_file(spool, path)
    placed.append(path)
    eviction.evict_many(
        plan.evict,
        "evicted for room (least recently used, unleased, within quotas)",
        now,
        cause=eviction.room_cause(ids[1]),
    )
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
                publish_on_commit(block)
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
    _count_device_copies(name, [(block.tier, admission.octets)])
    _drop_device_copies(name, set(admission.dropped) - {block.ids})


def _count_device_copies(name: str, copies: list[tuple[str, int]]) -> None:
    """Working copies the device tier now holds, as (the tier of the block's serving copy,
    octets copied to the device): counted as moved from that tier to the device once the
    transaction commits. Letting a working copy go moves nothing (the hierarchy is inclusive)."""
    moved = collections.Counter()
    for tier, octets in copies:
        moved[tier] += octets
    if not any(moved.values()):
        return

    def count() -> None:
        for tier, octets in moved.items():
            if octets:
                metrics.count_tier_move(name, tier, tiers.DEVICE, octets)

    transaction.on_commit(count, robust=True)


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
    geometry = control_plane.geometry(compat_id)
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
    copies: list[tuple[str, int]] = []
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
            copies.append((tiers.HOST, admission.octets))
        rows[ids] = row
    for ids in dropped & rows.keys():  # a copy of this batch made room for a later one
        rows[ids].device_layers = rows[ids].device_octets = 0
    created = _insert_stored_blocks(list(rows.values()))
    _count_device_copies(name, copies)
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
    geometry = control_plane.geometry(ids[0]) if device_tier is not None else None
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


def do_reset_device_residency(name: str) -> int:
    """A new worker holds no working copies: records are to say so at their next refresh."""
    return StoredBlock.objects.filter(instance=name, device_layers__gt=0).update(
        device_layers=0, device_octets=0, refresh_due_at=timezone.now()
    )


def do_sync_device_tier(name: str, device_tier: tiers.DeviceTier) -> int:
    """Drop working copies of blocks no longer held (evicted by the HTTP process)."""
    stored = {
        (bytes(c), bytes(s), bytes(k))
        for c, s, k in StoredBlock.objects.filter(instance=name, device_layers__gt=0).values_list(
            "compat_id", "scope_id", "block_key"
        )
    }
    return len(device_tier.keep_only(stored))
