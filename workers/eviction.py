"""Making room in the tier store (spec 6.1, 6.6): which blocks move from host to disk and which
leave the node for a new one, and evicting blocks, for room or because their serving copy is
lost.

Eviction is fair between scopes (tenant isolation on a holder). Each scope has a quota on the
node: ``KVSP_SCOPE_QUOTA_OCTETS`` when set, otherwise an equal share of the node's capacity
(host and disk) among the scopes holding blocks there, the storing scope included, so that a
lone scope may use everything and a newcomer may take back up to its share. A store for scope S
evicts, least recently used first and never a leased or pending block, only blocks of S itself
or of a scope holding more than its quota, and never takes another scope below its quota. What
a scope holds counts all its blocks on the node, in either tier, pending ones too. A move from
host to disk is not an eviction and may move any scope's block, but the disk room it needs is
made under the same rule. When no block the rule allows makes room, the store is refused
(``kvsp-unavailable``) and nothing changes. A quota is what a scope keeps against others, not a
cap: free room goes to whoever stores first.

The decision is ``plan_room``'s, a function of plain values (the tiers' capacities and use,
their blocks in LRU order, what each scope holds, which blocks are protected) that reads no
database; ``plan_room_on_node`` gathers those values from the node's rows and the placement
(``workers.admission``) carries the plan out. An evicted replica is withdrawn inside the node's
lock, before its row is deleted (6.1); a leased one is evicted only after a fault, its record
withdrawn first (6.6).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, NamedTuple, TypeVar

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from kvsp.problems import ProtocolError
from workers import control_plane, metrics, selectors, tiers
from workers.instance import lock_node
from workers.models import StoredBlock
from workers.replicas import publish_on_commit, withdraw_many

log = logging.getLogger(__name__)

# A file in a tier directory with no row younger than this may belong to a placement still in
# its transaction.
ORPHAN_GRACE_S = 300


def _protected_block_ids(name: str, now: datetime) -> set[int]:
    """Blocks no eviction may take: leased ones (6.6), and those pending for a reshard move
    (the node acknowledged the plan on the strength of them)."""
    pending = StoredBlock.objects.filter(instance=name, pending_move__isnull=False)
    return selectors.leased_block_ids(name, now) | set(pending.values_list("pk", flat=True))


def _evict(block: StoredBlock, reason: str, now: datetime) -> None:
    evict_many([block], reason, now, cause="fault")


def room_cause(storing_scope: bytes) -> Callable[[StoredBlock], str]:
    """The cause (``kvsp.reasons.EVICTION_CAUSES``) of evicting a block to make room for one
    of ``storing_scope``: its own scope's blocks go for capacity, another's for its quota."""
    return lambda block: "capacity" if bytes(block.scope_id) == storing_scope else "scope_quota"


def evict_many(
    blocks: list[StoredBlock],
    reason: str,
    now: datetime,
    *,
    cause: str | Callable[[StoredBlock], str],
) -> None:
    """Withdraw, then forget blocks of one node; their files go once the deletion is
    committed, so a reader never finds a committed row without its file. ``cause`` (of
    ``kvsp.reasons.EVICTION_CAUSES``, or a function of the block) is counted then too."""
    if not blocks:
        return
    for block in blocks:
        log.info("evicting %s: %s", block, reason)
    instance = blocks[0].instance
    withdraw_many(instance, [block.ids for block in blocks], reason, now)
    paths = [tiers.stored_path(block) for block in blocks]
    causes = [(cause if isinstance(cause, str) else cause(block), block.size) for block in blocks]
    StoredBlock.objects.filter(pk__in=[block.pk for block in blocks]).delete()

    def unlink() -> None:
        for path in paths:
            tiers.unlink_quietly(path)

    transaction.on_commit(unlink, robust=True)
    transaction.on_commit(lambda: metrics.count_evictions(instance, causes), robust=True)


def demote(block: StoredBlock) -> None:
    """Move a block's serving copy from the host tier to disk and publish its new residency."""
    source = tiers.stored_path(block)
    tiers.copy_file(source, tiers.block_path(tiers.DISK, block.instance, block.ids))
    block.tier = tiers.DISK
    block.save(update_fields=["tier"])
    transaction.on_commit(lambda: tiers.unlink_quietly(source), robust=True)
    instance, size = block.instance, block.size
    transaction.on_commit(
        lambda: metrics.count_tier_move(instance, tiers.HOST, tiers.DISK, size), robust=True
    )
    publish_on_commit(block)


class Resident(NamedTuple):
    """A block in a tier as the planner weighs it: the row it stands for, its scope, its size."""

    pk: int
    scope_id: bytes
    size: int


