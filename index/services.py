"""Writes of the Index Service: scopes, principals, descriptors, publishing and withdrawing.

Spec 4.2 (scopes), 4.1 (descriptors), 6.1 (publishing and withdrawing replicas). Views validate
HTTP and call these; management commands and the admin call the same functions.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

import orjson
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from common.api import OUT_OF_RANGE_DETAIL, require_object
from index import authz
from index.authentication import new_token
from index.models import CompatDescriptor, Holder, LookupBucket, Principal, Replica, Scope, Tier
from index.scopekeys import seal_scope_key
from kvsp import blockkeys, compat, hexids
from kvsp.problems import ProtocolError
from kvsp.records import ReplicaRecord

_TIER_BITS = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}


def scope_key_fields(scope_key: bytes | None = None) -> dict:
    """The id and sealed key of a scope, from a random 32-octet key unless one is given (4.2)."""
    scope_key = secrets.token_bytes(32) if scope_key is None else scope_key
    scope_id = blockkeys.scope_id(scope_key)
    return {"scope_id": scope_id, "key_ciphertext": seal_scope_key(scope_id, scope_key)}


def do_create_scope(name: str, *, scope_key: bytes | None = None, shared_prefix=False) -> Scope:
    """A new scope with a random key unless one is given (at least 32 octets, 4.2)."""
    if not name or len(name) > 200:
        raise ProtocolError("kvsp-malformed-request", "a scope name is 1 to 200 characters")
    fields = scope_key_fields(scope_key)
    if Scope.objects.filter(name=name).exists():
        raise ProtocolError("kvsp-conflict", f"a scope named {name!r} exists already")
    if Scope.objects.filter(scope_id=fields["scope_id"]).exists():
        raise ProtocolError("kvsp-conflict", "a scope with this key exists already")
    return Scope.objects.create(name=name, shared_prefix=shared_prefix, **fields)


@dataclass(frozen=True)
class IssuedPrincipal:
    principal: Principal
    token: str


@transaction.atomic
def do_create_principal(
    name: str,
    *,
    scope_ids: list[bytes] = (),
    holder_urls: list[str] = (),
    instance: str = "",
    controller: bool = False,
) -> IssuedPrincipal:
    """A principal and its token; the token is returned once and only its hash is kept."""
    if not name or len(name) > 200:
        raise ProtocolError("kvsp-malformed-request", "a principal name is 1 to 200 characters")
    if Principal.objects.filter(name=name).exists():
        raise ProtocolError("kvsp-conflict", f"a principal named {name!r} exists already")
    scopes = list(Scope.objects.filter(scope_id__in=list(scope_ids)))
    missing = {bytes(s) for s in scope_ids} - {bytes(s.scope_id) for s in scopes}
    if missing:
        raise ProtocolError(
            "kvsp-not-found", f"no scope {', '.join(sorted(m.hex() for m in missing))}"
        )
    for url in holder_urls:
        authz.check_holder_url(url)
    token, token_hash = new_token()
    principal = Principal.objects.create(
        name=name,
        token_hash=token_hash,
        holder_urls=list(holder_urls),
        instance=instance,
        controller=controller,
    )
    principal.scopes.set(scopes)
    return IssuedPrincipal(principal, token)


def do_register_descriptor(
    descriptor: object, claimed_compat_hex: str
) -> tuple[CompatDescriptor, bool]:
    """Store a Compatibility Descriptor under the id computed from it (spec 4.1)."""
    validated = compat.validate_descriptor(descriptor)
    compat_id = compat.verify_compat_id(validated, claimed_compat_hex)
    row, created = CompatDescriptor.objects.get_or_create(
        compat_id=compat_id,
        defaults={
            "descriptor": validated,
            "model": validated["model"],
            "block_tokens": validated["block_tokens"],
            "layers": validated["layers"],
            "kv_heads": validated["kv_heads"],
            "head_dim": validated["head_dim"],
            "kv_dtype": validated["kv_dtype"],
        },
    )
    return row, created


def _tier_mask(record: ReplicaRecord) -> int:
    mask = 0
    for entry in record.residency:
        mask |= _TIER_BITS.get(entry.tier, Tier.OTHER)
    return mask


def _intern_holder(url: str) -> None:
    Holder.objects.get_or_create(url=url)


# A refresh replaces everything but the identity and when it was first published (6.1).
_REFRESH = """
ON CONFLICT (block_key, scope_id, compat_id, holder_id) DO UPDATE SET
    codec = excluded.codec, size = excluded.size, digest = excluded.digest,
    layer_digests = excluded.layer_digests, residency = excluded.residency,
    tier_mask = excluded.tier_mask, moqt_namespace = excluded.moqt_namespace,
    ttl_ms = excluded.ttl_ms, expires_at = excluded.expires_at,
    refreshed_at = excluded.refreshed_at,
    refresh_count = index_replica.refresh_count + 1
