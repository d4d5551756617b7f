"""What the apps' admins share: read-only admins for the rows only the protocol writes, and the
list filter of rows by their expiry."""

from __future__ import annotations

from django.contrib import admin
from django.utils import timezone


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows only the protocol writes: viewable, never added or edited by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class RowAdmin(ReadOnlyAdmin):
    """A read-only admin whose page shows every field of the row (but those in ``exclude``),
    the ones the model makes not editable too."""

    def get_readonly_fields(self, request, obj=None):
        excluded = self.exclude or ()
        return [field.name for field in self.model._meta.fields if field.name not in excluded]


class ExpiryFilter(admin.SimpleListFilter):
    """Rows by their ``expires_at``: unexpired, or expired (or never given an expiry).
    ``unexpired`` and ``expired`` are each a (parameter value, label) pair."""

    title = "expiry"
    parameter_name = "expiry"
    unexpired = ("unexpired", "unexpired")
    expired = ("expired", "expired, not yet deleted")

    def lookups(self, request, model_admin):
        return [self.unexpired, self.expired]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == self.unexpired[0]:
            return queryset.filter(expires_at__gt=now)
        if self.value() == self.expired[0]:
            return queryset.exclude(expires_at__gt=now)
        return queryset
