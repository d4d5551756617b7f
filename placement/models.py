"""Placement Controller state: instances, their status and lifecycle (spec 6.3), directives sent
(6.5). Protocol state here is changed only through ``placement.services``.
"""

from __future__ import annotations

import uuid

import numpy as np
from django.db import models

from common.choices import choices_of
from kvsp import states
from kvsp.records import MAX_REQUEST_REF_LENGTH

InstanceState = choices_of(states.InstanceState)


def serves(compat_id_hex: str, compat_ids, reported_compat_ids, *, engine: object) -> bool:
    """``Instance.serves`` from an instance's registered and reported compat ids and the
    ``engine`` member of its latest status record (None when absent): for a caller that read
    those alone rather than the row and its whole record."""
    if engine is False:
        return False
    listed = set(compat_ids) | set(reported_compat_ids or ())
    return not listed or compat_id_hex in listed


class Instance(models.Model):
    """An inference instance: its registration, its lifecycle state as the PC decides it, and
    the figures of its latest accepted status record.
    """

    name = models.CharField(max_length=200, unique=True)
    url = models.CharField(max_length=2000, unique=True, help_text="Its ii-base and holder base.")
    compat_ids = models.JSONField(
        default=list, blank=True, help_text="Compatibility IDs it serves; none listed: any."
    )
    # An instance is failed until its first status report arrives.
    state = models.CharField(
        max_length=16, choices=InstanceState.choices, default=InstanceState.FAILED
    )
    state_changed_at = models.DateTimeField(null=True, blank=True)
    # Bumped by each change of state the PC makes; the state is pushed to the instance with
    # PUT state until pushed_state_version catches up.
    state_version = models.PositiveIntegerField(default=0)
    pushed_state_version = models.PositiveIntegerField(default=0)
    epoch = models.BigIntegerField(null=True, blank=True)
    running = models.PositiveIntegerField(default=0)
    queued = models.PositiveIntegerField(default=0)
    batch_size = models.PositiveIntegerField(default=0)
    kv_utilization = models.FloatField(default=0.0)
    prefill_tokens_per_s = models.FloatField(null=True, blank=True)
    decode_tokens_per_s = models.FloatField(null=True, blank=True)
    # As the status record lists them: null when it lists none; none listed (null or []) and
    # none registered, it serves any.
    reported_compat_ids = models.JSONField(null=True, blank=True, default=None)
    requested_state = models.CharField(max_length=16, blank=True, default="")
    # The latest accepted Instance Status Record as received: the cost model reads it whole.
    last_status = models.JSONField(null=True, blank=True)
    ttl_ms = models.PositiveIntegerField(null=True, blank=True)
    # Liveness is judged on the controller's clock, never on the reporter's timestamps.
    last_report_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    last_sample_at = models.DateTimeField(null=True, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def serves(self, compat_id_hex: str) -> bool:
        """Whether placement and resume may choose the instance for a request of this compat id
        (DESIGN.md section 3): never a node without an engine, whatever its compat ids; else
        one of its registered and reported compat ids together, or any when it lists none."""
        engine = (self.last_status or {}).get("engine")
        return serves(compat_id_hex, self.compat_ids, self.reported_compat_ids, engine=engine)

    @property
    def runs_engine(self) -> bool:
        """False when its latest status record says ``"engine": false`` (a storage-only
        holder); an instance whose record omits the member runs an engine."""
        return (self.last_status or {}).get("engine") is not False

    @property
    def links(self) -> list[dict]:
        return (self.last_status or {}).get("links", [])


class StatusSample(models.Model):
    """Recent figures of an instance, for trends on the dashboard; pruned by housekeeping."""

    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    epoch = models.BigIntegerField()
    state = models.CharField(max_length=16)
    running = models.PositiveIntegerField()
    queued = models.PositiveIntegerField()
    kv_utilization = models.FloatField()
    prefill_tokens_per_s = models.FloatField()
    decode_tokens_per_s = models.FloatField()

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["instance", "-at"])]

    def __str__(self) -> str:
        return f"{self.instance_id} at {self.at:%H:%M:%S}"


DirectiveState = choices_of(states.DirectiveState)


# Where a directive's block finds its sources in Directive.sources: uint32, little-endian.
_SOURCE_INDEX = "<u4"


