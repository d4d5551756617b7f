"""Placement Controller state: instances, their status and lifecycle (spec 6.3), directives sent."""

from __future__ import annotations

from django.db import models


class InstanceState(models.TextChoices):
    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


class Instance(models.Model):
    """An inference instance: its registration, and the figures of its latest status record."""

    name = models.CharField(max_length=200, unique=True)
    url = models.CharField(max_length=2000, unique=True, help_text="Its ii-base and holder base.")
    compat_ids = models.JSONField(
        default=list, blank=True, help_text="Compatibility IDs it serves; none listed: any."
    )
    # An instance is failed until its first status report arrives.
    state = models.CharField(
        max_length=16, choices=InstanceState.choices, default=InstanceState.FAILED
    )
    epoch = models.BigIntegerField(null=True, blank=True, editable=False)
    running = models.PositiveIntegerField(default=0)
    queued = models.PositiveIntegerField(default=0)
    batch_size = models.PositiveIntegerField(default=0)
    kv_utilization = models.FloatField(default=0.0)
    prefill_tokens_per_s = models.FloatField(null=True, blank=True)
    decode_tokens_per_s = models.FloatField(null=True, blank=True)
    links = models.JSONField(default=list, blank=True)
    reported_compat_ids = models.JSONField(default=list, blank=True)
    # The latest accepted Instance Status Record as received: the cost model reads it whole.
    last_status = models.JSONField(null=True, blank=True, editable=False)
    requested_state = models.CharField(max_length=16, blank=True, default="")
    ttl_ms = models.PositiveIntegerField(null=True, blank=True)
    last_report_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    state_changed_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def serves(self, compat_id_hex: str) -> bool:
        served = set(self.compat_ids) | set(self.reported_compat_ids)
        return not served or compat_id_hex in served

    def link_to(self, holder_url: str) -> dict | None:
        return next((link for link in self.links if link.get("holder") == holder_url), None)
