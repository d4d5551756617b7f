"""Pricing a prompt's prefix (spec 6.4), for placement and for the failover of sessions.

``price_prefix`` is the one way both choose an instance: it looks the prefix's Block Keys up in
the index (the leading keys with an unexpired replica, as ``kvsp.pricing.BlockTable``) and
prices every active instance that serves the Compatibility ID with the 6.4 cost model of
``kvsp.pricing``, which equals the reference of ``kvsp.cost`` exactly. Placement prices sleeping
instances on the same prefix when no active one will do (``PricedPrefix.price``). Both ask
where the chosen instance would load each block from: placement for its prefetch directive
(``PricedPrefix.directive_sources``), failover for its resume (``PricedPrefix.block_sources``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

import numpy as np
from django.conf import settings

from index.selectors import ReplicaGroup, matched_prefix_of_groups, replica_groups
from kvsp import cost, pricing
from placement.selectors import Candidate, LiveStatus, candidates, matched_block_table


class PricedCandidate(NamedTuple):
    """A candidate instance, its live status and its 6.4 cost (without the fetch plan)."""

    instance: Candidate
    status: LiveStatus
    price: cost.CostBreakdown


def price_candidates(
    entries: Iterable[tuple[Candidate, LiveStatus]],
    blocks: pricing.BlockTable,
    *,
    block_tokens: int,
    prompt_tokens: int,
) -> list[PricedCandidate]:
    """Each ``(instance, status)`` entry with its cost of serving the prompt."""
    entries = list(entries)
    prices = pricing.price_all(
        [status for _, status in entries],
        blocks,
        block_tokens=block_tokens,
        prompt_tokens=prompt_tokens,
        mean_output_tokens=settings.KVSP_MEAN_OUTPUT_TOKENS,
    )
    return [
        PricedCandidate(instance, status, price)
        for (instance, status), price in zip(entries, prices, strict=True)
    ]


def cheapest(priced: Iterable[PricedCandidate]) -> PricedCandidate | None:
    """The entry with the lowest cost; ties go to the lower instance URL (deterministic), as
    ``kvsp.cost.cheapest`` has it."""
    return min(priced, key=lambda entry: (entry.price.cost_us, entry.instance.url), default=None)


@dataclass(frozen=True)
class PricedPrefix:
    """A prompt's matched prefix and the cost of each candidate instance to serve the prompt."""

    blocks: pricing.BlockTable
    block_tokens: int
    prompt_tokens: int
    priced: list[PricedCandidate]
    # How many leading keys matched, and their replicas grouped by holder and shape: what the
    # metrics of a placement read (the tier of each hit, the sources used).
    matched: int
    groups: list[ReplicaGroup]

    def price(self, entries: Iterable[tuple[Candidate, LiveStatus]]) -> list[PricedCandidate]:
        """Other candidates (``placement.selectors.candidates``) priced on the same prefix."""
        return price_candidates(
            entries, self.blocks, block_tokens=self.block_tokens, prompt_tokens=self.prompt_tokens
        )

    def directive_sources(self, chosen: PricedCandidate) -> tuple[np.ndarray, list, np.ndarray]:
        """The blocks of the chosen candidate's prefetch directive (6.5), as arrays
        (``kvsp.pricing.directive_sources``)."""
        return pricing.directive_sources(chosen.status, self.blocks)

    def hit_tiers(self) -> list:
        """The matched blocks per tier of ``kvsp.reasons.TIERS``, each in the fastest tier
        among its replicas."""
        return pricing.hit_tiers(self.blocks).tolist()

    def source_tiers(self, positions: np.ndarray, sources: list, source_of: np.ndarray) -> list:
        """Blocks per tier of ``kvsp.reasons.TIERS`` of a directive (``directive_sources``): each
        in the fastest tier its first source has layers of it in."""
        return pricing.source_tiers(self.blocks, positions, sources, source_of).tolist()

    def block_sources(
        self, chosen: PricedCandidate
    ) -> tuple[tuple[str, ...], tuple[cost.BlockSources, ...]]:
        """The chosen candidate's loadable prefix: the blocks resident there, and each other
        one with its usable sources, the cheapest first (``kvsp.pricing.block_sources``)."""
        return pricing.block_sources(chosen.status, self.blocks)


def price_prefix(
    principal,
    compat_id: bytes,
    scope_id: bytes,
    keys: list[bytes],
    *,
    block_tokens: int,
    prompt_tokens: int,
    now: datetime,
    exclude_holders: Collection[str] = (),
    exclude_instances: Collection[int] = (),
    lap: Callable[[str], None] | None = None,
) -> PricedPrefix:
    """Look ``keys`` (a prompt's Block Keys, in prefix order) up for ``principal`` and price
    every active instance that serves ``compat_id``, but those of ``exclude_instances`` (ids),
    for a prompt of ``prompt_tokens`` tokens.

    Replicas at ``exclude_holders`` (URLs) are no source. ``lap`` is called with "lookup" once
    the prefix is matched, so that a caller can tell the lookup's time from the pricing's.
    """
    groups = replica_groups(principal, compat_id, scope_id, keys, now=now)
    if exclude_holders:
        groups = [group for group in groups if group.holder not in exclude_holders]
    matched = matched_prefix_of_groups(len(keys), groups)
    blocks = matched_block_table(keys, groups, matched)
    if lap is not None:
        lap("lookup")
    # Never fewer tokens than the matched blocks cover: the cost model counts them as a prefix
    # of the prompt (a session's count comes from its checkpoint, not from its keys).
    prompt_tokens = max(prompt_tokens, matched * block_tokens)
    entries = [
        entry
        for entry in candidates(compat_id.hex(), now=now)
        if entry[0].pk not in exclude_instances
    ]
    priced = price_candidates(
        entries, blocks, block_tokens=block_tokens, prompt_tokens=prompt_tokens
    )
    return PricedPrefix(blocks, block_tokens, prompt_tokens, priced, matched, groups)
