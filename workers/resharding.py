"""Resharding on a node (spec 6.9, DESIGN.md section 3): POST reshard with a plan, a commit or
an abort, from the Placement Controller.

Which blocks a plan means. Block i of a context covers tokens [i*B, (i+1)*B) and is named by its
Block Key (4.2), which depends on the whole prefix: token offsets alone do not say which blocks
a range is. A plan from this implementation's PC therefore carries extension members (4.4:
peers that do not know them ignore them), taken from its Shard Map's ``context``::

    "scope_id": "<hex16>", "compat_id": "<hex32>", "block_tokens": B,
    "blocks": {"<block index>": "<hex32>", ...}

with the key of every block its retain, fetch and release ranges cover. Every range then starts
and ends on a block boundary. A plan with fetch or release ranges and without these members is
refused (422): the node could not tell which blocks to load or let go.

The phases of a move are ``kvsp.states.RESHARD_PHASES``; each move is a row
(``workers.models.ReshardMove``), so a restarted node answers as before:

- plan: the row, then a task on the instance's queue loads every fetch range from its ``from``
  member (a lease there, retrieval verified against that holder's Replica Record at the IS,
  as for a prefetch) into the tier store, pending for the move: kept and never evicted, but not
  published, served or leased. The request is answered 200 once everything is loaded, or with
  a problem when loading fails or ``deadline_ms`` passes (the PC counts both as no
  acknowledgement). Retained ranges are not looked at: their blocks stay where they are, and
  none of their octets is read, copied or sent. A repeated plan is the same move: answered at
  once when loaded, loaded again when loading had failed or stopped.
- commit: the pending blocks become held and are published as replicas; then the release
  ranges are released, each block withdrawn and evicted, except one a lease covers, which is
  released when its lease ends. A commit for a move this node has no plan of (its plan never
  arrived) is recorded and answered 200: there is nothing to do.
- abort: the pending blocks are discarded (they were never published) and nothing is
  released. An abort for a move without a plan here is recorded and answered 200, as above.

Commit and abort are idempotent; the opposite one after either is refused with
``kvsp-invalid-state`` (409) and changes nothing.

Tries. After an abort, version v is still authoritative and the PC may try the same move again:
a plan after an abort is a new try, a row of its own. This implementation's PC numbers its tries
with the extension member ``"attempt"`` in every plan, commit and abort, since the abort of one
try may reach a member after the plan of the next (the PC repeats it until each member has
heard it). A message with a number is about the try of that number: a plan or commit of an
older try than the latest here is refused (409 ``kvsp-invalid-state``), and an abort of one
changes nothing. A try still preparing when the plan or decision of a later one arrives is
aborted; what it fetched and the later try wants passes to that one. Messages without a number
are about the latest try.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from common.tasks import enqueue, instance_queue
from kvsp.hexids import is_hex
from kvsp.problems import ProtocolError
from kvsp.records import (
    DEFAULT_LIMITS,
    MAX_DEADLINE_MS,
    UINT32_MAX,
    InvalidRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardMoveAnswer,
    ReshardPlan,
    TokenRange,
)
from workers import admission, fetch, loader, notices, reshard_moves
from workers.models import MovePhase, ReshardMove, StoredBlock

log = logging.getLogger(__name__)

# The lease a member takes at a source: long enough for any plan's deadline to pass first.
LEASE_MS = 30_000
_BLOCK_MEMBERS = ("scope_id", "compat_id", "block_tokens", "blocks")


# --- The blocks a plan means ---------------------------------------------------------------------


@dataclass(frozen=True)
class PlanBlocks:
    """A plan's block members (see the module docstring), validated against its ranges."""

    scope_id: str
    compat_id: str
    block_tokens: int
    blocks: dict[int, str]

    @classmethod
    def of(cls, plan: ReshardPlan, body: dict) -> PlanBlocks | None:
        """The members of ``body`` (the plan as received), or None when it has none."""
        if all(body.get(name) is None for name in _BLOCK_MEMBERS):
            if plan.fetch or plan.release:
                raise InvalidRecord(
                    ("blocks",),
                    "a plan with fetch or release ranges needs the Block Keys of their blocks: "
                    "the members scope_id, compat_id, block_tokens and blocks (from the Shard "
                    "Map's context)",
                )
            return None
        scope_id, compat_id = body.get("scope_id"), body.get("compat_id")
        if not is_hex(scope_id, 16):
            raise InvalidRecord(("scope_id",), "must be hex16: 32 lowercase hex digits")
        if not is_hex(compat_id, 32):
            raise InvalidRecord(("compat_id",), "must be hex32: 64 lowercase hex digits")
        block_tokens = body.get("block_tokens")
        if type(block_tokens) is not int or not 1 <= block_tokens <= UINT32_MAX:
            raise InvalidRecord(("block_tokens",), f"must be an integer from 1 to {UINT32_MAX}")
        members = body.get("blocks")
        limit = DEFAULT_LIMITS.max_block_keys
        if not isinstance(members, dict) or len(members) > limit:
            raise InvalidRecord(
                ("blocks",), f"must be an object of at most {limit} block index: Block Key pairs"
            )
        blocks = {}
        for name, key in members.items():
            if not (name.isascii() and name.isdigit() and str(int(name)) == name):
                raise InvalidRecord(("blocks", name), "must be named by a block index in decimal")
            if not is_hex(key, 32):
                raise InvalidRecord(("blocks", name), "must be hex32: 64 lowercase hex digits")
            blocks[int(name)] = key
        found = cls(scope_id, compat_id, block_tokens, blocks)
        found._check(plan)
        return found

    def _check(self, plan: ReshardPlan) -> None:
        named = [("retain", index, tokens) for index, tokens in enumerate(plan.retain)]
        named += [("fetch", index, fetch.tokens) for index, fetch in enumerate(plan.fetch)]
        named += [("release", index, tokens) for index, tokens in enumerate(plan.release)]
        for member, index, (start, end) in named:
            path = (member, index, "tokens") if member == "fetch" else (member, index)
            if start % self.block_tokens or end % self.block_tokens:
                raise InvalidRecord(
                    path, f"must start and end on a block boundary ({self.block_tokens} tokens)"
                )
            if member == "retain":
                continue  # retained blocks stay as they are: the node needs no key of them
            missing = next((i for i in self.indexes([(start, end)]) if i not in self.blocks), None)
            if missing is not None:
                raise InvalidRecord(path, f"covers block {missing}, which blocks does not name")

    def indexes(self, ranges: Iterable[TokenRange]) -> Iterator[int]:
        for start, end in ranges:
            yield from range(start // self.block_tokens, end // self.block_tokens)

    def keys(self, ranges: Iterable[TokenRange]) -> tuple[bytes, ...]:
        """The keys ``blocks`` names within ``ranges``. A retained range may span far more
        blocks than the plan names (nothing needs their keys), so a range wider than the named
        blocks is matched against them rather than walked."""
        found = []
        for start, end in ranges:
            first, end_block = start // self.block_tokens, end // self.block_tokens
            if end_block - first > len(self.blocks):
                indexes = (i for i in sorted(self.blocks) if first <= i < end_block)
            else:
                indexes = (i for i in range(first, end_block) if i in self.blocks)
            found.extend(bytes.fromhex(self.blocks[index]) for index in indexes)
        return tuple(found)

    def to_json(self) -> dict:
        return {
            "scope_id": self.scope_id,
            "compat_id": self.compat_id,
            "block_tokens": self.block_tokens,
            "blocks": {str(index): key for index, key in sorted(self.blocks.items())},
        }


def _move_blocks(plan: ReshardPlan, blocks: PlanBlocks) -> reshard_moves.MoveBlocks:
    return reshard_moves.MoveBlocks(
        compat_id=bytes.fromhex(blocks.compat_id),
        scope_id=bytes.fromhex(blocks.scope_id),
        fetch=blocks.keys(fetch.tokens for fetch in plan.fetch),
        retain=blocks.keys(plan.retain),
        release=blocks.keys(plan.release),
    )


def move_answer(move: ReshardMove) -> ReshardMoveAnswer:
    """The answer to POST reshard: the move as this node sees it."""
    return ReshardMoveAnswer(
        map=move.map,
        from_version=move.from_version,
        to_version=move.to_version,
        attempt=move.attempt,
        state=move.phase,
        loaded=move.loaded_at is not None,
        fetched_blocks=move.fetched_blocks,
        fetched_octets=move.fetched_octets,
        released_blocks=move.released_blocks,
        owed_release=len(move.owed_release),
    )


# --- POST reshard ---------------------------------------------------------------------------------


def do_prepare(plan: ReshardPlan, body: dict) -> ReshardMove:
    """A plan (6.9): record it, have its fetch ranges loaded, and return once they are. Raises
    a problem when loading fails or does not finish within ``deadline_ms``."""
    from workers.tasks import load_reshard

    if plan.instance is not None and plan.instance != settings.KVSP_PUBLIC_URL:
        raise InvalidRecord(
            ("instance",), f"the plan is for {plan.instance}, not for this instance"
        )
    if plan.deadline_ms > MAX_DEADLINE_MS:
        raise InvalidRecord(("deadline_ms",), f"must be an integer from 1 to {MAX_DEADLINE_MS}")
    blocks = PlanBlocks.of(plan, body)
    document = plan.to_json()
    if blocks is not None:
        document.update(blocks.to_json())
    move, load = reshard_moves.do_receive_plan(
        plan.map,
        plan.from_version,
        plan.to_version,
        document,
        None if blocks is None else _move_blocks(plan, blocks),
        plan.deadline_ms,
        attempt_of(body),
    )
    if load:
        # When the broker cannot take it now, the deadline passes unacknowledged: the PC aborts,
        # or a repeated plan sends it again.
        enqueue(load_reshard, move.pk, queue=instance_queue(move.instance))
    return _wait_loaded(move, plan.deadline_ms)


def _wait_loaded(move: ReshardMove, deadline_ms: int) -> ReshardMove:
    """``move`` once its fetch ranges are loaded, woken by the worker as loading ends or the
    move is decided (``notices.announce``); a problem when it fails or the deadline passes."""

    def settled() -> bool:
        move.refresh_from_db()
        return (
            move.phase != MovePhase.PREPARING or move.loaded_at is not None or bool(move.load_error)
        )

    notices.wait_across(move.notice_channel, settled, deadline_ms / 1000)
    if move.phase != MovePhase.PREPARING:
        raise ProtocolError(
            "kvsp-invalid-state",
            f"the move of {move.map} to version {move.to_version} was {move.phase} while "
            "its fetch ranges loaded",
        )
    if move.loaded_at is not None:
        return move
    if move.load_error:
        raise ProtocolError(
            "kvsp-upstream-error", f"the fetch ranges could not be loaded: {move.load_error}"
        )
    raise ProtocolError(
        "kvsp-unavailable",
        f"the fetch ranges were not loaded within deadline_ms ({deadline_ms} ms): "
        f"{move.fetched_blocks} of {len(move.fetch_keys)} blocks so far",
    )


def do_decide(decision: ReshardCommit | ReshardAbort, body: dict) -> ReshardMove:
    """A commit or an abort (6.9); ``body`` is the decision as received."""
    if isinstance(decision, ReshardCommit):
        return reshard_moves.do_commit_move(decision.map, decision.commit, attempt_of(body))
    return reshard_moves.do_abort_move(decision.map, decision.abort, attempt_of(body))


def attempt_of(body: dict) -> int | None:
    """The extension member ``attempt`` of a plan, commit or abort: which of the PC's tries of
    the move the message is about (None when it does not say)."""
    attempt = body.get("attempt")
    if attempt is None:
        return None
    if type(attempt) is not int or not 1 <= attempt <= UINT32_MAX:
        raise InvalidRecord(("attempt",), f"must be an integer from 1 to {UINT32_MAX}")
    return attempt


# --- Loading the fetch ranges, on the instance's worker ------------------------------------------

_loading: set[int] = set()
_loading_lock = threading.Lock()


@contextmanager
def _claim(move_pk: int):
    """Whether this thread may load the move: one run at a time per move in the worker (the
    only process that loads for the instance), so a repeated plan never loads a block twice."""
    with _loading_lock:
        mine = move_pk not in _loading
        _loading.add(move_pk)
    try:
        yield mine
    finally:
        if mine:
            with _loading_lock:
                _loading.discard(move_pk)


def load(move_pk: int) -> str:
    """Load a preparing move's fetch ranges; what the move's loading came to."""
    with _claim(move_pk) as mine:
        if not mine:
            return "loading"
        move = ReshardMove.objects.filter(pk=move_pk).first()
        if move is None:
            return "gone"
        if move.phase != MovePhase.PREPARING:
            return move.phase
        if move.loaded_at is not None:
            return "loaded"
        try:
            error = MoveLoad(move).run()
        except Exception:
            log.exception("reshard %s: loading failed", move)
            error = "the instance failed while loading"
        reshard_moves.do_finish_loading(move_pk, error or "")
        return error or "loaded"


class MoveLoad:
    """One run of loading a move's fetch ranges through the node's loader (``workers.loader``):
    the blocks not held yet, from their sources, pending for the move; the first failure stops
    the rest."""

    def __init__(self, move: ReshardMove):
        self.move = move
        self.plan = ReshardPlan.from_json(move.plan)
        self.blocks = PlanBlocks.of(self.plan, move.plan)
        self.compat_id = bytes(move.compat_id)
        self.scope_id = bytes(move.scope_id)
        remaining_s = (move.deadline_at - timezone.now()).total_seconds()
        self.deadline = time.monotonic() + remaining_s

    def run(self) -> str | None:
        """None when every fetch range is loaded, else why not."""
        wanted = [
            (item.source, key)
            for item in self.plan.fetch
            for key in self.blocks.keys([item.tokens])
        ]
        have = {
            bytes(key)
            for key in StoredBlock.objects.filter(
                Q(pending_move__isnull=True) | Q(pending_move=self.move),
                instance=self.move.instance,
                compat_id=self.compat_id,
                scope_id=self.scope_id,
                block_key__in=[key for _, key in wanted],
            ).values_list("block_key", flat=True)
        }
        by_source: dict[str, list[bytes]] = {}
        for source, key in wanted:
            if key not in have:
                by_source.setdefault(source, []).append(key)
        if not by_source:
            return None
        # Taken from the sources in turn, so that every source sends at once (6.4 prices the
        # load as the slowest source's, not as the sum over sources).
        columns = list(by_source.items())
        missing = [
            (source, keys[index])
            for index in range(max(len(keys) for _, keys in columns))
            for source, keys in columns
            if index < len(keys)
        ]
        run = loader.Loader(
            self.move.instance,
            self.compat_id,
            self.scope_id,
            [
                loader.Wanted(index, key.hex(), (source,))
                for index, (source, key) in enumerate(missing)
            ],
            deadline=self.deadline,
            lease_ms=LEASE_MS,
            label=f"reshard {self.move}",
            pending_move_id=self.move.pk,
            check=self._check,
        ).run()
        if run.decided:
            return "the move was decided while it loaded"
        if run.deadline_hit:
            return f"the deadline of {self.plan.deadline_ms} ms passed while its blocks loaded"
        if run.failure is not None:
            [(source, reason)] = run.failure.reasons or [("its source", "not loaded")]
            return f"block {run.failure.block_key} from {source}: {reason}"
        return None

    def _check(self, fetched: fetch.FetchedBlock) -> None:
        if fetched.container.token_count != self.blocks.block_tokens:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"{fetched.container.token_count} tokens, the plan's blocks hold "
                f"{self.blocks.block_tokens}",
            )
        admission.check_container(fetched.container, self.compat_id)
