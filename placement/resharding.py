"""Resharding of sequence-sharded caches (spec 6.9), coordinated by the PC as a two-phase commit.

Prepare: every member of either version gets its plan with POST reshard and acknowledges with
200 once it has loaded its ``fetch`` ranges. Version v stays authoritative until all have
acknowledged within ``deadline_ms``; then the PC commits (the map moves to v+1 in the same
transaction that records the decision) and tells every member. If any member misses the
deadline, the PC aborts and the members discard what they fetched. The decision is a row before
it is a message, and telling members is retried until each has heard it, so a PC that crashes
at any point resumes the operation from its row (``drive``).

After an abort version v is still authoritative, and POST reshard may try the move to v+1
again: every try is an operation of its own, numbered by ``attempt``. Plans, commits and aborts
carry the number as the extension member ``"attempt"`` (4.4: peers ignore members they do not
know), because an abort of the earlier try may still be on its way to a member (it is retried
until each has heard it) when the plan of the next one arrives: by the number, the member
knows that abort is not about the move it is preparing now.

A Shard Map may carry the context it splits as an extension member (``ShardContext``; 4.4:
peers ignore members they do not know). With it, every plan also says which blocks its ranges
are: a member cannot derive Block Keys from token offsets (4.2), and needs no other lookup.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from common.api import require_object
from common.peers import PeerUnreachable, call, peer_client
from common.tasks import enqueue
from index.models import CompatDescriptor
from kvsp import records, sharding
from kvsp.hexids import is_hex
from kvsp.problems import ProtocolError
from kvsp.records import DEFAULT_LIMITS, UINT32_MAX, InvalidRecord, ReshardPlan
from kvsp.states import RESHARD_PHASES, ReshardEvent
from placement.models import ReshardOperation, ReshardPhase, ShardMap

log = logging.getLogger(__name__)


def _record(row: ShardMap) -> records.ShardMap:
    return records.ShardMap.from_json(row.document())


# --- The context of a Shard Map ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardContext:
    """The context a Shard Map splits, as its extension member ``context``::

        "context": {"scope_id": "<hex16>", "compat_id": "<hex32>", "block_tokens": B,
                    "block_keys": ["<hex32>", ...]}

    ``block_keys`` are the Block Keys of the context's complete blocks in order: block i covers
    tokens [i*B, (i+1)*B). A key names its whole prefix (4.2), so the keys of a token range
    cannot be derived from its offsets; the map carries them once, and each plan carries the
    ones its member needs (``plan_members``). With a context, every shard starts and ends on a
    block boundary within the keyed blocks: only complete blocks have keys, and a range that
    splits a block would leave half of it to no member.
    """

    scope_id: str
    compat_id: str
    block_tokens: int
    block_keys: tuple[str, ...]

    @classmethod
    def from_json(cls, value: object, path: tuple = ("context",)) -> ShardContext:
        if not isinstance(value, dict):
            raise InvalidRecord(path, "must be an object")
        scope_id, compat_id = value.get("scope_id"), value.get("compat_id")
        if not is_hex(scope_id, 16):
            raise InvalidRecord((*path, "scope_id"), "must be hex16: 32 lowercase hex digits")
        if not is_hex(compat_id, 32):
            raise InvalidRecord((*path, "compat_id"), "must be hex32: 64 lowercase hex digits")
        block_tokens = value.get("block_tokens")
        if type(block_tokens) is not int or not 1 <= block_tokens <= UINT32_MAX:
            raise InvalidRecord(
                (*path, "block_tokens"), f"must be an integer from 1 to {UINT32_MAX}"
            )
        keys = value.get("block_keys")
        limit = DEFAULT_LIMITS.max_block_keys
        if not isinstance(keys, list) or not 1 <= len(keys) <= limit:
            raise InvalidRecord(
                (*path, "block_keys"), f"must be an array of 1 to {limit} Block Keys"
            )
        for index, key in enumerate(keys):
            if not is_hex(key, 32):
                raise InvalidRecord(
                    (*path, "block_keys", index), "must be hex32: 64 lowercase hex digits"
                )
        return cls(scope_id, compat_id, block_tokens, tuple(keys))

    def to_json(self) -> dict[str, Any]:
        return {
            "scope_id": self.scope_id,
            "compat_id": self.compat_id,
            "block_tokens": self.block_tokens,
            "block_keys": list(self.block_keys),
        }

    @property
    def keyed_tokens(self) -> int:
        """How many tokens the keyed blocks cover, from token 0."""
        return len(self.block_keys) * self.block_tokens

    def check_shards(self, record: records.ShardMap, path: tuple = ("shards",)) -> None:
        """Every shard on block boundaries and within the keyed blocks."""
        size = self.block_tokens
        for index, shard in enumerate(record.shards):
            start, end = shard.tokens
            if start % size or end % size:
                raise InvalidRecord(
                    (*path, index, "tokens"),
                    f"must start and end on a block boundary (a multiple of "
                    f"context.block_tokens, {size})",
                )
            if end > self.keyed_tokens:
                raise InvalidRecord(
                    (*path, index, "tokens"),
                    f"ends at token {end}, past the {self.keyed_tokens} tokens of the "
                    "context's keyed blocks",
                )

    def check_registered(self) -> None:
        """A block size that the registered descriptor of the Compatibility ID contradicts is
        refused; an unregistered id is taken as it is (the IS need not know every model)."""
        registered = (
            CompatDescriptor.objects.filter(compat_id=bytes.fromhex(self.compat_id))
            .values_list("block_tokens", flat=True)
            .first()
        )
        if registered is not None and registered != self.block_tokens:
            raise InvalidRecord(
                ("context", "block_tokens"),
                f"is {self.block_tokens}; the registered descriptor of compat_id says {registered}",
            )

    def extends(self, earlier: ShardContext) -> bool:
        """The same context, possibly with more blocks (decoding completed some since)."""
        return (self.scope_id, self.compat_id, self.block_tokens) == (
            earlier.scope_id,
            earlier.compat_id,
            earlier.block_tokens,
        ) and self.block_keys[: len(earlier.block_keys)] == earlier.block_keys

    def plan_members(self, plan: ReshardPlan) -> dict[str, Any]:
        """The extension members of ``plan``: the context's identity and ``blocks``, the key of
        every block its retain, fetch and release ranges cover, by block index (a JSON object
        whose names are the indexes in decimal)."""
        ranges = [*plan.retain, *(fetch.tokens for fetch in plan.fetch), *plan.release]
        indexes = sorted(
            index
            for start, end in ranges
            for index in range(start // self.block_tokens, end // self.block_tokens)
        )
        return {
            "scope_id": self.scope_id,
            "compat_id": self.compat_id,
            "block_tokens": self.block_tokens,
            "blocks": {str(index): self.block_keys[index] for index in indexes},
        }


def _context_of(row: ShardMap) -> ShardContext | None:
    return None if row.context is None else ShardContext.from_json(row.context)


def _checked_context(value: object, *maps: records.ShardMap) -> ShardContext | None:
    """The context a request gives (None when it gives none), checked against the shards of
    ``maps`` and against the registered descriptor."""
    if value is None:
        return None
    context = ShardContext.from_json(value)
    for shard_map in maps:
        context.check_shards(shard_map)
    context.check_registered()
    return context


def do_put_shard_map(map_id: str, body: object) -> tuple[ShardMap, bool]:
    """Create a Shard Map, or set it anew while no reshard of it is under way.

    A version at or below the current one must be the same document (an idempotent repeat);
    moving between versions is what POST reshard is for, so this only sets a map directly when
    nothing is in flight (an operator taking over a group).
    """
    record = records.ShardMap.from_json(body)
    if record.map != map_id:
        raise ProtocolError("kvsp-malformed-request", "map in the body differs from the path")
    context = _checked_context(body.get("context"), record)
    document = record.to_json()
    if context is not None:
        document["context"] = context.to_json()
    with transaction.atomic():
        row = ShardMap.objects.select_for_update().filter(map=map_id).first()
        if row is None:
            try:
                with transaction.atomic():
                    row = ShardMap.objects.create(
                        map=map_id,
                        version=record.version,
                        shards=document["shards"],
                        context=document.get("context"),
                    )
                return row, True
            except IntegrityError:
                row = ShardMap.objects.select_for_update().get(map=map_id)
        if record.version <= row.version:
            if row.document() == document:
                return row, False
            raise ProtocolError(
                "kvsp-conflict", f"version {record.version} of {map_id} differs from what is stored"
            )
        if row.operations.filter(phase=ReshardPhase.PREPARING).exists():
            raise ProtocolError("kvsp-conflict", f"a reshard of {map_id} is under way")
        row.version, row.shards = record.version, document["shards"]
        row.context = document.get("context")
        row.save()
    return row, False


def do_start_reshard(map_id: str, body: object) -> ReshardOperation:
    """POST shardmaps/{map}/reshard: plan the move to the next version and start preparing.

    The body may carry a ``context`` for version v+1 that extends the map's (the same context
    with more complete blocks); without one, v+1 has the map's context.
    """
    asked = records.ReshardRequest.from_json(require_object(body))
    now = timezone.now()
    with transaction.atomic():
        row = ShardMap.objects.select_for_update().filter(map=map_id).first()
        if row is None:
            raise ProtocolError("kvsp-not-found", f"no shard map {map_id!r}")
        if row.operations.filter(phase=ReshardPhase.PREPARING).exists():
            raise ProtocolError("kvsp-conflict", f"a reshard of {map_id} is under way")
        current = _record(row)
        following = records.ShardMap(map=map_id, version=current.version + 1, shards=asked.shards)
        context = _context_of(row)
        if body.get("context") is not None:
            given = _checked_context(body["context"], current, following)
            if context is not None and not given.extends(context):
                raise InvalidRecord(
                    ("context",),
                    "must extend the map's context: the same scope_id, compat_id and "
                    "block_tokens, with the map's block_keys first",
                )
            context = given
        elif context is not None:
            context.check_shards(following)
        plans = sharding.plan_reshard(current, following.shards, asked.deadline_ms)
        # Earlier attempts at this version were all aborted (none is preparing, and a commit
        # would have moved the map past it): this one is numbered after them.
        attempt = 1 + max(
            row.operations.filter(to_version=following.version).values_list("attempt", flat=True),
            default=0,
        )
        operation = ReshardOperation.objects.create(
            shard_map=row,
            from_version=current.version,
            to_version=following.version,
            attempt=attempt,
            next_shards=following.to_json()["shards"],
            next_context=None if context is None else context.to_json(),
            deadline_ms=asked.deadline_ms,
            plans=[
                {
                    **plan.to_json(),
                    **({} if context is None else context.plan_members(plan)),
                    "attempt": attempt,
                }
                for plan in plans
            ],
            started_at=now,
            deadline_at=now + timedelta(milliseconds=asked.deadline_ms),
        )
        transaction.on_commit(lambda: _drive_later(operation.pk))
    return operation


def _drive_later(operation_id: int) -> None:
    from placement.tasks import drive_reshard

    enqueue(drive_reshard, operation_id)


def _decide(operation_id: int, event: ReshardEvent, reason: str = "") -> ReshardOperation:
    """Record the outcome once; commit also moves the map to v+1 in the same transaction."""
    now = timezone.now()
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        phase = RESHARD_PHASES.next_state(operation.phase, event)
        if phase == operation.phase:
            return operation  # a repeated decision: harmless
        if event is ReshardEvent.COMMIT:
            moved = ShardMap.objects.filter(
                pk=operation.shard_map_id, version=operation.from_version
            ).update(
                version=operation.to_version,
                shards=operation.next_shards,
                context=operation.next_context,
            )
            if not moved:
                raise ProtocolError("kvsp-conflict", "the map moved on during the reshard")
        operation.phase, operation.decided_at = phase, now
        operation.reason = reason
        operation.save()
        log.info("reshard %s: %s (%s)", operation, phase, reason or "all acknowledged")
        return operation


def do_abort_reshard(operation_id: int, reason: str = "aborted by an operator") -> ReshardOperation:
    """An operator's abort of a reshard still preparing; members are told by the driver."""
    operation = _decide(operation_id, ReshardEvent.ABORT, reason)
    transaction.on_commit(lambda: _drive_later(operation_id))
    return operation