class TierOccupancy(NamedTuple):
    """A storage tier as the planner sees it: its capacity and use in octets, and its blocks,
    least recently used first (None while they have not been read)."""

    capacity: int
    used: int
    lru: tuple[Resident, ...] | None = None


class Occupancy(NamedTuple):
    """Everything a plan weighs. ``held_by_scope`` (the octets of each scope's blocks on the
    node, both tiers and pending blocks included) and ``protected`` (the blocks a lease or a
    reshard move keeps) matter only when disk must evict, and are read with its blocks.
    ``scope_quota`` is ``KVSP_SCOPE_QUOTA_OCTETS``: 0 makes it an equal share."""

    host: TierOccupancy
    disk: TierOccupancy
    scope_quota: int
    held_by_scope: Mapping[bytes, int] | None = None
    protected: frozenset[int] | None = None


class BlocksNotRead(Exception):
    """The plan depends on the blocks of ``tier`` (for disk, also on what each scope holds and
    which blocks are protected), which the occupancy it was given has not read: read them and
    plan again."""

    def __init__(self, tier: str):
        super().__init__(tier)
        self.tier = tier


Block = TypeVar("Block")


@dataclass
class RoomPlan(Generic[Block]):
    """Where a new block goes and what makes room for it, decided before anything is done, so
    that a block that does not fit changes nothing."""

    tier: str
    demote: list[Block]
    evict: list[Block]


@dataclass
class ScopeShares:
    """The fairness rule of eviction (see the module docstring) for a store of scope
    ``storing``: the octets each scope holds on the node, kept current as a plan evicts, and
    the quota every scope keeps against the others."""

    storing: bytes
    held: dict[bytes, int]
    quota: int

    @classmethod
    def of(cls, storing: bytes, occupancy: Occupancy) -> ScopeShares:
        held = occupancy.held_by_scope
        quota = occupancy.scope_quota
        if not quota:
            capacity = occupancy.host.capacity + occupancy.disk.capacity
            quota = capacity // len(held.keys() | {storing})
        return cls(storing, dict(held), quota)

    def may_evict(self, block: Resident) -> bool:
        """The storing scope's own blocks, and another scope's while it keeps its quota."""
        return block.scope_id == self.storing or (
            self.held.get(block.scope_id, 0) - block.size >= self.quota
        )

    def evicted(self, block: Resident) -> None:
        self.held[block.scope_id] = self.held.get(block.scope_id, 0) - block.size


class _DiskRoom:
    """The disk tier as one plan uses it: its use, and the blocks the plan evicts from it, in
    LRU order, among those no lease or reshard move keeps and ``ScopeShares`` allows."""

    def __init__(self, occupancy: Occupancy, storing: bytes):
        self.cap, self.used = occupancy.disk.capacity, occupancy.disk.used
        self._occupancy, self._storing = occupancy, storing
        self._shares: ScopeShares | None = None
        self._victims: list[Resident] | None = None
        self._next = 0
        self.evict: list[Resident] = []

    def make_room(self, needed: int) -> bool:
        if self.used + needed <= self.cap:
            return True
        if self._victims is None:
            occupancy = self._occupancy
            if None in (occupancy.disk.lru, occupancy.held_by_scope, occupancy.protected):
                raise BlocksNotRead(tiers.DISK)
            self._shares = ScopeShares.of(self._storing, occupancy)
            self._victims = [b for b in occupancy.disk.lru if b.pk not in occupancy.protected]
        # One pass suffices: evicting only ever lowers what a scope holds, so a block the rule
        # passes over stays out of reach for the rest of the plan.
        while self.used + needed > self.cap and self._next < len(self._victims):
            victim = self._victims[self._next]
            self._next += 1
            if not self._shares.may_evict(victim):
                continue
            self._shares.evicted(victim)
            self.evict.append(victim)
            self.used -= victim.size
        return self.used + needed <= self.cap


def plan_room(occupancy: Occupancy, scope_id: bytes, size: int) -> RoomPlan[Resident]:
    """The tier for a new block of scope ``scope_id`` and ``size`` octets, and how to make room
    there; ``kvsp-unavailable`` when no room can be made.

    The host tier first: its least recently used blocks move to disk (a move is not an
    eviction, so leased blocks, and any scope's, may move), and disk makes room by evicting its
    least recently used blocks that ``ScopeShares`` allows and no lease or reshard move keeps.
    A block too large for the host tier, or one the host tier cannot make room for, goes to
    disk directly. Raises ``BlocksNotRead`` when the plan depends on blocks ``occupancy`` lacks.
    """
    host = occupancy.host
    if size <= host.capacity:
        used = host.used
        disk = _DiskRoom(occupancy, scope_id)
        demote = []
        if used + size > host.capacity:
            if host.lru is None:
                raise BlocksNotRead(tiers.HOST)
            for candidate in host.lru:
                if not disk.make_room(candidate.size):
                    break
                demote.append(candidate)
                disk.used += candidate.size
                used -= candidate.size
                if used + size <= host.capacity:
                    break
        if used + size <= host.capacity:
            return RoomPlan(tiers.HOST, demote, disk.evict)
    disk = _DiskRoom(occupancy, scope_id)
    if size <= disk.cap and disk.make_room(size):
        return RoomPlan(tiers.DISK, [], disk.evict)
    raise ProtocolError(
        "kvsp-unavailable",
        f"no room for a block of {size} octets: the blocks in the way are leased, pending, or "
        "other scopes' within their quota, or the tiers are too small",
    )


