"""Node state (DESIGN.md sections 1 and 2): the instance itself, its tier store catalog, leases
(spec 6.6), prefetch directives (6.5), withdrawals still owed to the Index Service (6.1), the
links it measured (6.3), the sessions it serves (6.8) and its moves between Shard Map versions
(6.9).

Every table carries the instance name: the roles share one database in the reference deployment,
and so do the nodes, so each node reads and writes only the rows of its own name. Identities and
digests are raw octets, as in the Index Service.
"""

from __future__ import annotations

from django.db import models

from common.choices import choices_of
from kvsp import states


class NodeState(models.TextChoices):
    """The states the PC asks a node for (6.3); "failed" is the PC's view alone."""

    ACTIVE = states.InstanceState.ACTIVE.value
    DRAINING = states.InstanceState.DRAINING.value
    SLEEPING = states.InstanceState.SLEEPING.value


class Node(models.Model):
    """One inference instance or holder, as the node itself knows it.

    The row also serializes the node's tier changes: placing a block, evicting one and creating a
    lease lock it (``select_for_update``), so that no eviction races a lease.
    """

    name = models.CharField(max_length=100, unique=True)
    # The epoch of the running incarnation (6.3): its start time in milliseconds, raised to one
    # more than the previous incarnation's whenever the clock says less.
    epoch = models.BigIntegerField(default=0)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.ACTIVE)
    state_changed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    last_report_at = models.DateTimeField(null=True, blank=True)
    last_report_error = models.TextField(blank=True, default="")
    # What the worker's engine serves, once it is loaded: {"compat_id", "block_tokens",
    # "vocab_size", "max_positions"}. The HTTP process checks session requests against it
    # without loading a model of its own; null while the engine loads, and on a holder.
    engine = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class StorageTier(models.TextChoices):
    """Where the serving copy of a block lives: files the HTTP process sends as they are."""

    HOST = "host"
    DISK = "disk"


class StoredBlock(models.Model):
    """A block this node holds: one replica (6.1) in its tier store (DESIGN.md section 1).

    The hierarchy is inclusive: the serving copy is a file in the host tier (shared memory) or
    the disk tier, and the worker may keep a working copy of the leading ``device_layers``
    layers as tensors in the device tier.
    """

    instance = models.CharField(max_length=100)
    compat_id = models.BinaryField(max_length=32)
    scope_id = models.BinaryField(max_length=16)
    block_key = models.BinaryField(max_length=32)
    codec = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    token_count = models.PositiveIntegerField()
    layer_count = models.PositiveIntegerField()
    digest = models.BinaryField(max_length=32)
    layer_digests = models.BinaryField()
    # SHA-256 of the whole container as stored: its Repr-Digest (6.7).
    repr_sha256 = models.BinaryField(max_length=32)
    tier = models.CharField(max_length=8, choices=StorageTier.choices)
    device_layers = models.PositiveIntegerField(default=0)
    device_octets = models.PositiveBigIntegerField(default=0)
    stored_at = models.DateTimeField()
    # Least recently used first is the eviction order; GETs refresh it at most once per
    # KVSP_ACCESS_RESOLUTION_MS (a second by default).
    last_access = models.DateTimeField()
    # When the IS's copy of the Replica Record expires; null while it is not published.
    record_expires_at = models.DateTimeField(null=True, blank=True)
    # When the record is next published: half way through its TTL, or at once after a change.
    refresh_due_at = models.DateTimeField(db_index=True)
    # Fetched for a reshard move still preparing (6.9): kept, never evicted, but not a replica
    # yet: unpublished, and neither served nor leased. The commit makes it held; an abort
    # discards it.
    pending_move = models.ForeignKey(
        "ReshardMove",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="pending_blocks",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "compat_id", "scope_id", "block_key"], name="stored_block"
            )
        ]
        indexes = [models.Index(fields=["instance", "tier", "last_access"])]

    def __str__(self) -> str:
        return f"{bytes(self.block_key).hex()[:16]}… at {self.instance} ({self.tier})"

    @property
    def ids(self) -> tuple[bytes, bytes, bytes]:
        return bytes(self.compat_id), bytes(self.scope_id), bytes(self.block_key)

    @property
    def block_key_hex(self) -> str:
        return bytes(self.block_key).hex()

    @property
    def layer_digest_list(self) -> list[bytes]:
        octets = bytes(self.layer_digests)
        return [octets[i : i + 32] for i in range(0, len(octets), 32)]


