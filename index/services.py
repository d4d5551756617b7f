"""Writes of the Index Service: scopes, principals, descriptors, publishing and withdrawing.

Spec 4.2 (scopes), 4.1 (descriptors), 6.1 (publishing and withdrawing replicas). Views validate
HTTP and call these; management commands and the admin call the same functions.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

import orjson
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from index import authz
from index.auth import new_token
from index.models import CompatDescriptor, Holder, LookupBucket, Principal, Replica, Scope, Tier
from index.scopekeys import seal_scope_key
from kvsp import blockkeys, compat
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


_UPSERT = """
INSERT INTO index_replica (
    compat_id, scope_id, block_key, holder_id, codec, size, digest, layer_digests, residency,
    tier_mask, moqt_namespace, ttl_ms, expires_at, published_at, refreshed_at, refresh_count
)
SELECT %s, %s, %s, h.id, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0
FROM index_holder h WHERE h.url = %s
ON CONFLICT (block_key, scope_id, compat_id, holder_id) DO UPDATE SET
    codec = excluded.codec, size = excluded.size, digest = excluded.digest,
    layer_digests = excluded.layer_digests, residency = excluded.residency,
    tier_mask = excluded.tier_mask, moqt_namespace = excluded.moqt_namespace,
    ttl_ms = excluded.ttl_ms, expires_at = excluded.expires_at,
    refreshed_at = excluded.refreshed_at,
    refresh_count = index_replica.refresh_count + 1
RETURNING refresh_count
"""


@dataclass(frozen=True)
class Published:
    record: ReplicaRecord
    ttl_ms: int  # as granted: the request's, capped at KVSP_MAX_TTL_MS
    created: bool

    def to_json(self) -> dict:
        return {**self.record.to_json(), "ttl_ms": self.ttl_ms}


def do_publish_replica(
    principal, record: ReplicaRecord, *, now: datetime | None = None
) -> Published:
    """Publish or refresh one replica (spec 6.1): one atomic upsert, so concurrent publishes of
    the same replica neither duplicate it nor lose an update. The holder's interned id is looked
    up inside the same statement; only a holder's first record takes a second one.
    """
    authz.check_may_publish(principal, record)
    now = now or timezone.now()
    ttl_ms = min(record.ttl_ms, settings.KVSP_MAX_TTL_MS)
    ops = connection.ops
    params = [
        record.compat_id_bytes,
        record.scope_id_bytes,
        record.block_key_bytes,
        record.codec,
        record.size,
        record.digest_bytes,
        b"".join(bytes.fromhex(d) for d in record.layer_digests or ()),
        orjson.dumps([entry.to_json() for entry in record.residency]).decode(),
        _tier_mask(record),
        record.moqt_namespace or "",
        ttl_ms,
        ops.adapt_datetimefield_value(now + timedelta(milliseconds=ttl_ms)),
        ops.adapt_datetimefield_value(now),
        ops.adapt_datetimefield_value(now),
        record.holder,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT, params)
        row = cursor.fetchone()
        if row is None:  # the holder's first record: intern its URL, then publish
            _intern_holder(record.holder)
            cursor.execute(_UPSERT, params)
            row = cursor.fetchone()
    (refresh_count,) = row
    return Published(record, ttl_ms=ttl_ms, created=refresh_count == 0)


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
