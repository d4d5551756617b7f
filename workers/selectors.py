"""Reads of the node: the blocks it holds, the records it publishes for them (4.4, 6.1), the
state of directives (6.5), the figures of its status record (6.3), and the requests of a session
it served (6.8)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from common.permissions import may_read_scope
from kvsp.container import format_digest
from kvsp.problems import ProtocolError
from kvsp.records import DirectiveStatusRecord, Link, ReplicaRecord, ResidencyEntry
from workers import tiers
from workers.models import Directive, Lease, MeasuredLink, ServedSession, StoredBlock

# A miss and a block of a scope the caller may not read answer the same (DESIGN.md section 6).
MISS_DETAIL = "this holder has no replica of the block"


def access_resolution() -> timedelta:
    """How stale a block's last_access may be before a read refreshes it
    (``KVSP_ACCESS_RESOLUTION_MS``): the LRU order to that resolution, without a write per GET."""
    return timedelta(milliseconds=settings.KVSP_ACCESS_RESOLUTION_MS)


def node_name() -> str:
    if not settings.KVSP_INSTANCE:
        raise ProtocolError("kvsp-unavailable", "this node has no KVSP_INSTANCE configured")
    return settings.KVSP_INSTANCE


def stored_block(name: str, compat_id: bytes, scope_id: bytes, block_key: bytes):
    """The block's row, held or pending for a reshard move."""
    return StoredBlock.objects.filter(
        instance=name, compat_id=compat_id, scope_id=scope_id, block_key=block_key
    ).first()


def held_blocks(name: str):
    """The node's replicas: its blocks but those pending for a reshard move (6.9), which are
    not replicas until the move commits."""
    return StoredBlock.objects.filter(instance=name, pending_move__isnull=True)


_FIELDS = [field.attname for field in StoredBlock._meta.concrete_fields]
# The one query of every block GET: written out once rather than compiled by the ORM per
# request (which costs more CPU than the rest of the request's handling).
# Names from the model, values as parameters:
_COLUMNS = ", ".join(field.column for field in StoredBlock._meta.concrete_fields)
_HELD_BLOCK_WHERE = (
    "instance = %s AND compat_id = %s AND scope_id = %s AND block_key = %s "
    "AND pending_move_id IS NULL"
)
_HELD_BLOCKS_WHERE = (
    "instance = %s AND compat_id = %s AND scope_id = %s AND block_key = ANY(%s) "
    "AND pending_move_id IS NULL"
)
_HELD_BLOCK = f"SELECT {_COLUMNS} FROM {StoredBlock._meta.db_table} WHERE {_HELD_BLOCK_WHERE}"  # noqa: S608


_BLOCKS_WITH_KEYS = (
    f"SELECT {_COLUMNS} FROM {StoredBlock._meta.db_table} "  # noqa: S608
    "WHERE instance = %s AND block_key = ANY(%s)"
)


def blocks_with_keys(name: str, keys: list[bytes]) -> list[StoredBlock]:
    """The node's rows (held or pending) of any of ``keys``, whatever their compat and scope,
    in one statement of one fixed text."""
    if connection.vendor != "postgresql":
        return list(StoredBlock.objects.filter(instance=name, block_key__in=keys))
    with connection.cursor() as cursor:
        cursor.execute(_BLOCKS_WITH_KEYS, [name, list(keys)])
        rows = cursor.fetchall()
    return [StoredBlock.from_db(connection.alias, _FIELDS, row) for row in rows]


_HELD_BLOCKS_BY_ID = (
    f"SELECT {_COLUMNS} FROM {StoredBlock._meta.db_table} "  # noqa: S608
    "WHERE id = ANY(%s) AND pending_move_id IS NULL"
)
_RESIDENCIES = (
    f"SELECT id, tier, device_layers FROM {StoredBlock._meta.db_table} "  # noqa: S608
    "WHERE id = ANY(%s)"
)


_HELD_SIZES = (
    f"SELECT block_key, id, size FROM {StoredBlock._meta.db_table} "  # noqa: S608
    f"WHERE {_HELD_BLOCKS_WHERE}"
)


def held_sizes(
    name: str, compat_id: bytes, scope_id: bytes, keys: list[bytes]
) -> dict[bytes, tuple[int, int]]:
    """(row id, size) of each held block of ``keys``, by key."""
    if connection.vendor != "postgresql":
        rows = (
            held_blocks(name)
            .filter(compat_id=compat_id, scope_id=scope_id, block_key__in=keys)
            .values_list("block_key", "id", "size")
        )
    else:
        with connection.cursor() as cursor:
            cursor.execute(_HELD_SIZES, [name, compat_id, scope_id, list(keys)])
            rows = cursor.fetchall()
    return {bytes(key): (pk, size) for key, pk, size in rows}


