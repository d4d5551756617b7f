"""Tests for kvsp.cost: the 6.4 placement cost model, against values worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.cost import (
    BlockSources,
    MatchedBlock,
    cheapest,
    lookup_estimate,
    mean_service_time_us,
    plan_fetch,
    price_instance,
    recompute_us,
    replica_transfer_us,
    transfer_us,
    wait_us,
)
from kvsp.records import (
    DirectiveBlock,
    InstanceStatusRecord,
    Link,
    ReplicaRecord,
    ResidencyEntry,
)

COMPAT = "0f" * 32
SCOPE = "5e" * 16
II1 = "https://ii1.example/kvsp/"
II2 = "https://ii2.example/kvsp/"
HA = "https://ha.example/kvsp/"
HB = "https://hb.example/kvsp/"
HC = "https://hc.example/kvsp/"
KEYS = [f"{i:02x}" * 32 for i in range(1, 9)]

ALL_ON_DEVICE = (ResidencyEntry("device", (0, 31)),)


def status(
    instance=II1, *, links=(), queued=0, prefill=10_000, decode=1_000
) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=1,
        state="active",
        running=0,
        queued=queued,
        batch_size=32,
        kv_utilization=0.5,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        links=tuple(links),
        ttl_ms=3000,
    )


def replica(key: str, holder: str, size: int, residency=ALL_ON_DEVICE) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=key,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=size,
        digest="sha-256:" + "00" * 32,
        residency=tuple(residency),
        ttl_ms=60_000,
    )


def blocks_at(holders_per_block, size=1_000_000, residency=ALL_ON_DEVICE) -> list[MatchedBlock]:
    return [
        MatchedBlock(KEYS[i], tuple(replica(KEYS[i], h, size, residency) for h in holders))
        for i, holders in enumerate(holders_per_block)
    ]


def test_units():
    # 8 Mbit over 8 Mbit/s is one second.
    assert transfer_us(1_000_000, 8) == 1_000_000
    assert recompute_us(10_000, 10_000) == 1_000_000
    assert wait_us(3, 50_000) == 150_000
    # 1000 prompt tokens at 10k/s and 100 output tokens at 1k/s: 0.1 s + 0.1 s.
    assert mean_service_time_us(status(), 1000, 100) == pytest.approx(200_000)
    with pytest.raises(ValueError):
        mean_service_time_us(status(), -1, 0)


def test_a_hit_on_a_slow_link_loses_to_recompute():
    # Four 1 MB blocks over 100 Mbit/s: 80 000 us each, 320 000 us plus the 100 us round trip.
    # Recomputing the 64 tokens at 10 000 tokens/s takes 6 400 us.
    candidate = price_instance(
        status(links=[Link(HA, 100, 100)]),
        blocks_at([[HA]] * 4),
        block_tokens=16,
        prompt_tokens=64,
        mean_service_time_us=0,
    )
    assert candidate.matched == 4
    assert candidate.fetch_us == pytest.approx(320_100)
    assert candidate.recompute_unmatched_us == 0
    assert candidate.recompute_all_us == pytest.approx(6_400)
    assert candidate.cost_us == pytest.approx(6_400)
    assert not candidate.uses_cache


def test_a_hit_on_a_fast_link_wins():
    # Four 1 MB blocks over 400 000 Mbit/s: 20 us each, 80 us plus a 12 us round trip. The
    # last 16 of 80 tokens are recomputed (1 600 us); recomputing all 80 would take 8 000 us.
    candidate = price_instance(
        status(links=[Link(HA, 400_000, 12)]),
        blocks_at([[HA]] * 4),
        block_tokens=16,
        prompt_tokens=80,
        mean_service_time_us=0,
    )
    assert candidate.fetch_us == pytest.approx(92)
    assert candidate.recompute_unmatched_us == pytest.approx(1_600)
    assert candidate.recompute_all_us == pytest.approx(8_000)
    assert candidate.cost_us == pytest.approx(1_692)
    assert candidate.uses_cache
    assert candidate.bytes_from == ((HA, 4_000_000),)
    assert candidate.directive_blocks() == tuple(DirectiveBlock(k, (HA,)) for k in KEYS[:4])
    assert candidate.to_json() == {
        "instance": II1,
        "wait_us": 0,
        "fetch_us": candidate.fetch_us,
        "recompute_unmatched_us": candidate.recompute_unmatched_us,
        "recompute_all_us": candidate.recompute_all_us,
        "cost_us": candidate.cost_us,
    }


def test_a_tier_read_rate_reduces_the_rate_for_its_layers():
    # 1 MB over 32 layers, half in device memory and half in a host tier read at 100 000 Mbit/s,
    # over a 400 000 Mbit/s link: 500 kB at 400 000 (10 us) + 500 kB at 100 000 (40 us).
    split = (ResidencyEntry("device", (0, 15)), ResidencyEntry("host", (16, 31), 100_000))
    assert replica_transfer_us(replica(KEYS[0], HA, 1_000_000, split), 400_000) == 50
    # Without the tier rate, the whole block moves at the link rate: 20 us.
    assert replica_transfer_us(replica(KEYS[0], HA, 1_000_000), 400_000) == 20
    # A tier faster than the link does not speed the link up.
    fast = (ResidencyEntry("device", (0, 15)), ResidencyEntry("host", (16, 31), 800_000))
    assert replica_transfer_us(replica(KEYS[0], HA, 1_000_000, fast), 400_000) == 20
    # Shares follow layer counts: 8 of 32 layers (800 kB) on device at 400 000 Mbit/s = 16 us,
    # 24 of 32 (2.4 MB) on disk read at 1 000 Mbit/s = 19 200 us.
    uneven = (ResidencyEntry("device", (0, 7)), ResidencyEntry("disk", (8, 31), 1_000))
    assert replica_transfer_us(replica(KEYS[0], HA, 3_200_000, uneven), 400_000) == 19_216

    candidate = price_instance(
        status(links=[Link(HA, 400_000, 12)]),
        blocks_at([[HA]] * 2, residency=split),
        block_tokens=16,
        prompt_tokens=32,
        mean_service_time_us=0,
    )
    assert candidate.fetch_us == pytest.approx(12 + 2 * 50)


def test_resident_blocks_cost_nothing():
    # Block 0 has a replica at the instance itself, block 1 is known resident by the caller,
    # block 2 comes from HA: 1 MB at 400 000 Mbit/s = 20 us + 12 us.
    blocks = blocks_at([[II1, HA], [HA], [HA]])
    candidate = price_instance(
        status(links=[Link(HA, 400_000, 12), Link(II1, 1, 0)]),
        blocks,
        block_tokens=16,
        prompt_tokens=48,
        mean_service_time_us=0,
        resident={KEYS[1]},
    )
    assert candidate.matched == 3
    assert candidate.resident == (KEYS[0], KEYS[1])
    assert candidate.fetch == (BlockSources(KEYS[2], (HA,)),)
    assert candidate.fetch_us == pytest.approx(32)
    everything_here = price_instance(
        status(links=[Link(HA, 1, 1_000_000)]),
        blocks_at([[II1]] * 3),
        block_tokens=16,
        prompt_tokens=48,
        mean_service_time_us=0,
    )
    assert everything_here.fetch_us == 0 and everything_here.cost_us == 0
    assert everything_here.directive_blocks() == ()


def test_a_busy_instance_loses_to_an_idle_one():
    blocks = blocks_at([[HA]] * 2)
    link = [Link(HA, 400_000, 12)]
    busy = price_instance(
        status(II1, links=link, queued=10),
        blocks,
        block_tokens=16,
        prompt_tokens=32,
        mean_service_time_us=50_000,
    )
    idle = price_instance(
        status(II2, links=link, queued=0),
        blocks,
        block_tokens=16,
        prompt_tokens=32,
        mean_service_time_us=50_000,
    )
    assert busy.wait_us == 500_000 and idle.wait_us == 0
    assert busy.cost_us == pytest.approx(500_000 + 52)
    assert cheapest([busy, idle]) is idle
    assert cheapest([]) is None


def test_the_cheapest_tie_goes_to_the_lower_url():
    same = dict(block_tokens=16, prompt_tokens=16, mean_service_time_us=0)
    first = price_instance(status(II2), [], **same)
    second = price_instance(status(II1), [], **same)
    assert cheapest([first, second]) is second


def test_fetch_is_the_max_over_sources_not_the_sum():
    # Block 0 only at HA (rtt 10), block 1 only at HB (rtt 1000); each 4 MB at 400 000 Mbit/s
    # is 80 us. HA is done at 90 us, HB at 1 080 us; they load in parallel.
    plan = plan_fetch(
        II1,
        [Link(HA, 400_000, 10), Link(HB, 400_000, 1000)],
        blocks_at([[HA], [HB]], size=4_000_000),
    )
    assert plan.source_us == ((HA, 90), (HB, 1080))
    assert plan.fetch_us == 1080


def test_blocks_spread_over_equal_sources():
    # Both blocks are at HA and HB, equally far. Block 0 finishes at 90 us at either; the tie
    # goes to the lower URL (HA). Block 1 would finish at 170 us at HA but 90 us at HB.
    plan = plan_fetch(
        II1,
        [Link(HB, 400_000, 10), Link(HA, 400_000, 10)],
        blocks_at([[HB, HA], [HA, HB]], size=4_000_000),
    )
    assert plan.fetched == (BlockSources(KEYS[0], (HA, HB)), BlockSources(KEYS[1], (HB, HA)))
    assert plan.fetched[1].chosen == HB
    assert plan.fetch_us == 90
    assert plan.bytes_from == ((HA, 4_000_000), (HB, 4_000_000))


def test_the_cheaper_source_is_preferred_for_one_block():
    plan = plan_fetch(
        II1,
        [Link(HA, 1_000, 10), Link(HB, 400_000, 10)],
        blocks_at([[HA, HB]], size=4_000_000),
    )
    # HA: 10 + 32 000; HB: 10 + 80.
    assert plan.fetched == (BlockSources(KEYS[0], (HB, HA)),)
    assert plan.fetch_us == 90


def test_a_source_without_a_link_is_not_usable():
    # Block 1 is only at HC, to which the instance reports no link: the loadable prefix ends
    # before it, and block 2 (at HA) is recomputed too, since it is useless without block 1.
    candidate = price_instance(
        status(links=[Link(HA, 400_000, 12)]),
        blocks_at([[HA], [HC], [HA]]),
        block_tokens=16,
        prompt_tokens=48,
        mean_service_time_us=0,
    )
    assert candidate.matched == 1
    assert [b.block_key for b in candidate.fetch] == [KEYS[0]]
    assert candidate.fetch_us == pytest.approx(32)
    assert candidate.recompute_unmatched_us == pytest.approx(3_200)
    assert candidate.cost_us == pytest.approx(3_232)
    # A holder with no link is left out of a block's sources when others are usable.
    plan = plan_fetch(II1, [Link(HA, 400_000, 12)], blocks_at([[HC, HA]]))
    assert plan.fetched == (BlockSources(KEYS[0], (HA,)),)


def test_lookup_estimates():
    # Two matched blocks of 16 tokens: 32 tokens at 10 000 tokens/s = 3 200 us.
    estimate = lookup_estimate(
        status(links=[Link(HA, 400_000, 12)]), blocks_at([[HA], [HA]]), block_tokens=16
    )
    assert estimate.target == II1
    assert estimate.fetch_us == pytest.approx(52)
    assert estimate.recompute_us == pytest.approx(3_200)
    assert estimate.to_json() == {"target": II1, "fetch_us": 52, "recompute_us": 3200}
    # Blocks resident at the target cost nothing to fetch but still price their recompute.
    here = lookup_estimate(status(), blocks_at([[II1], [II1]]), block_tokens=16)
    assert here.fetch_us == 0 and here.recompute_us == pytest.approx(3_200)
    # A target that cannot fetch one of the matched blocks cannot be priced.
    assert (
        lookup_estimate(status(links=[Link(HA, 1, 1)]), blocks_at([[HB]]), block_tokens=16) is None
    )
    assert lookup_estimate(status(), [], block_tokens=16).fetch_us == 0


def test_caller_errors():
    with pytest.raises(ValueError, match="more tokens than the prompt"):
        price_instance(
            status(),
            blocks_at([[HA]] * 2),
            block_tokens=16,
            prompt_tokens=31,
            mean_service_time_us=0,
        )
    with pytest.raises(ValueError, match="block_tokens"):
        price_instance(status(), [], block_tokens=0, prompt_tokens=1, mean_service_time_us=0)
    with pytest.raises(ValueError, match="negative"):
        price_instance(status(), [], block_tokens=1, prompt_tokens=1, mean_service_time_us=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        lookup_estimate(status(), [], block_tokens=0)
    with pytest.raises(ValueError, match="listed for"):
        MatchedBlock(KEYS[0], (replica(KEYS[1], HA, 1),))


@given(
    st.lists(
        st.lists(st.sampled_from([HA, HB, HC, II1]), min_size=1, max_size=4, unique=True),
        max_size=8,
    ),
    st.integers(0, 100),
    st.integers(0, 5),
)
def test_cost_is_the_cheaper_of_the_two_ways(holders, extra_tokens, queued):
    blocks = blocks_at(holders)
    prompt = 16 * len(blocks) + extra_tokens
    if prompt == 0:
        return
    links = [Link(HA, 10_000, 50), Link(HB, 400_000, 500)]
    candidate = price_instance(
        status(links=links, queued=queued),
        blocks,
        block_tokens=16,
        prompt_tokens=prompt,
        mean_service_time_us=1_000,
    )
    assert candidate.cost_us == pytest.approx(
        candidate.wait_us
        + min(candidate.fetch_us + candidate.recompute_unmatched_us, candidate.recompute_all_us)
    )
    assert candidate.cost_us <= candidate.wait_us + candidate.recompute_all_us + 1e-6
    assert candidate.matched == len(candidate.resident) + len(candidate.fetch)
    # Every chosen source is one the instance has a link to, and never the instance itself.
    assert all(b.chosen in (HA, HB) for b in candidate.fetch)
    # The loadable prefix is a prefix: it stops at the first block with no usable holder.
    usable = [any(h in (HA, HB, II1) for h in hs) for hs in holders]
    expected = usable.index(False) if False in usable else len(usable)
    assert candidate.matched == expected
