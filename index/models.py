"""Index Service state: scopes, principals and their grants, holders, replicas (spec 4.2, 6.1)."""

from __future__ import annotations

from django.db import models


class Scope(models.Model):
    """A scope (spec 4.2): principals that share a Scope Key, and the caches made with it."""

    scope_id = models.BinaryField(max_length=16, unique=True, editable=False)
    name = models.CharField(max_length=200, unique=True)
    # nonce || AES-GCM ciphertext of the scope key, with the scope id as associated data.
    key_ciphertext = models.BinaryField(editable=False)
    shared_prefix = models.BooleanField(
        default=False,
        help_text="A dedicated scope for a public prefix shared across tenants (spec 4.2).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.scope_id_hex})"

    @property
    def scope_id_hex(self) -> str:
        return bytes(self.scope_id).hex()


class Principal(models.Model):
    """A party that calls the API with a bearer token (DESIGN.md section 6)."""

    name = models.CharField(max_length=200, unique=True)
    # SHA-256 of the token: tokens are 256-bit random values, so a fast hash is enough.
    token_hash = models.BinaryField(max_length=32, unique=True, editable=False)
    scopes = models.ManyToManyField(Scope, blank=True, related_name="principals")
    holder_urls = models.JSONField(
        default=list, blank=True, help_text="Holder base URLs this principal may publish for."
    )
    instance = models.CharField(
        max_length=200, blank=True, default="", help_text="The instance this principal speaks for."
    )
    controller = models.BooleanField(
        default=False, help_text="The Placement Controller: may act on every instance."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class Holder(models.Model):
    """A holder base URL, interned so that replica rows stay compact."""

    url = models.CharField(max_length=2000, unique=True)

    def __str__(self) -> str:
        return self.url


class Tier(models.IntegerChoices):
    """Bits of Replica.tier_mask: which tiers hold some layers of the replica."""

    DEVICE = 1, "device"
    HOST = 2, "host"
    DISK = 4, "disk"
    OTHER = 8, "other"


class Replica(models.Model):
    """One replica of one block at one holder (spec 4.4 Replica Record, 6.1).

    Identities and digests are raw octets, so that a row with 32 layer digests stays well below
    the size at which Postgres moves values out of line (TOAST): lookup reads only the heap.
    """

    compat_id = models.BinaryField(max_length=32)
    scope_id = models.BinaryField(max_length=16)
    block_key = models.BinaryField(max_length=32)
    holder = models.ForeignKey(Holder, on_delete=models.PROTECT, related_name="replicas")
    codec = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    digest = models.BinaryField(max_length=32)
    layer_digests = models.BinaryField(blank=True, default=b"")
    # Canonical JSON written by the IS itself after validation; lookup splices it unparsed.
    residency = models.TextField(default="[]")
    tier_mask = models.PositiveSmallIntegerField(default=0)
    moqt_namespace = models.CharField(max_length=400, blank=True, default="")
    ttl_ms = models.PositiveBigIntegerField()
    expires_at = models.DateTimeField(db_index=True)
    published_at = models.DateTimeField()
    refreshed_at = models.DateTimeField()
    # 0 when the row was inserted, +1 per refresh: tells a publisher 201 from 200 atomically.
    refresh_count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["block_key", "scope_id", "compat_id", "holder"],
                name="replica_identity",
            )
        ]

    def __str__(self) -> str:
        return f"{bytes(self.block_key).hex()[:16]}… at {self.holder_id}"

    @property
    def block_key_hex(self) -> str:
        return bytes(self.block_key).hex()

    @property
    def scope_id_hex(self) -> str:
        return bytes(self.scope_id).hex()

    @property
    def compat_id_hex(self) -> str:
        return bytes(self.compat_id).hex()


class CompatDescriptor(models.Model):
    """A registered Compatibility Descriptor (spec 4.1), stored under the id computed from it."""

    compat_id = models.BinaryField(max_length=32, unique=True, editable=False)
    descriptor = models.JSONField()
    model = models.CharField(max_length=400)
    block_tokens = models.PositiveIntegerField()
    layers = models.PositiveIntegerField()
    kv_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    kv_dtype = models.CharField(max_length=40)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "compatibility descriptor"

    def __str__(self) -> str:
        return f"{self.model} ({self.compat_id_hex[:16]}…)"

    @property
    def compat_id_hex(self) -> str:
        return bytes(self.compat_id).hex()


class LookupBucket(models.Model):
    """Lookups (6.2) of one minute: how many Block Keys were asked for and how many matched, for
    the hit ratio over time on the dashboard. Each server process adds its counts at most once a
    second (``common.metrics``), so a lookup itself never waits on this write.
    """

    minute = models.DateTimeField(unique=True)
    lookups = models.PositiveBigIntegerField(default=0)
    # Lookups that matched at least one block.
    hits = models.PositiveBigIntegerField(default=0)
    block_keys = models.PositiveBigIntegerField(default=0)
    matched_blocks = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-minute"]

    def __str__(self) -> str:
        return f"lookups at {self.minute:%Y-%m-%d %H:%M}"

    @property
    def matched_ratio(self) -> float | None:
        return self.matched_blocks / self.block_keys if self.block_keys else None
