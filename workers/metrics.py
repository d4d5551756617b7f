"""The node's metrics: blocks sent as they are; blocks evicted, moved between tiers, loaded or
not for directives, wherever the node does it (its Celery worker included: these are tallied
counters, ``common.metrics``); and the leases every holder records."""

from __future__ import annotations

import collections
import functools

from django.conf import settings
from prometheus_client import Counter

from common.metrics import TalliedCounter, count_all, database_figures, gauge
from kvsp.reasons import DIRECTIVE_BLOCK_FAILURES, EVICTION_CAUSES, TIERS
from workers.selectors import lease_totals

_BOTH = ("control", "node")
EVICTIONS = TalliedCounter(
    "kvsp_evictions",
    "Blocks a node evicted from its tier store, by cause (kvsp.reasons).",
    ["instance", "cause"],
    roles=_BOTH,
)
EVICTED_OCTETS = TalliedCounter(
    "kvsp_evicted_octets",
    "Octets of the blocks a node evicted, by cause.",
    ["instance", "cause"],
    roles=_BOTH,
)
TIER_MOVED_OCTETS = TalliedCounter(
    "kvsp_tier_moved_octets",
    "Octets of blocks a node moved from one tier of its store to another: host to disk, to "
    "make room; host or disk to device, the device tier's working copies of a block's leading "
    "layers.",
    ["instance", "from_tier", "to_tier"],
    roles=_BOTH,
)
DIRECTIVE_LOADED_BLOCKS = TalliedCounter(
    "kvsp_directive_loaded_blocks",
    "Blocks of prefetch directives (6.5) a node loaded from peers, by the fastest tier each was "
    "in at the source that served it.",
    ["instance", "tier"],
    roles=_BOTH,
)
DIRECTIVE_BLOCK_FAILURES_COUNTER = TalliedCounter(
    "kvsp_directive_block_failures",
    "Blocks of prefetch directives a node did not load, by why (kvsp.reasons).",
    ["instance", "reason"],
    roles=_BOTH,
)


def count_evictions(instance: str, evicted: list[tuple[str, int]]) -> None:
    """Blocks one node evicted, as (cause, octets) pairs."""
    blocks, octets = collections.Counter(), collections.Counter()
    for cause, size in evicted:
        if cause not in EVICTION_CAUSES:
            raise ValueError(f"not an eviction cause: {cause}")
        blocks[cause] += 1
        octets[cause] += size
    count_all(
        [(EVICTIONS.series(instance, cause), n) for cause, n in blocks.items()]
        + [(EVICTED_OCTETS.series(instance, cause), n) for cause, n in octets.items()]
    )


def count_tier_move(instance: str, from_tier: str, to_tier: str, octets: int) -> None:
    TIER_MOVED_OCTETS.count(instance, from_tier, to_tier, amount=octets)


@functools.cache
def _directive_series(instance: str) -> tuple:
    return {tier: DIRECTIVE_LOADED_BLOCKS.series(instance, tier) for tier in TIERS}, {
        reason: DIRECTIVE_BLOCK_FAILURES_COUNTER.series(instance, reason)
        for reason in DIRECTIVE_BLOCK_FAILURES
    }


def count_directive_blocks(instance: str, loaded: dict[str, int], failed: dict[str, int]) -> None:
    """One directive's blocks on a node: those loaded by the tier at their source, and those
    that did not load by why."""
    loaded_series, failures = _directive_series(instance)
    count_all(
        [(loaded_series[t], n) for t, n in loaded.items()]
        + [(failures[r], n) for r, n in failed.items()]
    )


BLOCKS_SENT = Counter(
    "kvsp_blocks_sent",
    "Block representations a holder sent (6.7), whole or a layer range, per request that asked "
    "for them: a GET of one block, or a batch (POST blocks/{compat}/{scope}), one per part.",
    ["request"],
)


@database_figures("control", "node")
def lease_figures(now):
    # The control plane shows every holder's; a node its own.
    instance = None if settings.KVSP_ROLE == "control" else (settings.KVSP_INSTANCE or None)
    totals = lease_totals(instance=instance, now=now)
    yield gauge(
        "kvsp_leases",
        "Unexpired leases (6.6) per holder instance.",
        ["instance"],
        (((row["instance"],), row["leases"]) for row in totals),
    )
    yield gauge(
        "kvsp_lease_octets",
        "Octets kept from eviction by unexpired leases, per holder instance.",
        ["instance"],
        (((row["instance"],), row["octets"]) for row in totals),
    )
