"""Leases (spec 6.6): POST leases creates one over blocks the node holds, PUT renews it, DELETE
releases it. A leased block is never evicted for room (``workers.eviction``) nor released by a
reshard move (``workers.reshard_moves``) while its lease runs. Each principal's leased octets
and every lease's TTL are within the holder's quota (``kvsp-lease-quota``).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from common.permissions import may_read_scope
from kvsp.problems import ProtocolError
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest
from workers import selectors
from workers.instance import lock_node
from workers.models import Lease
from workers.reshard_moves import do_release_owed


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
