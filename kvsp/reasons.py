"""The fixed lists of label values that say where a cache hit came from and why a miss, a
recompute, a failed block or an eviction happened. Every metric that carries one of these labels
takes its values from here, and docs/metrics.md describes each; a value not listed is a bug.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# Storage tiers, fastest first (the tiers a Residency Entry names, 4.4); ``other`` is any tier
# name the protocol does not know.
TIERS = ("device", "host", "disk", "other")

# Why a lookup's chain of Block Keys stopped before its end (6.2). Keys are chained, so nothing
# after the first key without an unexpired replica can match. The index keeps no tombstones and
# says nothing of other scopes: a key nobody published, a replica that expired or was withdrawn,
# and a scope the caller may not read all read as this one reason.
LOOKUP_STOPS = ("no_replica",)

# Why a placement recomputes prompt blocks (6.4) instead of loading them.
RECOMPUTE_REASONS = (
    "no_match",  # the lookup matched no block
    "recompute_cheaper",  # blocks are loadable, but computing them again costs less
    "no_link",  # the chosen instance knows no link to any holder of the first matched block
    "source_inactive",  # the blocks' holders are not active instances
)

# Why a block of a prefetch directive (6.5) did not load, from the refusal at its last source.
DIRECTIVE_BLOCK_FAILURES = (
    "not_found",  # a 404 at the holder, or the Index Service lists no replica there
    "digest_mismatch",  # the octets failed a digest, a length or a codec check
    "lease_refused",  # the holder refused the lease (6.6) for another reason than its quota
    "over_quota",  # the holder's lease quota was short
    "holder_unreachable",  # the holder did not answer, or answered with a server error
    "deadline",  # the directive's deadline passed before the block loaded
    "no_room",  # this node's tier store had no room for it
    "past_failure",  # an earlier block failed: keys are chained, so it was not asked for
    "other",  # none of the above (no delegated token for the source, say)
)

# Why a node evicted a block from its tier store (6.1, 6.6, 6.9).
EVICTION_CAUSES = (
    "capacity",  # room for a block of the same scope
    "scope_quota",  # room for another scope's block, taken from a scope over its quota
    "fault",  # the serving copy is missing or damaged
    "reshard_release",  # a finished reshard move released it
)


_RANK = {tier: rank for rank, tier in enumerate(TIERS)}


def tier_rank(tier_name: str) -> int:
    """The place of a tier name in ``TIERS``, fastest first; ``other``'s for a name not there."""
    return _RANK.get(tier_name, len(TIERS) - 1)


def fastest(tier_names: Iterable[str]) -> str:
    """The fastest of ``TIERS`` among tier names as Residency Entries give them: ``other`` for
    a name the protocol does not know, and when there is none."""
    return TIERS[min(map(tier_rank, tier_names), default=len(TIERS) - 1)]


@functools.lru_cache(maxsize=4096)
def fastest_tier(residency_json: str) -> str:
    """The fastest of ``TIERS`` named by a replica's residency as the Index Service stores it
    (canonical JSON, each entry's ``tier`` first); ``other`` when it names none of them."""
    for tier in TIERS[:-1]:
        if f'"tier":"{tier}"' in residency_json:
            return tier
    return TIERS[-1]
