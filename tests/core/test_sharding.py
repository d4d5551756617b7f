"""Tests for kvsp.sharding: range arithmetic and reshard plans (spec 6.9, DESIGN.md section 3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.problems import ProtocolError
from kvsp.records import FetchRange, ReshardPlan, Shard, ShardMap
from kvsp.sharding import (
    intersect_ranges,
    merge_ranges,
    next_shard_map,
    plan_reshard,
    range_length,
    subtract_ranges,
)

A = "https://a.example/kvsp/"
B = "https://b.example/kvsp/"
C = "https://c.example/kvsp/"
D = "https://d.example/kvsp/"


def shard_map(*shards: tuple[int, int, str], version: int = 4) -> ShardMap:
    return ShardMap("ctx-1", version, tuple(Shard((a, b), who) for a, b, who in shards))


def shards(*triples: tuple[int, int, str]) -> list[Shard]:
    return [Shard((a, b), who) for a, b, who in triples]


def summary(plans: list[ReshardPlan]) -> dict:
    """Plans as {instance: (retain, fetch, release)} with plain tuples, for comparison."""
    return {
        plan.instance: (
            list(plan.retain),
            [(f.tokens, f.source) for f in plan.fetch],
            list(plan.release),
        )
        for plan in plans
    }


# --- Range arithmetic -------------------------------------------------------------------------


def test_merge_ranges():
    assert merge_ranges([]) == []
    assert merge_ranges([(5, 7), (0, 2), (2, 3), (6, 9)]) == [(0, 3), (5, 9)]
    assert merge_ranges([(0, 10), (2, 3)]) == [(0, 10)]
    with pytest.raises(ValueError):
        merge_ranges([(3, 3)])
    with pytest.raises(ValueError):
        merge_ranges([(4, 3)])


def test_intersect_ranges():
    assert intersect_ranges([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert intersect_ranges([(0, 10)], [(10, 20)]) == []
    assert intersect_ranges([(0, 100)], [(10, 20), (30, 40)]) == [(10, 20), (30, 40)]
    assert intersect_ranges([], [(0, 1)]) == []


def test_subtract_ranges():
    assert subtract_ranges([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]
    assert subtract_ranges([(0, 100)], [(10, 20), (30, 40)]) == [(0, 10), (20, 30), (40, 100)]
    assert subtract_ranges([(0, 10)], [(0, 10)]) == []
    assert subtract_ranges([(0, 10)], []) == [(0, 10)]
    assert subtract_ranges([(5, 10)], [(0, 6), (8, 20)]) == [(6, 8)]


def tokens_of(ranges) -> set[int]:
    return {t for start, end in ranges for t in range(start, end)}


small_ranges = st.lists(
    st.tuples(st.integers(0, 60), st.integers(1, 20)).map(lambda p: (p[0], p[0] + p[1])),
    max_size=6,
)


def is_maximal(ranges) -> bool:
    return all(a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False))


@given(small_ranges, small_ranges)
def test_range_arithmetic_against_sets(a, b):
    assert tokens_of(merge_ranges(a)) == tokens_of(a)
    assert tokens_of(intersect_ranges(a, b)) == tokens_of(a) & tokens_of(b)
    assert tokens_of(subtract_ranges(a, b)) == tokens_of(a) - tokens_of(b)
    assert range_length(a) == len(tokens_of(a))
    for result in (merge_ranges(a), intersect_ranges(a, b), subtract_ranges(a, b)):
        assert is_maximal(result)  # sorted, and no two touch


# --- Plans against hand-written expectations --------------------------------------------------


def test_identical_maps_retain_everything():
    current = shard_map((0, 100, A), (100, 200, B))
    plans = plan_reshard(current, current.shards, deadline_ms=200)
    assert summary(plans) == {A: ([(0, 100)], [], []), B: ([(100, 200)], [], [])}


def test_the_spec_example():
    current = shard_map((0, 32768, A), (32768, 65536, B), (65536, 98304, C))
    plans = plan_reshard(current, shards((0, 49152, A), (49152, 98304, B)), deadline_ms=200)
    assert [plan.to_json() for plan in plans][0] == {
        "map": "ctx-1",
        "instance": A,
        "from": 4,
        "to": 5,
        "deadline_ms": 200,
        "retain": [[0, 32768]],
        "fetch": [{"tokens": [32768, 49152], "from": B}],
        "release": [],
    }
    assert summary(plans) == {
        A: ([(0, 32768)], [((32768, 49152), B)], []),
        B: ([(49152, 65536)], [((65536, 98304), C)], [(32768, 49152)]),
        C: ([], [], [(65536, 98304)]),
    }


def test_grow_the_group():
    current = shard_map((0, 100, A), (100, 200, B))
    plans = plan_reshard(
        current, shards((0, 50, A), (50, 100, B), (100, 150, C), (150, 200, D)), deadline_ms=50
    )
    assert [plan.instance for plan in plans] == [A, B, C, D]
    assert summary(plans) == {
        A: ([(0, 50)], [], [(50, 100)]),
        B: ([], [((50, 100), A)], [(100, 200)]),
        C: ([], [((100, 150), B)], []),
        D: ([], [((150, 200), B)], []),
    }


def test_shrink_the_group():
    current = shard_map((0, 50, A), (50, 100, B), (100, 150, C))
    plans = plan_reshard(current, shards((0, 75, A), (75, 150, B)), deadline_ms=50)
    assert summary(plans) == {
        A: ([(0, 50)], [((50, 75), B)], []),
        B: ([(75, 100)], [((100, 150), C)], [(50, 75)]),
        C: ([], [], [(100, 150)]),
    }


def test_shift_the_boundary():
    current = shard_map((0, 100, A), (100, 200, B))
    plans = plan_reshard(current, shards((0, 150, A), (150, 200, B)), deadline_ms=50)
    assert summary(plans) == {
        A: ([(0, 100)], [((100, 150), B)], []),
        B: ([(150, 200)], [], [(100, 150)]),
    }


def test_swap_two_members():
    current = shard_map((0, 100, A), (100, 200, B))
    plans = plan_reshard(current, shards((0, 100, B), (100, 200, A)), deadline_ms=50)
    assert summary(plans) == {
        A: ([], [((100, 200), B)], [(0, 100)]),
        B: ([], [((0, 100), A)], [(100, 200)]),
    }


def test_tokens_no_shard_covered_are_neither_fetched_nor_retained():
    # The context grew past 200: nobody holds 200..300, so B computes it.
    current = shard_map((0, 100, A), (100, 200, B))
    plans = plan_reshard(current, shards((0, 150, A), (150, 300, B)), deadline_ms=50)
    assert summary(plans) == {
        A: ([(0, 100)], [((100, 150), B)], []),
        B: ([(150, 200)], [], [(100, 150)]),
    }
    # A map that starts at 1000: 0..1000 is covered by nobody in version v.
    current = shard_map((1000, 2000, A))
    plans = plan_reshard(current, shards((0, 500, A), (500, 2000, B)), deadline_ms=50)
    assert summary(plans) == {
        A: ([], [], [(1000, 2000)]),
        B: ([], [((1000, 2000), A)], []),
    }


def test_ranges_are_merged_and_fetch_is_merged_per_source():
    current = shard_map((0, 10, A), (10, 20, A), (20, 30, B), (30, 40, A), (40, 50, C))
    plans = plan_reshard(current, shards((0, 5, D), (5, 50, D)), deadline_ms=50)
    assert summary(plans)[D] == (
        [],
        [((0, 20), A), ((20, 30), B), ((30, 40), A), ((40, 50), C)],
        [],
    )
    assert summary(plans)[A] == ([], [], [(0, 20), (30, 40)])
    plans = plan_reshard(current, shards((0, 25, A), (25, 50, A)), deadline_ms=50)
    assert summary(plans)[A] == ([(0, 20), (30, 40)], [((20, 30), B), ((40, 50), C)], [])


def test_the_next_version_must_be_a_valid_map():
    current = shard_map((0, 100, A), (100, 200, B))
    with pytest.raises(ProtocolError, match=r"shards\[1\].tokens: must start at 100"):
        plan_reshard(current, shards((0, 100, A), (150, 200, B)), deadline_ms=50)
    with pytest.raises(ProtocolError, match="deadline_ms"):
        plan_reshard(current, current.shards, deadline_ms=0)
    assert next_shard_map(current, current.shards).version == 5


# --- Properties -------------------------------------------------------------------------------

members = st.sampled_from([A, B, C, D])


@st.composite
def maps(draw, version: int = 4) -> ShardMap:
    start = draw(st.integers(0, 40))
    cuts = sorted(draw(st.sets(st.integers(start + 1, 120), min_size=1, max_size=6)))
    bounds = [start, *cuts]
    return ShardMap(
        "ctx-1",
        version,
        tuple(Shard((a, b), draw(members)) for a, b in zip(bounds, bounds[1:], strict=False)),
    )


@given(maps(), maps())
def test_plan_properties(current, following):
    plans = plan_reshard(current, following.shards, deadline_ms=100)
    assert [p.instance for p in plans] == list(
        dict.fromkeys(current.instances + following.instances)
    )
    covered = [current.covered]
    for plan in plans:
        held = current.ranges_of(plan.instance)
        wanted = following.ranges_of(plan.instance)
        fetched = [f.tokens for f in plan.fetch]
        assert intersect_ranges(plan.retain, fetched) == []
        # retain + fetch is what it will hold of what somebody held; retain + release is what
        # it held.
        assert merge_ranges(list(plan.retain) + fetched) == intersect_ranges(wanted, covered)
        assert merge_ranges(list(plan.retain) + list(plan.release)) == merge_ranges(held)
        # Retained ranges are exactly those held in both versions.
        assert list(plan.retain) == intersect_ranges(held, wanted)
        # Each fetched piece comes from the member that holds it in version v.
        for fetch in plan.fetch:
            assert fetch.source != plan.instance
            assert intersect_ranges([fetch.tokens], current.ranges_of(fetch.source)) == [
                fetch.tokens
            ]
        # Sorted and maximal; fetch merged per source.
        assert is_maximal(list(plan.retain)) and is_maximal(list(plan.release))
        assert fetched == sorted(fetched)
        for left, right in zip(plan.fetch, plan.fetch[1:], strict=False):
            assert left.tokens[1] <= right.tokens[0]
            assert not (left.tokens[1] == right.tokens[0] and left.source == right.source)
        assert ReshardPlan.from_json(plan.to_json()) == plan
    # Every token of the next version that version v covers is loaded by exactly one member.
    gained = [f.tokens for plan in plans for f in plan.fetch]
    assert range_length(gained) == sum(b - a for a, b in gained)


@given(maps(), maps())
def test_no_retained_range_is_fetched_anywhere(current, following):
    plans = plan_reshard(current, following.shards, deadline_ms=100)
    retained = [r for plan in plans for r in plan.retain]
    fetched = [f.tokens for plan in plans for f in plan.fetch]
    # Nothing retained is fetched, by its own member or by any other.
    assert intersect_ranges(retained, fetched) == []
    # A range kept in place is one its member holds in both versions.
    for plan in plans:
        for tokens in plan.retain:
            assert intersect_ranges([tokens], current.ranges_of(plan.instance)) == [tokens]
            assert intersect_ranges([tokens], following.ranges_of(plan.instance)) == [tokens]


def test_fetch_range_records_are_what_plans_hold():
    plan = plan_reshard(shard_map((0, 10, A)), shards((0, 10, B)), deadline_ms=1)[1]
    assert plan.fetch == (FetchRange((0, 10), A),)