"""

_UPSERT = (
    """
INSERT INTO index_replica (
    compat_id, scope_id, block_key, holder_id, codec, size, digest, layer_digests, residency,
    tier_mask, moqt_namespace, ttl_ms, expires_at, published_at, refreshed_at, refresh_count
)
SELECT %s, %s, %s, h.id, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0
FROM index_holder h WHERE h.url = %s
"""
    + _REFRESH
    + "RETURNING refresh_count"
)

# The same upsert for many rows at once (Postgres): one array per column, unnested in order,
# sent in binary (%b): a batch's digests travel as octets rather than as hex to be parsed.
_UPSERT_MANY = (
    """
WITH upserted AS (
    INSERT INTO index_replica (
        compat_id, scope_id, block_key, holder_id, codec, size, digest, layer_digests,
        residency, tier_mask, moqt_namespace, ttl_ms, expires_at, published_at, refreshed_at,
        refresh_count
    )
    SELECT b.compat_id, b.scope_id, b.block_key, h.id, b.codec, b.size, b.digest,
        b.layer_digests, b.residency, b.tier_mask, b.moqt_namespace, b.ttl_ms, b.expires_at,
        %s, %s, 0
    FROM unnest(
        %b::bytea[], %b::bytea[], %b::bytea[], %b::text[], %b::integer[], %b::bigint[],
        %b::bytea[], %b::bytea[], %b::text[], %b::smallint[], %b::text[], %b::bigint[],
        %b::timestamptz[]
    ) WITH ORDINALITY AS b(
        compat_id, scope_id, block_key, holder, codec, size, digest, layer_digests, residency,
        tier_mask, moqt_namespace, ttl_ms, expires_at, position
    )
    JOIN index_holder h ON h.url = b.holder
    ORDER BY b.position
"""  # noqa: S608 - constant fragments, every value a parameter
    + _REFRESH
    + """
    RETURNING compat_id, scope_id, block_key, holder_id, refresh_count
)
SELECT u.compat_id, u.scope_id, u.block_key, h.url, u.refresh_count
FROM upserted u JOIN index_holder h ON h.id = u.holder_id
"""
)

_INTERN_HOLDERS = "INSERT INTO index_holder (url) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING"

# What the columns hold, beyond what the record rules admit: a longer value is refused as the
# database would refuse it in a single PUT, before it could fail a whole batch's statement.
# (SQLite, the embedded default, enforces no length, and takes a batch one row at a time.)
_HOLDER_MAX_LENGTH = Holder._meta.get_field("url").max_length
_NAMESPACE_MAX_LENGTH = Replica._meta.get_field("moqt_namespace").max_length


@dataclass(frozen=True)
class Published:
    record: ReplicaRecord
    ttl_ms: int  # as granted: the request's, capped at KVSP_MAX_TTL_MS
    created: bool

    def to_json(self) -> dict:
        return {**self.record.to_json(), "ttl_ms": self.ttl_ms}


def _granted_ttl_ms(record: ReplicaRecord, max_ttl_ms: int | None = None) -> int:
    return min(record.ttl_ms, settings.KVSP_MAX_TTL_MS if max_ttl_ms is None else max_ttl_ms)


def _replica_row(
    record: ReplicaRecord, ttl_ms: int, now: datetime, shared: dict | None = None
) -> tuple:
    """A record's column values, in the order of ``_UPSERT_MANY``'s arrays. ``shared`` keeps
    what the records of one batch have in common, worked out once: the stored form of a
    residency, the expiry of a TTL."""
    shared = {} if shared is None else shared
    residency = shared.get(("residency", record.residency))
    if residency is None:
        stored = orjson.dumps([entry.to_json() for entry in record.residency]).decode()
        residency = shared[("residency", record.residency)] = (stored, _tier_mask(record))
    expires_at = shared.get(("expires", ttl_ms))
    if expires_at is None:
        expires_at = shared[("expires", ttl_ms)] = connection.ops.adapt_datetimefield_value(
            now + timedelta(milliseconds=ttl_ms)
        )
    return (
        record.compat_id_bytes,
        record.scope_id_bytes,
        record.block_key_bytes,
        record.holder,
        record.codec,
        record.size,
        record.digest_bytes,
        bytes.fromhex("".join(record.layer_digests or ())),
        *residency,
        record.moqt_namespace or "",
        ttl_ms,
        expires_at,
    )


def _row_identity(row: tuple) -> tuple:
    """What names the replica of a row: (compat_id, scope_id, block_key, holder)."""
    return row[:4]


def _record_identity(record: ReplicaRecord) -> tuple:
    return (record.compat_id_bytes, record.scope_id_bytes, record.block_key_bytes, record.holder)


def _upsert_one(cursor, row: tuple, now: datetime) -> int:
    """Upsert one replica row; its refresh count (0: inserted). The holder's interned id is
    looked up inside the same statement; only a holder's first record takes a second one."""
    stamp = connection.ops.adapt_datetimefield_value(now)
    params = [*row[:3], *row[4:], stamp, stamp, row[3]]
    cursor.execute(_UPSERT, params)
    found = cursor.fetchone()
    if found is None:  # the holder's first record: intern its URL, then publish
        _intern_holder(row[3])
        cursor.execute(_UPSERT, params)
        found = cursor.fetchone()
    return found[0]


