"""Admin for the Index Service: scopes, principals (token shown once), holders, replicas,
descriptors and lookup counts.

What only the protocol may change (identities, digests, residency, expiry) is read-only here;
replicas are withdrawn through the same service as the dashboard's withdrawal. Binary ids are
searched by their hex form.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import Count, Q
from django.urls import reverse
from django.utils import timezone

from common.admin import ExpiryFilter, RowAdmin
from index import services
from index.authentication import new_token
from index.models import CompatDescriptor, Holder, LookupBucket, Principal, Replica, Scope, Tier
from kvsp.hexids import is_hex
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError


def _hex_id_search(queryset, term: str, fields: dict[int, tuple[str, ...]]):
    """Rows whose binary id equals ``term`` read as hex: ``fields`` maps an octet length to the
    fields of that length. Anything else matches nothing here."""
    term = term.strip().lower()
    for octets, names in fields.items():
        if is_hex(term, octets):
            value = bytes.fromhex(term)
            condition = Q()
            for name in names:
                condition |= Q(**{name: value})
            return queryset.filter(condition)
    return queryset.none()


@admin.register(Scope)
class ScopeAdmin(admin.ModelAdmin):
    list_display = ("name", "scope_id_hex", "shared_prefix", "created_at")
    list_filter = ("shared_prefix",)
    search_fields = ("name",)
    readonly_fields = ("scope_id_hex", "created_at")
    fields = ("name", "scope_id_hex", "shared_prefix", "created_at")
    search_help_text = "A name, or a scope id in hex."

    def get_search_results(self, request, queryset, search_term):
        found, duplicates = super().get_search_results(request, queryset, search_term)
        if search_term:
            found |= _hex_id_search(queryset, search_term, {16: ("scope_id",)})
        return found, duplicates

    def save_model(self, request, obj, form, change):
        if not change:
            for name, value in services.scope_key_fields().items():
                setattr(obj, name, value)
        super().save_model(request, obj, form, change)


@admin.register(Principal)
class PrincipalAdmin(admin.ModelAdmin):
    list_display = ("name", "scope_names", "instance", "controller", "created_at", "revoked_at")
    list_filter = ("controller", ("revoked_at", admin.EmptyFieldListFilter), "scopes")
    search_fields = ("name", "instance", "scopes__name")
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

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("scopes")

    @admin.display(description="scopes")
    def scope_names(self, obj):
        return ", ".join(scope.name for scope in obj.scopes.all()) or "—"

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
        try:
            bit = parse_decimal(self.value(), "tier", minimum=1)
        except ProtocolError:
            return queryset.none()  # no tier has that number
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
    list_display = (
        "block_key_hex",
        "holder",
        "scope_id_hex",
        "compat_short",
        "tiers",
        "size",
        "refresh_count",
        "refreshed_at",
        "expires_at",
    )
    list_filter = (ExpiryFilter, TierFilter, ScopeIdFilter, "holder")
    list_select_related = ("holder",)
    search_fields = ("holder__url",)
    search_help_text = "A holder URL, or a Block Key, scope id or Compatibility ID in hex."
    ordering = ("-refreshed_at",)
    readonly_fields = [f.name for f in Replica._meta.fields] + [
        "block_key_hex",
        "scope_id_hex",
        "compat_id_hex",
        "tiers",
    ]
    actions = ("withdraw",)

    def has_add_permission(self, request):
        return False  # replicas are published by holders, through the protocol

    def has_change_permission(self, request, obj=None):
        return False

    def get_search_results(self, request, queryset, search_term):
        found, duplicates = super().get_search_results(request, queryset, search_term)
        if search_term:
            by_id = {32: ("block_key", "compat_id"), 16: ("scope_id",)}
            found |= _hex_id_search(queryset, search_term, by_id)
        return found, duplicates

    @admin.display(description="tiers")
    def tiers(self, obj):
        return ", ".join(t.label for t in Tier if obj.tier_mask & t.value)

    @admin.display(description="compat")
    def compat_short(self, obj):
        return obj.compat_id_hex[:16] + "…"

    @admin.action(description="Withdraw the selected replicas", permissions=["delete"])
    def withdraw(self, request, queryset):
        count = services.do_withdraw_replicas(queryset.values_list("pk", flat=True))
        self.message_user(request, f"Withdrew {count} replica(s).")


@admin.register(Holder)
class HolderAdmin(admin.ModelAdmin):
    list_display = ("url", "replica_count")
    search_fields = ("url",)
    readonly_fields = ("url",)

    def has_add_permission(self, request):
        return False  # a holder is known by the replicas published for it

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(_replicas=Count("replicas"))

    @admin.display(description="replica rows", ordering="_replicas")
    def replica_count(self, obj):
        return obj._replicas

    def view_on_site(self, obj):
        return reverse("dashboard:holder", args=[obj.pk])


@admin.register(CompatDescriptor)
class CompatDescriptorAdmin(admin.ModelAdmin):
    list_display = (
        "model",
        "compat_id_hex",
        "block_tokens",
        "layers",
        "kv_heads",
        "head_dim",
        "kv_dtype",
        "registered_at",
    )
    list_filter = ("kv_dtype", "block_tokens")
    search_fields = ("model",)
    search_help_text = "A model name, or a Compatibility ID in hex."
    readonly_fields = [f.name for f in CompatDescriptor._meta.fields] + ["compat_id_hex"]

    def has_add_permission(self, request):
        return False  # registered with PUT compat/{id}, which computes the id itself

    def has_change_permission(self, request, obj=None):
        return False  # the id is a digest of the descriptor: it never changes

    def get_search_results(self, request, queryset, search_term):
        found, duplicates = super().get_search_results(request, queryset, search_term)
        if search_term:
            found |= _hex_id_search(queryset, search_term, {32: ("compat_id",)})
        return found, duplicates


@admin.register(LookupBucket)
class LookupBucketAdmin(RowAdmin):
    list_display = ("minute", "lookups", "hits", "block_keys", "matched_blocks", "ratio")
    date_hierarchy = "minute"

    @admin.display(description="matched / asked")
    def ratio(self, obj):
        ratio = obj.matched_ratio
        return "—" if ratio is None else f"{ratio:.1%}"
