"""Admin for sessions: read-only, since only the protocol changes a session."""

from django.contrib import admin

from sessions.models import OutputToken, Session


class OutputTokenInline(admin.TabularInline):
    model = OutputToken
    fields = ("index", "token", "epoch", "delivered_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    max_num = 0


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = (
        "session",
        "state",
        "epoch",
        "instance",
        "checkpoint_offset",
        "delivered",
        "failovers",
        "updated_at",
    )
    list_filter = ("state", "instance")
    search_fields = ("session",)
    list_select_related = ("instance",)
    inlines = (OutputTokenInline,)

    def get_readonly_fields(self, request, obj=None):
        return [field.name for field in Session._meta.fields]

    def has_add_permission(self, request):
        return False