def held_blocks_by_id(pks: list[int]) -> list[StoredBlock]:
    """The rows of ``pks`` that are replicas (not pending for a reshard move)."""
    if connection.vendor != "postgresql":
        return list(StoredBlock.objects.filter(pk__in=pks, pending_move__isnull=True))
    with connection.cursor() as cursor:
        cursor.execute(_HELD_BLOCKS_BY_ID, [list(pks)])
        rows = cursor.fetchall()
    return [StoredBlock.from_db(connection.alias, _FIELDS, row) for row in rows]


def residencies(pks: list[int]) -> dict[int, tuple[str, int]]:
    """(tier, device_layers) of each row of ``pks`` that still exists: where its layers are."""
    if connection.vendor != "postgresql":
        rows = StoredBlock.objects.filter(pk__in=pks).values_list("pk", "tier", "device_layers")
    else:
        with connection.cursor() as cursor:
            cursor.execute(_RESIDENCIES, [list(pks)])
            rows = cursor.fetchall()
    return {pk: (tier, device_layers) for pk, tier, device_layers in rows}


def held_block(name: str, compat_id: bytes, scope_id: bytes, block_key: bytes):
    if connection.vendor != "postgresql":
        # SQLite hands raw cursors text and naive datetimes: only the ORM converts them.
        return (
            held_blocks(name)
            .filter(compat_id=compat_id, scope_id=scope_id, block_key=block_key)
            .first()
        )
    with connection.cursor() as cursor:
        cursor.execute(_HELD_BLOCK, [name, compat_id, scope_id, block_key])
        row = cursor.fetchone()
    return None if row is None else StoredBlock.from_db(connection.alias, _FIELDS, row)


# The read and the touch of a block GET as one statement, which Postgres runs as a transaction
# of its own outside a transaction block: the UPDATE in WITH runs whether or not its output is
# read, and both see the same snapshot, so the row comes back as it was before the touch.
# set_config(..., true) lasts until that transaction commits, so the touch does not wait for the
# WAL to reach the disk (see ``touch``).
_READ_AND_TOUCH_HELD_BLOCK = (
    f"WITH touched AS (UPDATE {StoredBlock._meta.db_table} SET last_access = %s "  # noqa: S608
    f"WHERE {_HELD_BLOCK_WHERE} AND last_access < %s) "
    f"SELECT {_COLUMNS}, set_config('synchronous_commit', 'off', true) "
    f"FROM {StoredBlock._meta.db_table} WHERE {_HELD_BLOCK_WHERE}"
)


def block_for_reader(principal, compat_id: bytes, scope_id: bytes, block_key: bytes):
    """The held block, or None for a miss or a scope the principal may not read (alike)."""
    if not may_read_scope(principal, scope_id):
        return None
    return held_block(node_name(), compat_id, scope_id, block_key)


def read_block(principal, compat_id: bytes, scope_id: bytes, block_key: bytes):
    """``block_for_reader``, and the block marked used (``touch``) as it is read.

    On Postgres, outside a transaction, the read and the touch are one statement
    (``_READ_AND_TOUCH_HELD_BLOCK``): one round trip, one cursor, instead of the read and the
    touch's BEGIN, UPDATE and COMMIT, and without the ORM compiling an UPDATE per GET. The touch
    is done before the GET answers, so that any process choosing what to evict next sees it.
    It counts a GET the view then refuses for its layers or codec as a use of the block: it
    was asked for."""
    if not may_read_scope(principal, scope_id):
        return None
    name = node_name()
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        block = held_block(name, compat_id, scope_id, block_key)
        if block is not None:
            touch(block)
        return block
    now = timezone.now()
    ids = [name, compat_id, scope_id, block_key]
    row = _fetch_one_checking_by_use(
        _READ_AND_TOUCH_HELD_BLOCK, [now, *ids, now - access_resolution(), *ids]
    )
    return None if row is None else StoredBlock.from_db(connection.alias, _FIELDS, row[:-1])


_READ_AND_TOUCH_HELD_BLOCKS = (
    f"WITH touched AS (UPDATE {StoredBlock._meta.db_table} SET last_access = %s "  # noqa: S608
    f"WHERE {_HELD_BLOCKS_WHERE} AND last_access < %s) "
    f"SELECT {_COLUMNS}, set_config('synchronous_commit', 'off', true) "
    f"FROM {StoredBlock._meta.db_table} WHERE {_HELD_BLOCKS_WHERE}"
)


