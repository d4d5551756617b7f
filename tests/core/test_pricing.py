"""The fleet-wide pricing, and the sources of the chosen instance's directive, equal the
reference cost model, instance by instance (6.4)."""

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import cost
from kvsp.pricing import BlockTable, block_sources, directive_blocks, price_all
from kvsp.records import InstanceStatusRecord, Link, ReplicaRecord, ResidencyEntry

HOLDERS = [f"http://h{n}.test/kvsp/" for n in range(4)]
INSTANCES = [f"http://ii{n}.test/kvsp/" for n in range(5)]


def replica(key: str, holder: str, size: int, split: int | None, tier_rate: int | None):
    digests = [hashlib.sha256(f"{key}{n}".encode()).hexdigest() for n in range(4)]
    if split is None:
        residency = (ResidencyEntry("host", (0, 3), tier_rate),)
    else:
        residency = (
            ResidencyEntry("device", (0, split)),
            ResidencyEntry("disk", (split + 1, 3), tier_rate),
        )
    return ReplicaRecord(
        block_key=key,
        compat_id="c0" * 32,
        scope_id="5a" * 16,
        holder=holder,
        codec=1,
        size=size,
        digest="sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest(),
        residency=residency,
        ttl_ms=1000,
        layer_digests=tuple(digests),
    )


holder_urls = st.sampled_from(HOLDERS + INSTANCES)
replica_options = st.tuples(
    holder_urls,
    st.integers(1, 10_000_000),
    st.one_of(st.none(), st.integers(0, 2)),
    st.one_of(st.none(), st.integers(1, 400_000)),
)
block_strategy = st.lists(replica_options, min_size=0, max_size=4, unique_by=lambda r: r[0])
link_strategy = st.lists(
    st.tuples(st.sampled_from(HOLDERS + INSTANCES), st.integers(1, 400_000), st.integers(0, 500)),
    max_size=6,
    unique_by=lambda link: link[0],
)


fleet_strategy = st.lists(
    st.tuples(link_strategy, st.integers(0, 5), st.integers(1, 100_000)),
    min_size=1,
    max_size=5,
)


def matched_blocks(blocks):
    matched = []
    for index, options in enumerate(blocks):
        key = hashlib.sha256(str(index).encode()).hexdigest()
        replicas = tuple(replica(key, *option) for option in options)
        matched.append(cost.MatchedBlock(key, replicas))
    return matched


def statuses(fleet):
    return [
        InstanceStatusRecord(
            instance=INSTANCES[n],
            epoch=1,
            state="active",
            running=0,
            queued=queued,
            batch_size=8,
            kv_utilization=0.1,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=100,
            links=tuple(Link(*link) for link in links),
            ttl_ms=1000,
        )
        for n, (links, queued, prefill) in enumerate(fleet)
    ]


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(block_strategy, max_size=12), fleet=fleet_strategy, tail=st.integers(0, 15))
def test_fleet_pricing_equals_the_reference(blocks, fleet, tail):
    matched = matched_blocks(blocks)
    fleet_statuses = statuses(fleet)
    prompt_tokens = 16 * len(matched) + tail
    prices = price_all(
        fleet_statuses, matched, block_tokens=16, prompt_tokens=prompt_tokens, mean_output_tokens=64
    )
    for status, price in zip(fleet_statuses, prices, strict=True):
        reference = cost.price_instance(
            status,
            matched,
            block_tokens=16,
            prompt_tokens=prompt_tokens,
            mean_service_time_us=cost.mean_service_time_us(status, prompt_tokens, 64),
        )
        assert price.matched == reference.matched
        assert price.to_json() == reference.to_json()  # exactly, not approximately
        assert price.uses_cache == reference.uses_cache


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(block_strategy, max_size=12), fleet=fleet_strategy)
def test_directive_sources_equal_the_reference(blocks, fleet):
    matched = matched_blocks(blocks)
    table = BlockTable.from_matched_blocks(matched)
    for status in statuses(fleet):
        plan = cost.plan_fetch(status.instance, status.links, matched)
        expected = [block.directive_block().to_json() for block in plan.fetched]
        assert directive_blocks(status, table) == expected


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(block_strategy, max_size=12), fleet=fleet_strategy)
def test_resident_blocks_and_sources_equal_the_reference(blocks, fleet):
    """What a resume carries (6.8): the blocks resident at the chosen instance, and where to
    load each other block of the loadable prefix from."""
    matched = matched_blocks(blocks)
    table = BlockTable.from_matched_blocks(matched)
    for status in statuses(fleet):
        plan = cost.plan_fetch(status.instance, status.links, matched)
        assert block_sources(status, table) == (plan.resident, plan.fetched)


@settings(max_examples=100, deadline=None)
@given(
    holders=st.integers(1, 20),
    picks=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    data=st.data(),
)
def test_a_directive_keeps_each_distinct_list_of_sources_once(holders, picks, data):
    """Distinct rows of ranked columns, in the order they first appear, however many holders
    (past 15 a row no longer fits one int64 code)."""
    import numpy as np

    from kvsp.pricing import _distinct_rows

    columns = st.permutations(list(range(-1, holders))).map(lambda p: p[:holders])
    lists = data.draw(st.lists(columns, min_size=5, max_size=5))
    ranked = np.array([lists[p] for p in picks], dtype=np.int32)
    found: dict[tuple, int] = {}
    expected = [found.setdefault(tuple(lists[p]), len(found)) for p in picks]
    rows, source_of = _distinct_rows(ranked)
    assert rows == [list(row) for row in found]
    assert source_of.tolist() == expected
