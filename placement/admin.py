"""Admin for the Placement Controller: instances (with lifecycle actions), directives, samples.

Protocol state (epoch, figures, expiry) is read-only here: only the protocol changes it, and
state changes go through the same service as the API.
"""

from __future__ import annotations

from django.contrib import admin, messages

from kvsp.problems import ProtocolError
from placement import services
from placement.models import Directive, Instance, InstanceState, StatusSample

_PROTOCOL_FIELDS = (
    "state",
    "state_changed_at",
    "state_version",
    "pushed_state_version",
    "epoch",
    "running",
    "queued",
    "batch_size",
    "kv_utilization",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "reported_compat_ids",
    "requested_state",
    "last_status",
    "ttl_ms",
    "last_report_at",
    "expires_at",
    "failed_at",
    "restarts",
    "registered_at",
)


def _state_action(target: str, description: str):
    @admin.action(description=description)
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


@admin.register(Instance)
class InstanceAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "url",
        "state",
        "epoch",
        "running",
        "queued",
        "kv_utilization",
        "last_report_at",
        "restarts",
    )
    list_filter = ("state",)
    search_fields = ("name", "url")
    readonly_fields = _PROTOCOL_FIELDS
    actions = (
        _state_action(InstanceState.DRAINING, "Drain the selected instances"),
        _state_action(InstanceState.SLEEPING, "Put the selected instances to sleep"),
        _state_action(InstanceState.ACTIVE, "Wake (activate) the selected instances"),
    )


@admin.register(Directive)
class DirectiveAdmin(admin.ModelAdmin):
    list_display = ("directive", "instance", "request_ref", "state", "created_at", "finished_at")
    list_filter = ("state", "instance")
    search_fields = ("request_ref", "directive")
    list_select_related = ("instance",)

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in Directive._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(StatusSample)
class StatusSampleAdmin(admin.ModelAdmin):
    list_display = ("instance", "at", "state", "running", "queued", "kv_utilization")
    list_filter = ("instance",)

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in StatusSample._meta.fields]

    def has_add_permission(self, request):
        return False
