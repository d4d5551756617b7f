"""Admin for the nodes' rows (shared database): what each node holds, its leases, the
directives it received, the withdrawals it still owes, the links it measured, the sessions it
serves and its reshard moves. Read-only: a node's state changes only through its own API and
worker."""

from __future__ import annotations

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from workers.models import (
    Directive,
    Lease,
    MeasuredLink,
    Node,
    PendingWithdrawal,
    ReshardMove,
    ServedSession,
    StoredBlock,
)


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ("name", "state", "epoch", "started_at", "last_report_at", "last_report_error")
    search_fields = ("name",)


@admin.register(StoredBlock)
class StoredBlockAdmin(ReadOnlyAdmin):
    list_display = (
        "block_key_hex",
        "instance",
        "tier",
        "device_layers",
        "size",
        "last_access",
        "record_expires_at",
        "pending_move",
    )
    list_filter = ("instance", "tier")
    exclude = ("layer_digests",)


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    list_display = ("lease", "instance", "principal", "octets", "expires_at")
    list_filter = ("instance",)
    exclude = ("blocks",)


@admin.register(Directive)
class DirectiveAdmin(ReadOnlyAdmin):
    list_display = ("directive", "instance", "state", "received_at", "finished_at", "reason")
    list_filter = ("instance", "state")


@admin.register(PendingWithdrawal)
class PendingWithdrawalAdmin(ReadOnlyAdmin):
    list_display = ("instance", "reason", "attempts", "created_at")


@admin.register(MeasuredLink)
class MeasuredLinkAdmin(ReadOnlyAdmin):
    list_display = ("instance", "holder", "mbit_per_s", "rtt_us", "samples", "measured_at")


@admin.register(ServedSession)
class ServedSessionAdmin(ReadOnlyAdmin):
    list_display = (
        "session",
        "epoch",
        "instance",
        "kind",
        "state",
        "produced",
        "released",
        "checkpoint_offset",
        "received_at",
        "finished_at",
        "timings_us",
        "reason",
    )
    list_filter = ("instance", "kind", "state")
    search_fields = ("session",)


@admin.register(ReshardMove)
class ReshardMoveAdmin(ReadOnlyAdmin):
    list_display = (
        "map",
        "to_version",
        "attempt",
        "instance",
        "phase",
        "fetched_blocks",
        "fetched_octets",
        "released_blocks",
        "received_at",
        "decided_at",
        "finished_at",
        "load_error",
    )
    list_filter = ("instance", "phase")
    search_fields = ("map",)
    exclude = ("plan", "fetch_keys", "release_keys")
