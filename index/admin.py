"""Admin for the Index Service: scopes, principals (token shown once), replicas."""

from __future__ import annotations

from django.contrib import admin, messages
from django.utils import timezone

from index import services
from index.auth import new_token
from index.models import CompatDescriptor, Holder, Principal, Replica, Scope, Tier


@admin.register(Scope)
class ScopeAdmin(admin.ModelAdmin):
    list_display = ("name", "scope_id_hex", "shared_prefix", "created_at")
    list_filter = ("shared_prefix",)
    search_fields = ("name",)
    readonly_fields = ("scope_id_hex", "created_at")
    fields = ("name", "scope_id_hex", "shared_prefix", "created_at")

    def save_model(self, request, obj, form, change):
        if not change:
            for name, value in services.scope_key_fields().items():
                setattr(obj, name, value)
        super().save_model(request, obj, form, change)


@admin.register(Principal)
class PrincipalAdmin(admin.ModelAdmin):
    list_display = ("name", "instance", "controller", "created_at", "revoked_at")
    list_filter = ("controller", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "instance")
    filter_horizontal = ("scopes",)
    readonly_fields = ("created_at", "revoked_at")
    fields = ("name", "scopes", "holder_urls", "instance", "controller", "created_at", "revoked_at")
    actions = ("revoke",)

    def save_model(self, request, obj, form, change):
        if not change:
            token, obj.token_hash = new_token()
            self.message_user(
                request,
                f"Token for {obj.name} (shown once, store it now): {token}",
                messages.WARNING,
            )
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke the selected principals' tokens")
    def revoke(self, request, queryset):
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} principal(s).")


class TierFilter(admin.SimpleListFilter):
    title = "tier"
    parameter_name = "tier"

    def lookups(self, request, model_admin):
        return [(str(tier.value), tier.label) for tier in Tier]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        bit = int(self.value())
        # Bit test portable to SQLite and Postgres: mask % (2 * bit) >= bit.
        from django.db.models import F

        return queryset.annotate(_bit=F("tier_mask") % (2 * bit)).filter(_bit__gte=bit)


class ScopeIdFilter(admin.SimpleListFilter):
    title = "scope"
    parameter_name = "scope"

    def lookups(self, request, model_admin):
        return [(s.scope_id_hex, s.name) for s in Scope.objects.all()[:200]]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(scope_id=bytes.fromhex(self.value()))


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("block_key_hex", "holder", "scope_id_hex", "tiers", "size", "expires_at")
    list_filter = (ScopeIdFilter, "holder", TierFilter)
    list_select_related = ("holder",)
    readonly_fields = [f.name for f in Replica._meta.fields] + ["block_key_hex", "tiers"]
    actions = ("withdraw",)

    def has_add_permission(self, request):
        return False  # replicas are published by holders, through the protocol

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="tiers")
    def tiers(self, obj):
        return ", ".join(t.label for t in Tier if obj.tier_mask & t.value)

    @admin.action(description="Withdraw the selected replicas")
    def withdraw(self, request, queryset):
        count = services.do_withdraw_replicas(queryset.values_list("pk", flat=True))
        self.message_user(request, f"Withdrew {count} replica(s).")


@admin.register(Holder)
class HolderAdmin(admin.ModelAdmin):
    list_display = ("url",)
    search_fields = ("url",)


@admin.register(CompatDescriptor)
class CompatDescriptorAdmin(admin.ModelAdmin):
    list_display = ("model", "compat_id_hex", "layers", "kv_heads", "head_dim", "kv_dtype")
    search_fields = ("model",)
    readonly_fields = [f.name for f in CompatDescriptor._meta.fields] + ["compat_id_hex"]

    def has_add_permission(self, request):
        return False