def do_publish_replica(
    principal, record: ReplicaRecord, *, now: datetime | None = None
) -> Published:
    """Publish or refresh one replica (spec 6.1): one atomic upsert, so concurrent publishes of
    the same replica neither duplicate it nor lose an update.
    """
    authz.check_may_publish(principal, record)
    now = now or timezone.now()
    ttl_ms = _granted_ttl_ms(record)
    with connection.cursor() as cursor:
        refresh_count = _upsert_one(cursor, _replica_row(record, ttl_ms, now), now)
    return Published(record, ttl_ms=ttl_ms, created=refresh_count == 0)


@dataclass(frozen=True)
class BatchOutcome:
    """What became of one item of a batch publication or withdrawal (``POST CP replicas``,
    ``POST CP replicas/withdrawals``): the status and problem its single PUT or DELETE would
    have answered."""

    block_key: str | None
    holder: str | None
    status: int
    problem: dict | None = None
    ttl_ms: int | None = None  # as granted, for a record published

    def to_json(self) -> dict:
        out = {
            "block_key": self.block_key,
            "holder": self.holder,
            "status": self.status,
            "problem": self.problem,
        }
        if self.ttl_ms is not None:
            out["ttl_ms"] = self.ttl_ms
        return out


def _echoed(item: object, member: str) -> str | None:
    """The ``member`` of an item as it was sent (a JSON object, or a record decoded with its
    batch), for the outcome that refuses it."""
    if isinstance(item, ReplicaRecord):
        return getattr(item, member)
    value = item.get(member) if isinstance(item, dict) else None
    return value if isinstance(value, str) else None


def _judge_all(principal, items: list, decode, authorize) -> list:
    """Each item as ``decode`` makes it (an object with a ``holder``) and ``authorize(principal,
    decoded, publishable)`` allows it, or the refusal of either. The holders the decoded items
    name are looked up at once (``publishable``), not once per item."""
    decoded = []
    for item in items:
        try:
            decoded.append(decode(item))
        except ProtocolError as refusal:
            decoded.append(refusal)
    # A holder with a NUL is no URL the database could hold, nor take in a query: refused later.
    holders = {d.holder for d in decoded if not isinstance(d, ProtocolError)}
    holders = {holder for holder in holders if "\x00" not in holder}
    publishable = authz.publishable_holders(principal, holders)
    judged = []
    for item in decoded:
        try:
            if not isinstance(item, ProtocolError):
                authorize(principal, item, publishable)
            judged.append(item)
        except ProtocolError as refusal:
            judged.append(refusal)
    return judged


def _decode_record(item: object) -> ReplicaRecord:
    if isinstance(item, ReplicaRecord):
        return item  # decoded with its batch (ReplicaRecord.batch_from_body)
    return ReplicaRecord.from_json(require_object(item))


def _authorize_record(principal, record: ReplicaRecord, publishable: frozenset[str]) -> None:
    """What the single PUT refuses of a valid record: a scope or holder not the principal's,
    then a value too long for its column."""
    authz.check_may_publish(principal, record, publishable)
    too_long = len(record.holder) > _HOLDER_MAX_LENGTH or (
        len(record.moqt_namespace or "") > _NAMESPACE_MAX_LENGTH
    )
    if too_long and connection.vendor != "sqlite":  # SQLite stores any length
        raise ProtocolError("kvsp-invalid-record", OUT_OF_RANGE_DETAIL)


