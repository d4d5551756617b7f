"""Sessions, their checkpoints and the front end's token stream (spec 6.8)."""

from __future__ import annotations

from django.db import models

from common.choices import choices_of
from kvsp import states

# Transitions follow ``kvsp.states.SESSION_STATES``.
SessionState = choices_of(states.SessionState)


class Session(models.Model):
    """A generation session: which instance serves it under which epoch, and the checkpoint
    with the highest output_offset of that epoch.
    """

    session = models.UUIDField(unique=True)
    scope_id = models.BinaryField(max_length=16)
    compat_id = models.BinaryField(max_length=32)
    instance = models.ForeignKey(
        "placement.Instance",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="sessions",
    )
    epoch = models.PositiveBigIntegerField()
    state = models.CharField(
        max_length=16, choices=SessionState.choices, default=SessionState.RUNNING
    )
    checkpoint = models.JSONField(null=True, blank=True)
    checkpoint_epoch = models.PositiveBigIntegerField(default=0)
    checkpoint_offset = models.PositiveIntegerField(default=0)
    checkpoints = models.PositiveIntegerField(default=0)
    # The number of output tokens the front end holds, and the index after the last one once
    # the instance has said which that is.
    delivered = models.PositiveIntegerField(default=0)
    final_length = models.PositiveIntegerField(null=True, blank=True)
    failovers = models.PositiveIntegerField(default=0)
    failed_over_at = models.DateTimeField(null=True, blank=True)
    resumed_first_token_at = models.DateTimeField(null=True, blank=True)
    # The resume owed to ``instance`` while the session is resuming there: its sources, as the
    # failover chose them, and when it is (next) due. Sent until the instance accepts it
    # (``resume_sent_at``) or refuses it (the session then moves on).
    resume_blocks = models.JSONField(default=list, blank=True)
    resume_resident = models.JSONField(default=list, blank=True)
    resume_due_at = models.DateTimeField(null=True, blank=True)
    resume_attempts = models.PositiveIntegerField(default=0)
    resume_sent_at = models.DateTimeField(null=True, blank=True)
    resume_error = models.TextField(blank=True, default="")
    # The serving instance's account of its time to first token, sent with the first
    # checkpoint of an epoch (the extension member ``timings_us``).
    timings_us = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return str(self.session)


class OutputToken(models.Model):
    """One delivered output token: each index once, never changed afterwards (6.8)."""

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="tokens")
    index = models.PositiveIntegerField()
    token = models.PositiveBigIntegerField()
    epoch = models.PositiveBigIntegerField()
    delivered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["session", "index"]
        constraints = [
            models.UniqueConstraint(fields=["session", "index"], name="token_index_once")
        ]

    def __str__(self) -> str:
        return f"{self.session_id}[{self.index}]"


class OpenStream(models.Model):
    """An output event stream being served (``GET sessions/{id}/output``, event-stream), so that
    the cap on streams per principal holds across the control plane's processes. The serving
    process extends ``expires_at`` at every heartbeat and deletes the row when the stream ends;
    the rows of a process that died lapse on their own."""

    # The principal's id (index.Principal), kept as a plain number: the row outlives nothing.
    principal = models.BigIntegerField()
    session = models.UUIDField()
    # The serving process: its rows are extended together.
    server = models.CharField(max_length=64)
    opened_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["principal", "expires_at"], name="open_stream_principal"),
            models.Index(fields=["server"], name="open_stream_server"),
        ]

    def __str__(self) -> str:
        return f"{self.principal}:{self.session}"
