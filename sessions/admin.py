"""Admin for sessions, their delivered tokens and the output streams open on them: read-only,
since only the protocol changes a session (6.8); each session links to its live page on the
dashboard."""

from django.contrib import admin
from django.urls import reverse

from common.admin import RowAdmin
from sessions.models import OpenStream, OutputToken, Session


class OutputTokenInline(admin.TabularInline):
    model = OutputToken
    fields = ("index", "token", "epoch", "delivered_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    max_num = 0


class FailedOverFilter(admin.SimpleListFilter):
    title = "failovers"
    parameter_name = "failed_over"

    def lookups(self, request, model_admin):
        return [("yes", "failed over at least once"), ("no", "never failed over")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(failovers__gt=0)
        if self.value() == "no":
            return queryset.filter(failovers=0)
        return queryset


@admin.register(Session)
class SessionAdmin(RowAdmin):
    list_display = (
        "session",
        "state",
        "epoch",
        "instance",
        "checkpoint_offset",
        "progress",
        "failovers",
        "created_at",
        "updated_at",
    )
    list_filter = ("state", FailedOverFilter, "instance")
    search_fields = ("session", "instance__name")
    search_help_text = "A session id or an instance name."
    list_select_related = ("instance",)
    date_hierarchy = "created_at"
    inlines = (OutputTokenInline,)

    @admin.display(description="delivered")
    def progress(self, obj):
        if obj.final_length is None:
            return f"{obj.delivered}"
        return f"{obj.delivered} / {obj.final_length}"

    def view_on_site(self, obj):
        return reverse("dashboard:session", args=[obj.session])


@admin.register(OutputToken)
class OutputTokenAdmin(RowAdmin):
    list_display = ("session", "index", "token", "epoch", "delivered_at")
    list_filter = ("epoch",)
    search_fields = ("session__session",)
    search_help_text = "A session id."
    list_select_related = ("session",)


@admin.register(OpenStream)
class OpenStreamAdmin(RowAdmin):
    """Streams open now (and rows of stopped processes until they lapse), by principal."""

    list_display = ("session", "principal", "server", "opened_at", "expires_at")
    list_filter = ("server",)
    search_fields = ("session", "principal")
    search_help_text = "A session id or a principal's id."