def _acknowledge(operation_id: int, member: str) -> None:
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        if member not in operation.acknowledged:
            operation.acknowledged = [*operation.acknowledged, member]
            operation.save(update_fields=["acknowledged"])


def _inform(operation_id: int, member: str) -> None:
    with transaction.atomic():
        operation = ReshardOperation.objects.select_for_update().get(pk=operation_id)
        if member not in operation.informed:
            operation.informed = [*operation.informed, member]
            if set(operation.informed) >= set(operation.members):
                operation.finished_at = timezone.now()
            operation.save(update_fields=["informed", "finished_at"])


def _prepare(operation: ReshardOperation) -> None:
    """Send every plan not yet acknowledged, all at once, waiting no longer than the deadline."""
    remaining = (operation.deadline_at - timezone.now()).total_seconds()
    pending = [plan for plan in operation.plans if plan["instance"] not in operation.acknowledged]
    if remaining <= 0 or not pending:
        return
    timeout = httpx.Timeout(remaining, connect=min(remaining, 2.0))

    def send(plan: dict) -> None:
        try:
            with peer_client(timeout=timeout) as client:
                response = call(client, "POST", f"{plan['instance']}reshard", json=plan)
            if response.status_code == 200:
                _acknowledge(operation.pk, plan["instance"])
            else:
                log.info(
                    "reshard %s: %s answered %s", operation, plan["instance"], response.status_code
                )
        except PeerUnreachable as error:
            log.info("reshard %s: %s did not acknowledge: %s", operation, plan["instance"], error)
        finally:
            connections.close_all()  # this thread's own connection

    with ThreadPoolExecutor(max_workers=min(len(pending), 16)) as pool:
        list(pool.map(send, pending))


