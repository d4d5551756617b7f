"""The room planner (``workers.eviction.plan_room``) on plain values, without a database: the
properties a store relies on, over every occupancy hypothesis draws.

A plan makes the room it claims, moves and evicts least recently used first, never evicts a
block a lease or a reshard move keeps, never takes another scope below its quota, takes no
more than it needs, and is refused (``kvsp-unavailable``) only where the rule leaves no room.
``tests/node/test_scope_quota.py`` plans on a node's rows and stores through HTTP.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.problems import ProtocolError
from workers import tiers
from workers.eviction import (
    BlocksNotRead,
    Occupancy,
    Resident,
    RoomPlan,
    TierOccupancy,
    plan_room,
)

SCOPES = [bytes([n]) * 8 for n in (0xA, 0xB, 0xC)]
NEWCOMER = b"\x0d" * 8  # a scope holding nothing on the node


@st.composite
def occupancies(draw) -> Occupancy:
    """A node's two storage tiers with their blocks in LRU order, each tier within its
    capacity, some blocks protected, and a fixed quota or (0) an equal share."""
    pks = itertools.count(1)
    blocks = st.lists(st.tuples(st.sampled_from(SCOPES), st.integers(1, 4)), max_size=8)

    def tier() -> TierOccupancy:
        lru = tuple(Resident(next(pks), scope, size) for scope, size in draw(blocks))
        used = sum(block.size for block in lru)
        return TierOccupancy(used + draw(st.integers(0, 5)), used, lru)

    host, disk = tier(), tier()
    residents = host.lru + disk.lru
    held = Counter()
    for block in residents:
        held[block.scope_id] += block.size
    protected = draw(st.sets(st.sampled_from([b.pk for b in residents]))) if residents else set()
    capacity = host.capacity + disk.capacity
    quota = draw(st.just(0) | st.integers(1, max(capacity, 1)))
    return Occupancy(host, disk, quota, dict(held), frozenset(protected))


stores = st.tuples(st.sampled_from([*SCOPES, NEWCOMER]), st.integers(1, 10))


def planned(occupancy: Occupancy, scope_id: bytes, size: int) -> RoomPlan[Resident] | None:
    """The plan, or None when the store is refused (with the one problem type it may be)."""
    try:
        return plan_room(occupancy, scope_id, size)
    except ProtocolError as refused:
        assert refused.problem_type.name == "kvsp-unavailable"
        return None


def quota_of(occupancy: Occupancy, storing: bytes) -> int:
    if occupancy.scope_quota:
        return occupancy.scope_quota
    capacity = occupancy.host.capacity + occupancy.disk.capacity
    return capacity // len(occupancy.held_by_scope.keys() | {storing})


def octets(blocks) -> int:
    return sum(block.size for block in blocks)


def held_after(occupancy: Occupancy, plan: RoomPlan[Resident]) -> Counter:
    held = Counter(occupancy.held_by_scope)
    for block in plan.evict:
        held[block.scope_id] -= block.size
    return held


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_a_plan_makes_the_room_it_claims(occupancy, store):
    scope_id, size = store
    plan = planned(occupancy, scope_id, size)
    if plan is None:
        return
    host, disk = occupancy.host, occupancy.disk
    disk_after = disk.used + octets(plan.demote) - octets(plan.evict)
    assert disk_after <= disk.capacity
    if plan.tier == tiers.HOST:
        assert host.used - octets(plan.demote) + size <= host.capacity
    else:
        assert plan.tier == tiers.DISK
        assert plan.demote == []
        assert disk_after + size <= disk.capacity


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_blocks_move_and_leave_least_recently_used_first_and_protected_ones_never_leave(
    occupancy, store
):
    plan = planned(occupancy, *store)
    if plan is None:
        return
    # A move to disk is not an eviction: the host tier's oldest blocks, whoever's and leased
    # or not, in order.
    assert plan.demote == list(occupancy.host.lru[: len(plan.demote)])
    evicted = {block.pk for block in plan.evict}
    assert not evicted & occupancy.protected
    in_order = [block for block in occupancy.disk.lru if block.pk in evicted]
    assert plan.evict == in_order  # disk blocks only, each once, oldest first
    # Nothing the rule allows is passed over for a more recently used block.
    storing, quota = store[0], quota_of(occupancy, store[0])
    held = held_after(occupancy, plan)
    newest = max((occupancy.disk.lru.index(block) for block in plan.evict), default=0)
    for block in occupancy.disk.lru[:newest]:
        if block.pk in evicted or block.pk in occupancy.protected:
            continue
        assert block.scope_id != storing
        assert held[block.scope_id] - block.size < quota


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_no_other_scope_is_taken_below_its_quota(occupancy, store):
    storing, _ = store
    plan = planned(occupancy, *store)
    if plan is None:
        return
    quota = quota_of(occupancy, storing)
    held = held_after(occupancy, plan)
    for scope_id in {block.scope_id for block in plan.evict} - {storing}:
        assert held[scope_id] >= quota


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_a_plan_takes_no_more_than_it_needs(occupancy, store):
    _, size = store
    plan = planned(occupancy, *store)
    if plan is None:
        return
    host, disk = occupancy.host, occupancy.disk
    if plan.tier == tiers.HOST:
        if plan.demote:
            assert host.used - octets(plan.demote[:-1]) + size > host.capacity
        else:
            assert plan.evict == []
        if plan.evict:
            kept = disk.used + octets(plan.demote) - octets(plan.evict[:-1])
            assert kept > disk.capacity
    elif plan.evict:
        assert disk.used - octets(plan.evict[:-1]) + size > disk.capacity


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_a_store_is_refused_only_where_the_rule_leaves_no_room(occupancy, store):
    storing, size = store
    host, disk = occupancy.host, occupancy.disk
    plan = planned(occupancy, storing, size)
    if host.used + size <= host.capacity:
        assert plan == RoomPlan(tiers.HOST, [], [])
    own = [b for b in disk.lru if b.scope_id == storing and b.pk not in occupancy.protected]
    if size <= disk.capacity and disk.used - octets(own) + size <= disk.capacity:
        assert plan is not None  # the storing scope's own blocks alone make room on disk
    if size > host.capacity and size > disk.capacity:
        assert plan is None


@pytest.mark.parametrize("size", [3, 4])
def test_a_block_larger_than_both_tiers_is_refused_with_the_reason(size):
    occupancy = Occupancy(
        TierOccupancy(2, 0, ()), TierOccupancy(size - 1, 0, ()), 0, {}, frozenset()
    )
    with pytest.raises(ProtocolError) as refused:
        plan_room(occupancy, NEWCOMER, size)
    assert refused.value.problem_type.name == "kvsp-unavailable"
    assert f"no room for a block of {size} octets" in refused.value.detail


@settings(max_examples=200, deadline=None)
@given(occupancies(), stores)
def test_reading_blocks_when_the_plan_asks_gives_the_plan_of_reading_them_all(occupancy, store):
    """What ``plan_room_on_node`` relies on to read a tier's blocks only when a plan needs
    them: each tier is asked for once at most, and the plan is the same."""
    unread = occupancy._replace(
        host=occupancy.host._replace(lru=None),
        disk=occupancy.disk._replace(lru=None),
        held_by_scope=None,
        protected=None,
    )
    asked = []
    while True:
        try:
            lazily = plan_room(unread, *store)
        except BlocksNotRead as request:
            assert request.tier not in asked
            asked.append(request.tier)
            if request.tier == tiers.HOST:
                unread = unread._replace(host=occupancy.host)
            else:
                unread = unread._replace(
                    disk=occupancy.disk,
                    held_by_scope=occupancy.held_by_scope,
                    protected=occupancy.protected,
                )
            continue
        except ProtocolError:
            lazily = None
        break
    assert lazily == planned(occupancy, *store)
    if occupancy.host.used + store[1] <= occupancy.host.capacity:
        assert asked == []  # a block that fits as the tiers are reads nothing more