def _upsert_many(rows: list[tuple], now: datetime) -> dict[tuple, int]:
    """Upsert replica rows of distinct identities; each identity's refresh count (0: inserted).
    On Postgres a few statements whatever the number of rows; elsewhere (the embedded default's
    SQLite) one statement per row."""
    counts: dict[tuple, int] = {}
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            for row in rows:
                counts[_row_identity(row)] = _upsert_one(cursor, row, now)
            return counts

        def upsert(batch: list[tuple]) -> None:
            cursor.execute(_UPSERT_MANY, [now, now, *map(list, zip(*batch, strict=True))])
            for compat_id, scope_id, block_key, holder, refresh_count in cursor.fetchall():
                counts[(bytes(compat_id), bytes(scope_id), bytes(block_key), holder)] = (
                    refresh_count
                )

        upsert(rows)
        missing = [row for row in rows if _row_identity(row) not in counts]
        if missing:  # holders' first records: intern their URLs, then publish those
            cursor.execute(_INTERN_HOLDERS, [sorted({row[3] for row in missing})])
            upsert(missing)
    return counts


def do_publish_batch(principal, items: list, *, now: datetime | None = None) -> list:
    """Publish or refresh many replicas (``POST CP replicas``): each item is judged as its
    single PUT would judge it, and the accepted ones are written together. The outcomes come in
    the order of ``items``; one item's refusal changes nothing about the others.

    A replica named twice ends as its last record says, as it would after the PUTs one by one:
    its first accepted occurrence is the one that may have created it (201), later ones
    refresh it (200).
    """
    now = now or timezone.now()
    judged = _judge_all(principal, items, _decode_record, _authorize_record)
    max_ttl_ms = settings.KVSP_MAX_TTL_MS
    rows: dict[tuple, tuple] = {}
    shared: dict = {}
    for record in judged:
        if isinstance(record, ReplicaRecord):
            row = _replica_row(record, _granted_ttl_ms(record, max_ttl_ms), now, shared)
            rows[_row_identity(row)] = row  # the last record of a replica is the one it keeps
    # In one order, so that batches publishing the same replicas at once take their row locks
    # alike rather than deadlock.
    counts = _upsert_many(sorted(rows.values(), key=_row_identity), now) if rows else {}
    outcomes, seen = [], set()
    for item, record in zip(items, judged, strict=True):
        if isinstance(record, ProtocolError):
            outcomes.append(
                BatchOutcome(
                    _echoed(item, "block_key"),
                    _echoed(item, "holder"),
                    record.status,
                    record.document(),
                )
            )
            continue
        identity = record.identity
        created = identity not in seen and counts[_record_identity(record)] == 0
        seen.add(identity)
        outcomes.append(
            BatchOutcome(
                record.block_key,
                record.holder,
                201 if created else 200,
                ttl_ms=_granted_ttl_ms(record, max_ttl_ms),
            )
        )
    return outcomes


_WITHDRAW_MANY = """
DELETE FROM index_replica r
USING unnest(%b::bytea[], %b::bytea[], %b::bytea[], %b::text[])
    AS w(compat_id, scope_id, block_key, holder), index_holder h
WHERE h.url = w.holder AND r.holder_id = h.id AND r.compat_id = w.compat_id
    AND r.scope_id = w.scope_id AND r.block_key = w.block_key
RETURNING r.compat_id, r.scope_id, r.block_key, h.url
"""


class _Withdrawal(NamedTuple):
    """A replica a batch withdrawal names, by the members that name it in its record."""

    compat_id: bytes
    scope_id: bytes
    block_key: bytes
    holder: str


def _withdrawal_identity(item: object) -> _Withdrawal:
    require_object(item, "a withdrawal")
    ids = []
    for member, octets in (("compat_id", 32), ("scope_id", 16), ("block_key", 32)):
        value = item.get(member)
        if not hexids.is_hex(value, octets):
            raise ProtocolError(
                "kvsp-malformed-request", f"{member} must be hex{octets}: {2 * octets} hex digits"
            )
        ids.append(bytes.fromhex(value))
    holder = item.get("holder")
    if not isinstance(holder, str) or not holder:
        raise ProtocolError("kvsp-malformed-request", "holder is required")
    return _Withdrawal(*ids, holder)


def _authorize_withdrawal(principal, replica: _Withdrawal, publishable: frozenset[str]) -> None:
    if "\x00" in replica.holder:  # no URL the database holds: its single DELETE fails on it
        raise ProtocolError("kvsp-invalid-record", OUT_OF_RANGE_DETAIL)
    authz.check_may_withdraw(principal, replica.scope_id, replica.holder, publishable)