def plan_room_on_node(name: str, scope_id: bytes, size: int, now: datetime) -> RoomPlan:
    """``plan_room`` for a new block on node ``name``, of its rows as they stand (the caller
    holds the node's lock): the plan's blocks are ``StoredBlock`` rows.

    Most stores fit as the tiers are, so the tiers' use is read first, and a tier's blocks only
    when the plan asks for them (``BlocksNotRead``): the host tier's, then the disk's with what
    each scope holds (one query however many blocks) and which blocks are protected.
    """
    occupancy = Occupancy(
        host=TierOccupancy(tiers.capacity(tiers.HOST), selectors.used_octets(name, tiers.HOST)),
        disk=TierOccupancy(tiers.capacity(tiers.DISK), selectors.used_octets(name, tiers.DISK)),
        scope_quota=settings.KVSP_SCOPE_QUOTA_OCTETS,
    )
    rows: dict[int, StoredBlock] = {}
    while True:
        try:
            plan = plan_room(occupancy, scope_id, size)
        except BlocksNotRead as unread:
            occupancy = _read_tier(name, unread.tier, now, occupancy, rows)
            continue
        return RoomPlan(
            plan.tier, [rows[b.pk] for b in plan.demote], [rows[b.pk] for b in plan.evict]
        )


def _read_tier(
    name: str, tier: str, now: datetime, occupancy: Occupancy, rows: dict[int, StoredBlock]
) -> Occupancy:
    """``occupancy`` with the blocks of ``tier`` read (their rows added to ``rows``), and for
    disk what each scope holds and which blocks are protected."""
    blocks = list(
        StoredBlock.objects.filter(instance=name, tier=tier).order_by("last_access", "pk")
    )
    rows.update((block.pk, block) for block in blocks)
    lru = tuple(Resident(block.pk, bytes(block.scope_id), block.size) for block in blocks)
    if tier == tiers.HOST:
        return occupancy._replace(host=occupancy.host._replace(lru=lru))
    return occupancy._replace(
        disk=occupancy.disk._replace(lru=lru),
        held_by_scope=selectors.octets_by_scope(name),
        protected=frozenset(_protected_block_ids(name, now)),
    )


def _intact(block: StoredBlock) -> bool:
    try:
        return tiers.stored_path(block).stat().st_size == block.size
    except FileNotFoundError:
        return False


def do_evict_after_fault(block: StoredBlock, reason: str) -> bool:
    """Drop a block whose serving copy is lost or damaged, leased or not: the record is
    withdrawn first (6.6), then the row goes and the leases no longer name it. The fault is
    confirmed under the node's lock, since a move to another tier looks alike from outside.
    True when the block was dropped."""
    if _intact(block):
        return False
    # "MUST first withdraw" (6.6); outside the lock, as every withdrawal (``withdraw_many``).
    # One that fails now is owed by the eviction below.
    control_plane.withdraw_replicas([block.ids])
    with transaction.atomic():
        lock_node(block.instance)
        current = StoredBlock.objects.filter(pk=block.pk).first()
        if current is None:
            return False
        if _intact(current):  # it had moved to another tier: its record stands again
            publish_on_commit(current)
            return False
        log.error("replica %s is lost: %s", current, reason)
        _evict(current, reason, timezone.now())
        return True


def do_check_tier_store(name: str) -> dict:
    """Reconcile the catalog with the files (at worker start): blocks whose file is gone or of
    the wrong size are evicted as faults; files no block names are removed."""
    tiers.ensure_dirs(name)
    lost = []
    known = set()
    for block in StoredBlock.objects.filter(instance=name):
        if not _intact(block) and do_evict_after_fault(
            block, "its serving copy is missing or damaged"
        ):
            lost.append(block.block_key_hex)
    for block in StoredBlock.objects.filter(instance=name):
        known.add(tiers.stored_path(block))
    removed = []
    cutoff = time.time() - ORPHAN_GRACE_S
    for path in tiers.orphan_files(name, known):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:
            pass
    return {"lost": lost, "removed": removed}
