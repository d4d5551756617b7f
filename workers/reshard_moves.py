"""The rows of reshard moves on a node (spec 6.9) and what they do to its tier store, under the
node's lock: a plan recorded (or found recorded), its loading finished, the move committed (the
blocks fetched for it held and published, then its release ranges released) or aborted (what was
fetched discarded). ``workers.resharding`` answers the PC's requests with these and loads the
fetch ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from kvsp.problems import ProtocolError
from kvsp.states import RESHARD_PHASES, ReshardEvent
from workers import notices, selectors, tiers
from workers.eviction import evict_many
from workers.instance import lock_node
from workers.models import MovePhase, ReshardMove, StoredBlock
from workers.replicas import publish_all


def _tries_locked(name: str, map_id: str, to_version: int) -> list[ReshardMove]:
    """The tries of one move at this node, the latest first, locked."""
    return list(
        ReshardMove.objects.select_for_update()
        .filter(instance=name, map=map_id, to_version=to_version)
        .order_by("-pk")
    )


def _try_of(tries: list[ReshardMove], attempt: int | None) -> ReshardMove | None:
    """The try a message is about: the one of its attempt number, or the latest when it gives
    none."""
    if attempt is None:
        return tries[0] if tries else None
    return next((move for move in tries if move.attempt == attempt), None)


def _superseded(attempt: int | None, latest: ReshardMove) -> bool:
    """A message of an attempt older than the latest try here: the PC has moved on from it."""
    return attempt is not None and latest.attempt is not None and attempt < latest.attempt


def _clear_for_new_try(
    tries: list[ReshardMove],
    attempt: int | None,
    map_id: str,
    to_version: int,
    now: datetime,
    *,
    older_ok: bool,
) -> ReshardMove | None:
    """Before another try of a move is recorded here: refused when the latest try is committed,
    or newer than ``attempt`` (unless ``older_ok``: an abort of an older try is recorded as it
    is). A latest try still preparing has been given up by the PC, which sent a later one: it
    is aborted, as its abort (perhaps still on its way) would, and returned, so that the caller
    discards its pending blocks once the later try is recorded and what that one wants passes
    to it."""
    latest = tries[0] if tries else None
    if latest is None:
        return None
    if _superseded(attempt, latest):
        if older_ok:
            return None
        raise _late(map_id, to_version, f"is at attempt {latest.attempt} here; {attempt} is older")
    if latest.phase == MovePhase.COMMITTED:
        raise _late(map_id, to_version, "is committed here")
    if latest.phase == MovePhase.PREPARING:
        latest.phase = RESHARD_PHASES.next_state(latest.phase, ReshardEvent.ABORT)
        latest.decided_at = latest.finished_at = now
        latest.save(update_fields=["phase", "decided_at", "finished_at"])
        notices.announce(latest.notice_channel)
        return latest
    return None


def _late(map_id: str, to_version: int, why: str) -> ProtocolError:
    return ProtocolError(
        "kvsp-invalid-state", f"the move of {map_id} to version {to_version} {why}"
    )


def _decided_move(
    name: str, map_id: str, to_version: int, attempt: int | None, event: ReshardEvent
) -> tuple[ReshardMove, bool]:
    """The try a commit or abort (``event``) is about, locked; True when this node has no plan
    of it and recorded it as decided, with nothing to do, so that the opposite decision
    arriving later is refused as the phases say."""
    tries = _tries_locked(name, map_id, to_version)
    move = _try_of(tries, attempt)
    if move is not None:
        return move, False
    now = timezone.now()
    phase = RESHARD_PHASES.next_state(MovePhase.PREPARING, event)
    stopped = _clear_for_new_try(
        tries, attempt, map_id, to_version, now, older_ok=phase == MovePhase.ABORTED
    )
    move = ReshardMove.objects.create(
        instance=name,
        map=map_id,
        to_version=to_version,
        attempt=attempt,
        phase=phase,
        received_at=now,
        decided_at=now,
        finished_at=now,
    )
    if stopped is not None:
        _discard_pending(name, stopped)
    return move, True


@dataclass(frozen=True)
class MoveBlocks:
    """What a plan asks of this node's tier store, by Block Key: the blocks of its fetch
    ranges, of its retain ranges and of its release ranges."""

    compat_id: bytes
    scope_id: bytes
    fetch: tuple[bytes, ...]
    retain: tuple[bytes, ...]
    release: tuple[bytes, ...]


def do_receive_plan(
    map_id: str,
    from_version: int,
    to_version: int,
    document: dict,
    blocks: MoveBlocks | None,
    deadline_ms: int,
    attempt: int | None = None,
) -> tuple[ReshardMove, bool]:
    """Record a reshard plan (6.9), or find it recorded: a repeat is the same move. True when
    its fetch ranges are to be loaded now: a new plan with something to fetch, or a repeat that
    finds loading failed or stopped (a run still loading finishes alone).

    A plan whose blocks the node already holds is loaded at once. A plan of a try decided
    already, or another plan for the same try, is refused. After an abort, a plan is the PC's
    next try of the move (``attempt`` numbers the tries when the PC gives numbers: a plan of an
    older try than the latest here is refused); a try still preparing when a later one arrives
    is aborted, and the blocks it fetched that the later one wants pass to it.
    """
    name = selectors.node_name()
    now = timezone.now()
    deadline_at = now + timedelta(milliseconds=deadline_ms)
    with transaction.atomic():
        lock_node(name)
        tries = _tries_locked(name, map_id, to_version)
        move = _try_of(tries, attempt)
        if move is not None and attempt is None and move.phase == MovePhase.ABORTED:
            move = None  # a plan after an abort, without a number: the PC's next try
        if move is not None:
            if move.phase != MovePhase.PREPARING:
                raise _late(map_id, to_version, f"is {move.phase} here; its plan comes too late")
            if move.plan != document:
                raise ProtocolError(
                    "kvsp-conflict",
                    f"another plan for the move of {map_id} to version {to_version} was "
                    "received before",
                )
            if move.loaded_at is not None:
                return move, False
            move.deadline_at, move.load_error = deadline_at, ""
            move.save(update_fields=["deadline_at", "load_error"])
            return move, True
        stopped = _clear_for_new_try(tries, attempt, map_id, to_version, now, older_ok=False)
        fetch = blocks.fetch if blocks is not None else ()
        held = (
            selectors.held_keys(name, blocks.compat_id, blocks.scope_id, list(fetch))
            if fetch
            else set()
        )
        move = ReshardMove.objects.create(
            instance=name,
            map=map_id,
            from_version=from_version,
            to_version=to_version,
            attempt=attempt,
            plan=document,
            compat_id=None if blocks is None else blocks.compat_id,
            scope_id=None if blocks is None else blocks.scope_id,
            fetch_keys=[key.hex() for key in fetch],
            release_keys=[] if blocks is None else [key.hex() for key in blocks.release],
            deadline_at=deadline_at,
            loaded_at=now if held >= set(fetch) else None,
            received_at=now,
        )
        if stopped is not None:
            _discard_pending(name, stopped)
        if blocks is not None:
            _keep_wanted(name, map_id, {key.hex() for key in (*blocks.fetch, *blocks.retain)})
    return move, move.loaded_at is None


def _keep_wanted(name: str, map_id: str, wanted: set[str]) -> None:
    """A block an earlier move of the map still owes a release of (a lease held it) that this
    move wants again stays: the release was for a version that is being left."""
    for earlier in ReshardMove.objects.select_for_update().filter(
        instance=name, map=map_id, phase=MovePhase.COMMITTED, finished_at__isnull=True
    ):
        remaining = [key for key in earlier.owed_release if key not in wanted]
        if remaining != earlier.owed_release:
            earlier.owed_release = remaining
            if not remaining:
                earlier.finished_at = timezone.now()
            earlier.save(update_fields=["owed_release", "finished_at"])


def do_finish_loading(move_id: int, error: str = "") -> None:
    """Loading of a preparing move ended: every fetch range loaded, or ``error`` says why not."""
    moves = ReshardMove.objects.filter(
        pk=move_id, phase=MovePhase.PREPARING, loaded_at__isnull=True
    )
    if error:
        moves.update(load_error=error)
    else:
        moves.update(loaded_at=timezone.now(), load_error="")
    notices.announce(ReshardMove.channel_of(move_id))


def do_commit_move(map_id: str, to_version: int, attempt: int | None = None) -> ReshardMove:
    """POST reshard {"map", "commit": v+1} (6.9): the blocks fetched for the move become held
    and are published; then the release ranges are released (``do_release_owed``). A repeated
    commit changes nothing; a commit after an abort is refused (``RESHARD_PHASES``), and so is
    one of an attempt older than the latest try here."""
    name = selectors.node_name()
    with transaction.atomic():
        lock_node(name)
        move, recorded = _decided_move(name, map_id, to_version, attempt, ReshardEvent.COMMIT)
        if recorded:
            return move
        phase = RESHARD_PHASES.next_state(move.phase, ReshardEvent.COMMIT)
        fetched = []
        if move.phase == MovePhase.PREPARING:
            now = timezone.now()
            pending = StoredBlock.objects.filter(pending_move=move)
            fetched = list(pending.values_list("pk", flat=True))
            pending.update(pending_move=None, refresh_due_at=now)
            move.phase, move.decided_at = phase, now
            move.owed_release = list(move.release_keys)
            if not move.owed_release:
                move.finished_at = now
            move.save()
            notices.announce(move.notice_channel)
    # A record that cannot be published now is due at once: the keeper publishes it.
    publish_all(fetched)
    do_release_owed(name, move.pk)
    move.refresh_from_db()
    return move


def do_abort_move(map_id: str, to_version: int, attempt: int | None = None) -> ReshardMove:
    """POST reshard {"map", "abort": v+1} (6.9): what was fetched for the move is discarded,
    nothing is released. A repeated abort changes nothing; an abort after a commit is refused
    (``RESHARD_PHASES``); an abort of an attempt older than the latest try here is about a try
    the PC has given up already, and changes nothing."""
    name = selectors.node_name()
    with transaction.atomic():
        lock_node(name)
        move, recorded = _decided_move(name, map_id, to_version, attempt, ReshardEvent.ABORT)
        if recorded:
            return move
        phase = RESHARD_PHASES.next_state(move.phase, ReshardEvent.ABORT)
        if move.phase == MovePhase.PREPARING:
            _discard_pending(name, move)
            move.phase = phase
            move.decided_at = move.finished_at = timezone.now()
            move.save(update_fields=["phase", "decided_at", "finished_at"])
            notices.announce(move.notice_channel)
    return move


def _discard_pending(name: str, move: ReshardMove) -> None:
    """Forget the blocks pending for ``move``. They were never published, so there is nothing
    to withdraw; a block another move still preparing wants passes to that move instead."""
    wanted = {
        key: other.pk
        for other in ReshardMove.objects.filter(instance=name, phase=MovePhase.PREPARING).exclude(
            pk=move.pk
        )
        for key in other.fetch_keys
    }
    for block in StoredBlock.objects.filter(pending_move=move):
        other = wanted.get(block.block_key_hex)
        if other is not None:
            block.pending_move_id = other
            block.save(update_fields=["pending_move"])
            continue
        path = tiers.stored_path(block)
        block.delete()
        transaction.on_commit(lambda path=path: tiers.unlink_quietly(path), robust=True)


def do_release_owed(name: str, move_id: int | None = None) -> int:
    """Release what committed moves owe (6.9: "instances release the ranges listed in
    release"): each block is withdrawn and evicted, unless a lease covers it (6.6), in which
    case it stays owed until the lease ends. Returns how many blocks were released."""
    moves = ReshardMove.objects.filter(
        instance=name, phase=MovePhase.COMMITTED, finished_at__isnull=True
    )
    if move_id is not None:
        moves = moves.filter(pk=move_id)
    released = 0
    for pk in moves.values_list("pk", flat=True):
        with transaction.atomic():
            lock_node(name)
            move = ReshardMove.objects.select_for_update().get(pk=pk)
            if move.finished_at is not None:
                continue
            now = timezone.now()
            leased = selectors.leased_block_ids(name, now)
            blocks = {
                block.block_key_hex: block
                for block in selectors.held_blocks(name).filter(
                    compat_id=move.compat_id,
                    scope_id=move.scope_id,
                    block_key__in=[bytes.fromhex(key) for key in move.owed_release],
                )
            }
            owed, leaving = [], []
            for key in move.owed_release:
                block = blocks.get(key)
                if block is None:
                    continue  # gone already (evicted meanwhile): nothing to release
                if block.pk in leased:
                    owed.append(key)
                    continue
                leaving.append(block)
            reason = f"released by the move of {move.map} to version {move.to_version}"
            evict_many(leaving, reason, now, cause="reshard_release")
            move.released_blocks += len(leaving)
            released += len(leaving)
            move.owed_release = owed
            if not owed:
                move.finished_at = now
            move.save(update_fields=["owed_release", "released_blocks", "finished_at"])
    return released