def _tell_outcome(operation: ReshardOperation) -> list[str]:
    """Send commit or abort to each member not yet informed, all at once; the members still
    to tell."""
    decision = "commit" if operation.phase == ReshardPhase.COMMITTED else "abort"
    body = {
        "map": operation.shard_map.map,
        decision: operation.to_version,
        "attempt": operation.attempt,
    }
    members = [member for member in operation.members if member not in operation.informed]
    if not members:
        return []

    def tell(client, member: str) -> bool:
        try:
            response = call(client, "POST", f"{member}reshard", json=body)
            if response.is_success:
                _inform(operation.pk, member)
                return True
            log.info("reshard %s: %s answered %s", operation, member, response.status_code)
        except PeerUnreachable:
            pass
        finally:
            connections.close_all()
        return False

    with peer_client() as client, ThreadPoolExecutor(max_workers=min(len(members), 16)) as pool:
        told = list(pool.map(lambda member: tell(client, member), members))
    return [member for member, done in zip(members, told, strict=True) if not done]


def drive(operation_id: int) -> list[str]:
    """Carry an operation as far as it goes now; returns the members still to be told.

    Safe to run any number of times, from any state: that is what makes a PC crash harmless.
    """
    operation = ReshardOperation.objects.select_related("shard_map").get(pk=operation_id)
    if operation.phase == ReshardPhase.PREPARING:
        _prepare(operation)
        operation.refresh_from_db()
        if operation.phase == ReshardPhase.PREPARING:
            missing = set(operation.members) - set(operation.acknowledged)
            if missing:
                reason = "no acknowledgement within deadline_ms from " + ", ".join(sorted(missing))
                operation = _decide(operation_id, ReshardEvent.ABORT, reason)
            else:
                operation = _decide(operation_id, ReshardEvent.COMMIT)
    operation = ReshardOperation.objects.select_related("shard_map").get(pk=operation_id)
    return _tell_outcome(operation)


def operation_json(operation: ReshardOperation) -> dict:
    """The reshard answer of DESIGN.md section 3."""
    return {
        "map": operation.shard_map.map,
        "from": operation.from_version,
        "to": operation.to_version,
        "attempt": operation.attempt,
        "state": operation.phase,
        "deadline_ms": operation.deadline_ms,
        "plans": operation.plans,
        "acknowledged": operation.acknowledged,
        "informed": operation.informed,
        "reason": operation.reason or None,
    }