class Lease(models.Model):
    """A lease (6.6): while it is valid the node does not evict the leased blocks."""

    lease = models.CharField(max_length=64, unique=True)
    instance = models.CharField(max_length=100)
    principal = models.ForeignKey(
        "index.Principal", on_delete=models.CASCADE, related_name="node_leases"
    )
    compat_id = models.BinaryField(max_length=32)
    scope_id = models.BinaryField(max_length=16)
    # The 32-octet keys as requested, concatenated; ``blocks`` links the rows they named.
    block_keys = models.BinaryField()
    blocks = models.ManyToManyField(StoredBlock, related_name="leases", blank=True)
    octets = models.PositiveBigIntegerField()
    ttl_ms = models.PositiveBigIntegerField()
    expires_at = models.DateTimeField(db_index=True)
    created_at = models.DateTimeField()
    renewed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["instance", "principal", "expires_at"])]

    def __str__(self) -> str:
        return f"lease {self.lease} at {self.instance}"

    @property
    def block_key_list(self) -> list[str]:
        octets = bytes(self.block_keys)
        return [octets[i : i + 32].hex() for i in range(0, len(octets), 32)]


DirectiveState = choices_of(states.DirectiveState)


class Directive(models.Model):
    """A prefetch directive received (6.5): a row first, then a task on the instance's queue.

    ``loaded`` lists the keys the node holds, in the directive's prefix order; state changes
    follow ``kvsp.states.DIRECTIVE_STATES``.
    """

    instance = models.CharField(max_length=100)
    directive = models.UUIDField()
    request_ref = models.CharField(max_length=1024, blank=True, default="")
    compat_id = models.BinaryField(max_length=32)
    scope_id = models.BinaryField(max_length=16)
    body = models.JSONField()
    state = models.CharField(
        max_length=16, choices=DirectiveState.choices, default=DirectiveState.PENDING
    )
    loaded = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True, default="")
    received_at = models.DateTimeField()
    deadline_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["instance", "directive"], name="node_directive")
        ]
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.directive} at {self.instance} ({self.state})"


class PendingWithdrawal(models.Model):
    """A replica this node no longer holds whose record the IS may still list (6.1): written
    when the withdrawal could not be delivered, retried by the node until it is."""

    instance = models.CharField(max_length=100)
    compat_id = models.BinaryField(max_length=32)
    scope_id = models.BinaryField(max_length=16)
    block_key = models.BinaryField(max_length=32)
    reason = models.TextField(blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "compat_id", "scope_id", "block_key"],
                name="pending_withdrawal",
            )
        ]

    def __str__(self) -> str:
        return f"withdraw {bytes(self.block_key).hex()[:16]}… for {self.instance}"


class MeasuredLink(models.Model):
    """The node's link to a holder it fetched from (6.3 "links"), as measured by its prefetches:
    ``rtt_us`` from the time a block GET takes to its response's head, ``mbit_per_s`` from the
    octets after it, both smoothed."""

    instance = models.CharField(max_length=100)
    holder = models.CharField(max_length=2048)
    mbit_per_s = models.FloatField()
    rtt_us = models.FloatField()
    samples = models.PositiveIntegerField(default=0)
    measured_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["instance", "holder"], name="measured_link")]

    def __str__(self) -> str:
        return f"{self.instance} → {self.holder}"


class SessionKind(models.TextChoices):
    GENERATE = "generate"  # POST generate: a new session, epoch 1
    RESUME = "resume"  # POST sessions/{id}/resume from the PC (6.8)


# Transitions follow ``kvsp.states.SERVED_SESSION_STATES``.
ServedSessionState = choices_of(states.ServedSessionState)