class Directive(models.Model):
    """A prefetch directive the PC sent (6.5): a row before it is a message, then the state the
    instance reports for it.
    """

    directive = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="directives")
    request_ref = models.CharField(max_length=MAX_REQUEST_REF_LENGTH, blank=True, default="")
    scope_id = models.BinaryField(max_length=16)
    compat_id = models.BinaryField(max_length=32)
    # The directive's "blocks" (``blocks``), packed: thousands of entries name a few distinct
    # lists of sources, so a row stores each list once and each block's Block Key (32 octets)
    # with the position of its list (4 octets, little-endian), a fifth of the JSON's size.
    block_keys = models.BinaryField(default=b"")
    sources = models.JSONField(default=list, help_text="The distinct lists of sources by cost.")
    block_sources = models.BinaryField(default=b"")
    deadline_ms = models.PositiveBigIntegerField()
    lease_ms = models.PositiveIntegerField()
    state = models.CharField(
        max_length=16, choices=DirectiveState.choices, default=DirectiveState.PENDING
    )
    loaded = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True, default="")
    # Where the instance says the directive's state can be read (its Location answer).
    status_url = models.CharField(max_length=2000, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    polled_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    send_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.directive} → {self.instance_id}"

    @classmethod
    def pack(cls, block_keys: bytes, sources: list[list[str]], source_of) -> dict:
        """The fields of a directive's blocks: ``block_keys`` 32 octets each, ``sources`` the
        distinct lists of sources and ``source_of`` the position in it of each block's list
        (a sequence of integers or a numpy array)."""
        return {
            "block_keys": block_keys,
            "sources": sources,
            "block_sources": np.asarray(source_of, dtype=_SOURCE_INDEX).tobytes(),
        }

    @classmethod
    def pack_blocks(cls, blocks: list[dict]) -> dict:
        """The fields of a directive's ``blocks`` as the spec has them (6.5)."""
        positions: dict[tuple, int] = {}
        source_of = [
            positions.setdefault(tuple(block["sources"]), len(positions)) for block in blocks
        ]
        return cls.pack(
            b"".join(bytes.fromhex(block["block_key"]) for block in blocks),
            [list(sources) for sources in positions],
            source_of,
        )

    @property
    def block_count(self) -> int:
        return len(self.block_keys) // 32

    @property
    def blocks(self) -> list[dict]:
        """The directive's "blocks" (spec 6.5): [{"block_key", "sources": [...]}, ...], each
        block's sources ordered by cost."""
        keys = bytes(self.block_keys).hex(",", 32).split(",") if self.block_keys else []
        source_of = np.frombuffer(bytes(self.block_sources), dtype=_SOURCE_INDEX).tolist()
        sources = self.sources
        return [
            {"block_key": key, "sources": sources[s]}
            for key, s in zip(keys, source_of, strict=True)
        ]

    def body(self) -> dict:
        """The directive as sent (spec 6.5)."""
        document = {
            "directive": str(self.directive),
            "scope_id": bytes(self.scope_id).hex(),
            "compat_id": bytes(self.compat_id).hex(),
            "blocks": self.blocks,
            "layer_order": "ascending",
            "deadline_ms": self.deadline_ms,
            "lease_ms": self.lease_ms,
        }
        if self.request_ref:
            document["request_ref"] = self.request_ref
        return document

    @property
    def latency_ms(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.created_at).total_seconds() * 1000


class ShardMap(models.Model):
    """A Shard Map (spec 6.9) at its authoritative version: which instance holds which token
    range of one long context. Only a committed reshard moves it to the next version.

    ``context`` is the map's extension member naming the context's blocks
    (``placement.resharding.ShardContext``): its scope, Compatibility ID, block size and the
    Block Keys of its complete blocks. Without it the PC still plans and runs reshards, but a
    member cannot tell which blocks a token range is.
    """

    map = models.CharField(max_length=128, unique=True)
    version = models.PositiveBigIntegerField()
    shards = models.JSONField()
    context = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["map"]

    def __str__(self) -> str:
        return f"{self.map} v{self.version}"

    def document(self) -> dict:
        document = {"map": self.map, "version": self.version, "shards": self.shards}
        if self.context is not None:
            document["context"] = self.context
        return document


# Transitions follow ``kvsp.states.RESHARD_PHASES``.
ReshardPhase = choices_of(states.ReshardPhase)


class ReshardOperation(models.Model):
    """One attempt to move a Shard Map from version v to v+1 (spec 6.9): a row before any
    message, so that a restarted PC finds it and either finishes or aborts it.

    After an abort, version v is still authoritative and the move to v+1 may be tried again:
    each try is a row with the next ``attempt`` number, which its plans, commit and abort carry
    as an extension member (4.4), so that a member tells a late abort of an earlier attempt from
    the decision of the current one. At most one attempt per version is not aborted.
    """

    shard_map = models.ForeignKey(ShardMap, on_delete=models.CASCADE, related_name="operations")
    from_version = models.PositiveBigIntegerField()
    to_version = models.PositiveBigIntegerField()
    attempt = models.PositiveIntegerField(default=1)
    next_shards = models.JSONField()
    # The context of version v+1: the map's own, or a longer one the reshard request gave (the
    # context grew by the blocks decoded since). The map takes it on commit.
    next_context = models.JSONField(null=True, blank=True)
    deadline_ms = models.PositiveBigIntegerField()
    # One plan per member of either version, as sent (kvsp.records.ReshardPlan JSON, with the
    # block members of placement.resharding.ShardContext.plan_members when the map has a
    # context).
    plans = models.JSONField()
    phase = models.CharField(
        max_length=16, choices=ReshardPhase.choices, default=ReshardPhase.PREPARING
    )
    acknowledged = models.JSONField(default=list, blank=True)
    # Members that have been told the outcome (commit or abort).
    informed = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True, default="")
    started_at = models.DateTimeField()
    deadline_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["shard_map", "to_version", "attempt"], name="one_row_per_attempt"
            ),
            models.UniqueConstraint(
                fields=["shard_map", "to_version"],
                condition=~models.Q(phase="aborted"),
                name="one_live_move_per_version",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.shard_map_id}: v{self.from_version} -> v{self.to_version} "
            f"attempt {self.attempt} ({self.phase})"
        )

    @property
    def members(self) -> list[str]:
        return [plan["instance"] for plan in self.plans]