def read_blocks(principal, compat_id: bytes, scope_id: bytes, keys: list[bytes]) -> dict:
    """``read_block`` for many keys of one compat and scope at once, in one statement on
    Postgres: the held blocks by key (none for a scope the principal may not read)."""
    if not may_read_scope(principal, scope_id):
        return {}
    name = node_name()
    now = timezone.now()
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        found = held_blocks(name).filter(compat_id=compat_id, scope_id=scope_id, block_key__in=keys)
        blocks = {bytes(block.block_key): block for block in found}
        resolution = access_resolution()
        stale = [b.pk for b in blocks.values() if now - b.last_access >= resolution]
        if stale:
            StoredBlock.objects.filter(pk__in=stale).update(last_access=now)
        return blocks
    ids = [name, compat_id, scope_id, list(keys)]
    rows = _fetch_all_checking_by_use(
        _READ_AND_TOUCH_HELD_BLOCKS, [now, *ids, now - access_resolution(), *ids]
    )
    blocks = (StoredBlock.from_db(connection.alias, _FIELDS, row[:-1]) for row in rows)
    return {bytes(block.block_key): block for block in blocks}


def _fetch_one_checking_by_use(sql: str, params: list):
    rows = _fetch_all_checking_by_use(sql, params)
    return rows[0] if rows else None


def _fetch_all_checking_by_use(sql: str, params: list) -> list:
    """The rows of a statement that may run twice (outside a transaction), on the connection
    kept from an earlier request without Django's health check of it (CONN_HEALTH_CHECKS: a
    ``SELECT 1``, a round trip of its own before the request's first query). Should the
    connection have died since (a database restart), the statement fails, and it runs once
    more on a new connection: what the check would have done, paid for only when needed."""
    if connection.connection is not None and not connection.health_check_done:
        connection.health_check_done = True
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return cursor.fetchall()
        except (OperationalError, InterfaceError):
            connection.close()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def touch(block: StoredBlock, now: datetime | None = None) -> None:
    """Mark a block used, for the LRU order of eviction.

    A GET waits for this before it answers, and a loader's GETs each touch a block not read for
    a while: the write does not wait for the WAL to reach the disk, since a touch lost in a
    crash only makes the LRU order a little older."""
    now = now or timezone.now()
    if now - block.last_access >= access_resolution():
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL synchronous_commit TO OFF")
            StoredBlock.objects.filter(pk=block.pk).update(last_access=now)


def held_keys(name: str, compat_id: bytes, scope_id: bytes, keys: list[bytes]) -> set[bytes]:
    found = (
        held_blocks(name)
        .filter(compat_id=compat_id, scope_id=scope_id, block_key__in=keys)
        .values_list("block_key", flat=True)
    )
    return {bytes(key) for key in found}


def residency(block: StoredBlock) -> tuple[ResidencyEntry, ...]:
    """Each layer in the fastest tier that holds it (see ``workers.tiers``): the leading layers
    with a working copy on the device, the rest in the serving tier; every entry is read at the
    serving tier's rate, which is where a peer's GET reads it."""
    rate = tiers.read_mbit_per_s(block.tier)
    last = block.layer_count - 1
    entries = []
    device_layers = min(block.device_layers, block.layer_count)
    if device_layers:
        entries.append(ResidencyEntry(tiers.DEVICE, (0, device_layers - 1), rate))
    if device_layers <= last:
        entries.append(ResidencyEntry(block.tier, (device_layers, last), rate))
    return tuple(entries)


def replica_record(block: StoredBlock) -> ReplicaRecord:
    compat_id, scope_id, block_key = block.ids
    return ReplicaRecord(
        block_key=block_key.hex(),
        compat_id=compat_id.hex(),
        scope_id=scope_id.hex(),
        holder=settings.KVSP_PUBLIC_URL,
        codec=block.codec,
        size=block.size,
        digest=format_digest(bytes(block.digest)),
        layer_digests=tuple(d.hex() for d in block.layer_digest_list),
        residency=residency(block),
        ttl_ms=settings.KVSP_REPLICA_TTL_MS,
    )


def replica_digest_octets(layer_digests: list[bytes]) -> bytes:
    return hashlib.sha256(b"".join(layer_digests)).digest()


def remaining_record_s(block: StoredBlock, now: datetime | None = None) -> int:
    """Whole seconds until the block's record expires at the IS (0 while unpublished): the
    bound on ``max-age`` (6.7)."""
    if block.record_expires_at is None:
        return 0
    remaining = block.record_expires_at - (now or timezone.now())
    return max(int(remaining.total_seconds()), 0)


def directive_status(row: Directive) -> DirectiveStatusRecord:
    return DirectiveStatusRecord(
        directive=str(row.directive),
        state=row.state,
        loaded=tuple(row.loaded),
        reason=row.reason or None,
    )


def used_octets(name: str, tier: str) -> int:
    total = StoredBlock.objects.filter(instance=name, tier=tier).aggregate(total=Sum("size"))
    return total["total"] or 0


