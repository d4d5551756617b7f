"""Admin for the Placement Controller: instances (with lifecycle actions), status samples,
prefetch directives, Shard Maps and reshard operations (with abort).

Protocol state (epoch, figures, expiry, directive and reshard outcomes) is read-only here: only
the protocol changes it. State changes and aborts go through the same services as the API and
the dashboard.
"""

from __future__ import annotations

import orjson
from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from common.admin import ExpiryFilter, RowAdmin
from kvsp.hexids import is_hex
from kvsp.problems import ProtocolError
from placement import resharding, services
from placement.models import (
    Directive,
    Instance,
    InstanceState,
    ReshardOperation,
    ReshardPhase,
    ShardMap,
    StatusSample,
)

_LIFECYCLE_FIELDS = (
    "state",
    "state_changed_at",
    "requested_state",
    "state_version",
    "pushed_state_version",
    "failed_at",
    "restarts",
)
_STATUS_FIELDS = (
    "epoch",
    "running",
    "queued",
    "batch_size",
    "kv_utilization",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "reported_compat_ids",
    "ttl_ms",
    "last_report_at",
    "expires_at",
    "last_sample_at",
    "last_status",
)
_PROTOCOL_FIELDS = (*_LIFECYCLE_FIELDS, *_STATUS_FIELDS, "registered_at")


def _state_action(target: str, description: str):
    @admin.action(description=description, permissions=["change"])
    def action(modeladmin, request, queryset):
        changed = 0
        for instance in queryset:
            try:
                services.do_change_state(instance.name, target)
                changed += 1
            except ProtocolError as error:
                modeladmin.message_user(request, f"{instance.name}: {error.detail}", messages.ERROR)
        modeladmin.message_user(request, f"Asked {changed} instance(s) to be {target}.")

    action.__name__ = f"make_{target}"
    return action


class InstanceForm(forms.ModelForm):
    """Registration checks the same names and URLs as ``kvsp_instance add``."""

    class Meta:
        model = Instance
        fields = ("name", "url", "compat_ids")

    def _checked(self, check, value):
        try:
            return check(value)
        except ProtocolError as error:
            raise ValidationError(error.detail) from None

    def clean_name(self):
        return self._checked(services.check_instance_name, self.cleaned_data["name"])

    def clean_url(self):
        return self._checked(services.check_base_url, self.cleaned_data["url"])

    def clean_compat_ids(self):
        compat_ids = self.cleaned_data["compat_ids"] or []
        if not isinstance(compat_ids, list) or not all(is_hex(c, 32) for c in compat_ids):
            raise ValidationError("a JSON list of Compatibility IDs, each 64 lowercase hex digits")
        return compat_ids


class LivenessFilter(ExpiryFilter):
    title = "status record"
    parameter_name = "record"
    unexpired = ("live", "unexpired")
    expired = ("expired", "expired or none")


@admin.register(Instance)
class InstanceAdmin(admin.ModelAdmin):
    form = InstanceForm
    list_display = (
        "name",
        "url",
        "state",
        "live",
        "epoch",
        "running",
        "queued",
        "batch_size",
        "kv_utilization",
        "last_report_at",
        "restarts",
    )
    list_filter = ("state", LivenessFilter)
    search_fields = ("name", "url")
    actions = (
        _state_action(InstanceState.DRAINING, "Drain the selected instances"),
        _state_action(InstanceState.SLEEPING, "Put the selected instances to sleep"),
        _state_action(InstanceState.ACTIVE, "Wake (activate) the selected instances"),
    )

    def get_readonly_fields(self, request, obj=None):
        # A registered instance's name is its queue and principal binding, its URL the identity
        # its status records carry: neither changes after registration.
        return _PROTOCOL_FIELDS if obj is None else ("name", "url", *_PROTOCOL_FIELDS)

    def get_fieldsets(self, request, obj=None):
        if obj is None:
            return [(None, {"fields": ("name", "url", "compat_ids")})]
        return [
            ("Registration", {"fields": ("name", "url", "compat_ids", "registered_at")}),
            (
                "Lifecycle (6.3)",
                {"fields": _LIFECYCLE_FIELDS},
            ),
            (
                "Latest status record",
                {"fields": _STATUS_FIELDS},
            ),
        ]

    @admin.display(boolean=True, description="record unexpired")
    def live(self, obj):
        return obj.expires_at is not None and obj.expires_at > timezone.now()

    def view_on_site(self, obj):
        return reverse("dashboard:instance", args=[obj.name])