def _delete_replicas(identities: list[tuple]) -> set[tuple]:
    """Delete the replicas of distinct identities; those that were there. One statement on
    Postgres, one per replica elsewhere."""
    if connection.vendor != "postgresql":
        deleted = set()
        for compat_id, scope_id, block_key, holder in identities:
            found, _ = Replica.objects.filter(
                compat_id=compat_id, scope_id=scope_id, block_key=block_key, holder__url=holder
            ).delete()
            if found:
                deleted.add((compat_id, scope_id, block_key, holder))
        return deleted
    with connection.cursor() as cursor:
        cursor.execute(_WITHDRAW_MANY, [list(column) for column in zip(*identities, strict=True)])
        return {(bytes(c), bytes(s), bytes(k), h) for c, s, k, h in cursor.fetchall()}


def do_withdraw_batch(principal, items: list) -> list:
    """Withdraw many replicas (``POST CP replicas/withdrawals``): each item is judged as its
    single DELETE would judge it (a scope not granted is a replica that does not exist, a holder
    the principal does not act for is forbidden, an unknown replica is 404) and the accepted ones
    are deleted together. The outcomes come in the order of ``items``; a replica named twice is
    withdrawn by its first item, and the later ones find it gone."""
    judged = _judge_all(principal, items, _withdrawal_identity, _authorize_withdrawal)
    wanted = sorted({identity for identity in judged if isinstance(identity, tuple)})
    deleted = _delete_replicas(wanted) if wanted else set()
    missing = ProtocolError("kvsp-not-found", "no such replica")
    outcomes = []
    for item, identity in zip(items, judged, strict=True):
        if isinstance(identity, tuple) and identity in deleted:
            deleted.discard(identity)
            outcomes.append(BatchOutcome(identity[2].hex(), identity[3], 204))
            continue
        refusal = identity if isinstance(identity, ProtocolError) else missing
        outcomes.append(
            BatchOutcome(
                _echoed(item, "block_key"),
                _echoed(item, "holder"),
                refusal.status,
                refusal.document(),
            )
        )
    return outcomes


def do_withdraw_replica(
    principal, compat_id: bytes, scope_id: bytes, block_key: bytes, holder_url: str
) -> None:
    """Withdraw one replica (spec 6.1). An unknown replica is a 404, not a silent success."""
    authz.check_may_withdraw(principal, scope_id, holder_url)
    deleted, _ = Replica.objects.filter(
        compat_id=compat_id, scope_id=scope_id, block_key=block_key, holder__url=holder_url
    ).delete()
    if not deleted:
        raise ProtocolError("kvsp-not-found", "no such replica")


def do_withdraw_replicas(replica_ids) -> int:
    """Operator withdrawal (admin, dashboard): delete the rows, whoever holds them."""
    deleted, _ = Replica.objects.filter(pk__in=list(replica_ids)).delete()
    return deleted


def do_delete_expired_replicas(*, now: datetime | None = None, batch: int = 5000) -> int:
    """Delete expired replica rows in batches, so that no statement holds locks for long."""
    now = now or timezone.now()
    total = 0
    while True:
        ids = list(Replica.objects.filter(expires_at__lte=now).values_list("pk", flat=True)[:batch])
        if not ids:
            return total
        deleted, _ = Replica.objects.filter(pk__in=ids, expires_at__lte=now).delete()
        total += deleted


_ADD_LOOKUPS = """
INSERT INTO index_lookupbucket (minute, lookups, hits, block_keys, matched_blocks)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (minute) DO UPDATE SET
    lookups = index_lookupbucket.lookups + excluded.lookups,
    hits = index_lookupbucket.hits + excluded.hits,
    block_keys = index_lookupbucket.block_keys + excluded.block_keys,
    matched_blocks = index_lookupbucket.matched_blocks + excluded.matched_blocks
"""


def do_record_lookups(
    minute: datetime, *, lookups: int, hits: int, block_keys: int, matched_blocks: int
) -> None:
    """Add one process's lookup counts of a minute to that minute's bucket: one upsert, so that
    processes adding to the same minute at once lose nothing."""
    params = [
        connection.ops.adapt_datetimefield_value(minute.replace(second=0, microsecond=0)),
        lookups,
        hits,
        block_keys,
        matched_blocks,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_ADD_LOOKUPS, params)


def do_prune_lookup_buckets(*, keep: timedelta = timedelta(days=1), now=None) -> int:
    now = now or timezone.now()
    deleted, _ = LookupBucket.objects.filter(minute__lt=now - keep).delete()
    return deleted