def octets_by_scope(name: str) -> dict[bytes, int]:
    """The octets each scope's blocks take on the node, both tiers and pending blocks included,
    in one query: what the fairness rule of eviction weighs (``workers.eviction``)."""
    rows = (
        StoredBlock.objects.filter(instance=name)
        .values("scope_id")
        .annotate(octets=Sum("size"))
        .order_by()
    )
    return {bytes(row["scope_id"]): row["octets"] for row in rows}


def leased_octets(name: str, principal_id: int, now: datetime) -> int:
    total = Lease.objects.filter(
        instance=name, principal_id=principal_id, expires_at__gt=now
    ).aggregate(total=Sum("octets"))
    return total["total"] or 0


def leased_block_ids(name: str, now: datetime) -> set[int]:
    """The node's blocks an unexpired lease covers (6.6): never evicted for room, nor released
    by a reshard move, while it runs."""
    return set(
        StoredBlock.objects.filter(instance=name, leases__expires_at__gt=now).values_list(
            "pk", flat=True
        )
    )


def kv_utilization(name: str) -> float:
    """The share of the node's storage tiers in use (4.4 "kv_utilization")."""
    capacity = tiers.capacity(tiers.HOST) + tiers.capacity(tiers.DISK)
    if capacity == 0:
        return 1.0
    used = used_octets(name, tiers.HOST) + used_octets(name, tiers.DISK)
    return min(used / capacity, 1.0)


def links(name: str) -> tuple[Link, ...]:
    """Measured links, and the configured ones (KVSP_LINKS) for holders not measured."""
    measured = {
        row.holder: Link(holder=row.holder, mbit_per_s=row.mbit_per_s, rtt_us=row.rtt_us)
        for row in MeasuredLink.objects.filter(instance=name)
    }
    configured = {link.holder: link for link in settings.KVSP_LINKS}
    return tuple(sorted({**configured, **measured}.values(), key=lambda link: link.holder))


# --- Leases across nodes, for the dashboard and /metrics -------------------------------------


def _live_leases(now, instance: str | None):
    leases = Lease.objects.filter(expires_at__gt=now)
    return leases if instance is None else leases.filter(instance=instance)


def lease_totals(*, instance: str | None = None, now=None) -> list[dict]:
    """Per holder instance: its unexpired leases and the octets they keep from eviction."""
    now = now or timezone.now()
    rows = (
        _live_leases(now, instance)
        .values("instance")
        .annotate(leases=Count("pk"), octets=Sum("octets"))
        .order_by("instance")
    )
    return [{"instance": r["instance"], "leases": r["leases"], "octets": r["octets"]} for r in rows]


def recent_leases(limit: int = 20, *, instance: str | None = None, now=None) -> list[Lease]:
    """Unexpired leases, the latest first, with the principal that holds each."""
    now = now or timezone.now()
    return list(
        _live_leases(now, instance).select_related("principal").order_by("-created_at")[:limit]
    )


# The most requests of one session read for its page: one per epoch, so a session that failed
# over more often than this shows its first ones.
SESSION_REQUESTS = 50


@dataclass(frozen=True)
class ServedRequest:
    """One request of a session an instance served (a generate, or a resume under a later
    epoch), and how many of the blocks it imported its prefetch directive loaded from peers:
    those the directive reports loaded, up to the blocks the request imported (the rest were in
    the instance's own tiers already)."""

    row: ServedSession
    peer_blocks: int


def served_requests(session, limit: int = SESSION_REQUESTS) -> list[ServedRequest]:
    """The requests of ``session`` (its UUID) every instance served, by epoch: two queries,
    the rows and their directives (a resume's by its row, a generate's by its request_ref)."""
    rows = list(ServedSession.objects.filter(session=session).order_by("epoch", "pk")[:limit])
    if not rows:
        return []
    wanted = Q(pk__in=[row.directive_id for row in rows if row.directive_id is not None])
    for row in rows:
        if row.directive_id is None and row.request_ref:
            wanted |= Q(instance=row.instance, request_ref=row.request_ref)
    by_id, by_ref = {}, {}
    directives = Directive.objects.filter(wanted).order_by("received_at", "pk")
    for directive in directives.only("pk", "instance", "request_ref", "loaded"):
        by_id[directive.pk] = by_ref[directive.instance, directive.request_ref] = directive
    found = []
    for row in rows:
        if row.directive_id is not None:
            directive = by_id.get(row.directive_id)
        else:
            # A generate runs with the latest directive of its request_ref (as the worker
            # looks it up), none without one.
            directive = by_ref.get((row.instance, row.request_ref)) if row.request_ref else None
        loaded = len(directive.loaded) if directive is not None else 0
        found.append(ServedRequest(row, min(loaded, row.loaded_blocks)))
    return found