class ServedSession(models.Model):
    """A session this instance serves under one session epoch (6.8): a row first, then a task
    on the instance's queue. The worker writes its progress back at every checkpoint.

    ``output_offset`` is the first output index this epoch labels; ``produced`` counts the
    session's output tokens sampled so far (from index 0), ``released`` those posted to the
    front end, ``checkpoint_offset`` the offset the PC last acknowledged.
    """

    instance = models.CharField(max_length=100)
    session = models.UUIDField()
    epoch = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=16, choices=SessionKind.choices)
    scope_id = models.BinaryField(max_length=16)
    compat_id = models.BinaryField(max_length=32)
    request_ref = models.CharField(max_length=1024, blank=True, default="")
    body = models.JSONField()
    state = models.CharField(
        max_length=16, choices=ServedSessionState.choices, default=ServedSessionState.ACCEPTED
    )
    reason = models.TextField(blank=True, default="")
    # The prefetch directive a resume loads its blocks with, when it lists any.
    directive = models.ForeignKey(
        Directive, null=True, blank=True, on_delete=models.SET_NULL, related_name="sessions"
    )
    # The incarnation (node epoch, 6.3) whose worker ran it.
    node_epoch = models.BigIntegerField(default=0)
    output_offset = models.PositiveIntegerField(default=0)
    produced = models.PositiveIntegerField(default=0)
    released = models.PositiveIntegerField(default=0)
    checkpoint_offset = models.PositiveIntegerField(default=0)
    checkpoints = models.PositiveIntegerField(default=0)
    loaded_blocks = models.PositiveIntegerField(default=0)
    recomputed_tokens = models.PositiveIntegerField(default=0)
    published_blocks = models.PositiveIntegerField(default=0)
    # Where the time to the first output token went, step by step (``SessionRun``).
    timings_us = models.JSONField(default=dict, blank=True)
    received_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "session", "epoch"], name="served_session_epoch"
            )
        ]
        # A session's page reads its requests across instances, by epoch.
        indexes = [
            models.Index(fields=["instance", "state"]),
            models.Index(fields=["session", "epoch"]),
        ]
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.session} epoch {self.epoch} at {self.instance} ({self.state})"


# Transitions follow ``kvsp.states.RESHARD_PHASES``.
MovePhase = choices_of(states.ReshardPhase)


class ReshardMove(models.Model):
    """This node's part in one move of a Shard Map from version ``from_version`` to
    ``to_version`` (6.9): the plan it received, what it fetched for it, the PC's decision, and
    the blocks it still owes a release. A row first, so that a restarted node answers a
    repeated commit or abort as it did before.

    A commit or abort for a move whose plan never arrived here is recorded too (``plan`` null,
    nothing fetched), so that the opposite decision arriving later is refused like any other.
    ``fetch_keys`` are the Block Keys of the plan's fetch ranges, ``release_keys`` those of its
    release ranges, hex; ``owed_release`` the ones still held after the commit because a lease
    covered them.

    After an abort the PC may try the same move again: each try is a row, ``attempt`` the
    number the PC gave it (the plan's extension member ``attempt``; null when it gave none).
    At most one try of a move is not aborted.
    """

    instance = models.CharField(max_length=100)
    map = models.CharField(max_length=128)
    from_version = models.PositiveBigIntegerField(null=True, blank=True)
    to_version = models.PositiveBigIntegerField()
    attempt = models.PositiveBigIntegerField(null=True, blank=True)
    phase = models.CharField(max_length=16, choices=MovePhase.choices, default=MovePhase.PREPARING)
    # The plan as received, normalized (kvsp.records.ReshardPlan JSON and its block members).
    plan = models.JSONField(null=True, blank=True)
    compat_id = models.BinaryField(max_length=32, null=True, blank=True)
    scope_id = models.BinaryField(max_length=16, null=True, blank=True)
    fetch_keys = models.JSONField(default=list, blank=True)
    release_keys = models.JSONField(default=list, blank=True)
    owed_release = models.JSONField(default=list, blank=True)
    # Loading stops here; a repeated plan that finds loading failed or stopped sets it anew.
    deadline_at = models.DateTimeField(null=True, blank=True)
    loaded_at = models.DateTimeField(null=True, blank=True)
    load_error = models.TextField(blank=True, default="")
    fetched_blocks = models.PositiveIntegerField(default=0)
    fetched_octets = models.PositiveBigIntegerField(default=0)
    released_blocks = models.PositiveIntegerField(default=0)
    received_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    # When nothing is left to do: discarded (abort), or every release done (commit).
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["instance", "map", "to_version"],
                condition=~models.Q(phase="aborted"),
                name="node_live_reshard_move",
            ),
            models.UniqueConstraint(
                fields=["instance", "map", "to_version", "attempt"], name="node_reshard_attempt"
            ),
        ]
        indexes = [models.Index(fields=["instance", "phase"])]
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.map} -> v{self.to_version} at {self.instance} ({self.phase})"

    @property
    def notice_channel(self) -> str:
        """The Postgres channel on which a plan's request waits for this move's loading."""
        return self.channel_of(self.pk)

    @staticmethod
    def channel_of(move_id: int) -> str:
        return f"kvsp_reshard_move_{move_id}"