@admin.register(Directive)
class DirectiveAdmin(RowAdmin):
    list_display = (
        "directive",
        "instance",
        "request_ref",
        "state",
        "loaded_of_blocks",
        "latency",
        "created_at",
        "finished_at",
    )
    list_filter = ("state", "instance", "created_at")
    search_fields = ("request_ref", "instance__name")
    search_help_text = "A request reference, an instance name, or a directive id."
    list_select_related = ("instance",)
    date_hierarchy = "created_at"

    exclude = ("block_keys", "sources", "block_sources")  # packed: shown as "blocks"

    def get_readonly_fields(self, request, obj=None):
        return [*super().get_readonly_fields(request, obj), "blocks", "latency"]

    def get_search_results(self, request, queryset, search_term):
        found, duplicates = super().get_search_results(request, queryset, search_term)
        try:
            found |= queryset.filter(directive=search_term.strip())
        except ValidationError:
            pass  # not a UUID: the text search above is all there is
        return found, duplicates

    @admin.display(description="loaded")
    def loaded_of_blocks(self, obj):
        return f"{len(obj.loaded)} / {obj.block_count}"

    @admin.display(description="blocks")
    def blocks(self, obj):
        return orjson.dumps(obj.blocks).decode()

    @admin.display(description="latency")
    def latency(self, obj):
        latency = obj.latency_ms
        return "—" if latency is None else f"{latency:.0f} ms"


@admin.register(StatusSample)
class StatusSampleAdmin(RowAdmin):
    list_display = (
        "instance",
        "at",
        "epoch",
        "state",
        "running",
        "queued",
        "kv_utilization",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    )
    list_filter = ("instance", "state")
    list_select_related = ("instance",)
    date_hierarchy = "at"


class ReshardOperationInline(admin.TabularInline):
    model = ReshardOperation
    fields = (
        "from_version",
        "to_version",
        "attempt",
        "phase",
        "started_at",
        "decided_at",
        "reason",
    )
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = True


@admin.register(ShardMap)
class ShardMapAdmin(RowAdmin):
    list_display = ("map", "version", "shard_count", "members", "updated_at")
    search_fields = ("map",)
    inlines = (ReshardOperationInline,)

    @admin.display(description="shards")
    def shard_count(self, obj):
        return len(obj.shards)

    @admin.display(description="members")
    def members(self, obj):
        return ", ".join(sorted({shard["instance"] for shard in obj.shards}))


@admin.register(ReshardOperation)
class ReshardOperationAdmin(RowAdmin):
    list_display = (
        "__str__",
        "phase",
        "acknowledged_of_members",
        "informed_of_members",
        "started_at",
        "deadline_at",
        "decided_at",
        "finished_at",
        "reason",
    )
    list_filter = ("phase", "shard_map")
    search_fields = ("shard_map__map", "reason")
    list_select_related = ("shard_map",)
    actions = ("abort",)

    @admin.display(description="acknowledged")
    def acknowledged_of_members(self, obj):
        return f"{len(obj.acknowledged)} / {len(obj.members)}"

    @admin.display(description="told")
    def informed_of_members(self, obj):
        return f"{len(obj.informed)} / {len(obj.members)}"

    def has_abort_permission(self, request):
        return request.user.has_perm("placement.change_reshardoperation")

    @admin.action(description="Abort the selected reshards", permissions=["abort"])
    def abort(self, request, queryset):
        aborted = 0
        for operation in queryset.select_related("shard_map"):
            if operation.phase != ReshardPhase.PREPARING:
                self.message_user(
                    request,
                    f"{operation}: only a reshard still preparing can be aborted",
                    messages.ERROR,
                )
                continue
            try:
                resharding.do_abort_reshard(operation.pk)
                aborted += 1
            except ProtocolError as error:
                self.message_user(request, f"{operation}: {error.detail}", messages.ERROR)
        self.message_user(request, f"Aborted {aborted} reshard(s).")
