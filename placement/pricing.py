"""The 6.4 cost of many candidate instances at once.

``kvsp.cost.price_instance`` is the reference: it prices one instance, block by block. Placing a
long prompt over a fleet multiplies that by every instance (2,048 blocks x 100 instances is
hundreds of thousands of Python steps), so this module walks the blocks once and carries every
instance along in numpy arrays. It performs the same floating-point operations in the same
order, with the same tie-breaking (the lower holder URL), so its figures equal the reference's
exactly; tests/placement/test_pricing.py holds it to that. Only the chosen instance is then
priced again by the reference, for the sources its prefetch directive lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from django.conf import settings

from kvsp import cost
from kvsp.records import InstanceStatusRecord


@dataclass(frozen=True, slots=True)
class Price:
    """The terms of one candidate's cost, as ``kvsp.cost.CostBreakdown`` has them."""

    instance: str
    matched: int
    wait_us: float
    fetch_us: float
    recompute_unmatched_us: float
    recompute_all_us: float
    cost_us: float

    @property
    def uses_cache(self) -> bool:
        return self.matched > 0 and (
            self.fetch_us + self.recompute_unmatched_us < self.recompute_all_us
        )

    def to_json(self) -> dict:
        return {
            "instance": self.instance,
            "wait_us": self.wait_us,
            "fetch_us": self.fetch_us,
            "recompute_unmatched_us": self.recompute_unmatched_us,
            "recompute_all_us": self.recompute_all_us,
            "cost_us": self.cost_us,
        }


def _shape(replica) -> tuple:
    return (replica.size, tuple((e.layer_count, e.read_mbit_per_s) for e in replica.residency))


def fetch_plans(
    statuses: Sequence[InstanceStatusRecord], blocks: Sequence[cost.MatchedBlock]
) -> tuple[np.ndarray, np.ndarray]:
    """For each instance, the loadable prefix length and fetch_us of ``kvsp.cost.plan_fetch``."""
    count = len(statuses)
    holders = sorted({replica.holder for block in blocks for replica in block.replicas})
    if not holders:  # no block has a replica: nothing is loadable anywhere
        return np.zeros(count, dtype=np.int64), np.zeros(count)
    column = {holder: h for h, holder in enumerate(holders)}
    row_of_url = {status.instance: i for i, status in enumerate(statuses)}
    rate = np.zeros((count, len(holders)))
    rtt = np.zeros((count, len(holders)))
    usable = np.zeros((count, len(holders)), dtype=bool)
    for i, status in enumerate(statuses):
        for link in status.links:
            h = column.get(link.holder)
            if h is not None and link.holder != status.instance:
                rate[i, h], rtt[i, h], usable[i, h] = link.mbit_per_s, link.rtt_us, True

    transfer_cache: dict[tuple, np.ndarray] = {}

    def transfer(h: int, replica) -> np.ndarray:
        # The reference's own arithmetic, once per (holder, replica shape) and instance.
        key = (h, _shape(replica))
        if key not in transfer_cache:
            transfer_cache[key] = np.array(
                [
                    cost.replica_transfer_us(replica, rate[i, h]) if usable[i, h] else np.inf
                    for i in range(count)
                ]
            )
        return transfer_cache[key]

    busy = np.zeros((count, len(holders)))
    used = np.zeros((count, len(holders)), dtype=bool)
    alive = np.ones(count, dtype=bool)
    loadable = np.zeros(count, dtype=np.int64)
    rows = np.arange(count)
    for block in blocks:
        resident = np.zeros(count, dtype=bool)
        finish = np.full((count, len(holders)), np.inf)
        transfer_of = np.zeros((count, len(holders)))
        for replica in block.replicas:
            i = row_of_url.get(replica.holder)
            if i is not None:
                resident[i] = True
            h = column[replica.holder]
            seconds = transfer(h, replica)
            finish[:, h] = np.where(usable[:, h], rtt[:, h] + busy[:, h] + seconds, np.inf)
            transfer_of[:, h] = seconds
        best = np.argmin(finish, axis=1)
        reachable = np.isfinite(finish[rows, best])
        fetch = alive & ~resident & reachable
        busy[rows[fetch], best[fetch]] += transfer_of[rows[fetch], best[fetch]]
        used[rows[fetch], best[fetch]] = True
        alive &= resident | reachable
        loadable += alive
    fetch_us = np.where(used, rtt + busy, -np.inf).max(axis=1, initial=-np.inf)
    return loadable, np.where(np.isfinite(fetch_us), fetch_us, 0.0)


def price_all(
    statuses: Sequence[InstanceStatusRecord],
    blocks: Sequence[cost.MatchedBlock],
    *,
    block_tokens: int,
    prompt_tokens: int,
    mean_output_tokens: int,
) -> list[Price]:
    """The 6.4 cost of each instance, equal to ``kvsp.cost.price_instance`` for each."""
    if not statuses:
        return []
    loadable, fetch_us = fetch_plans(statuses, blocks)
    prices = []
    for i, status in enumerate(statuses):
        rate = status.prefill_tokens_per_s
        matched = int(loadable[i])
        unmatched = cost.recompute_us(prompt_tokens - matched * block_tokens, rate)
        everything = cost.recompute_us(prompt_tokens, rate)
        waiting = cost.wait_us(
            status.queued, cost.mean_service_time_us(status, prompt_tokens, mean_output_tokens)
        )
        fetching = float(fetch_us[i])
        prices.append(
            Price(
                instance=status.instance,
                matched=matched,
                wait_us=waiting,
                fetch_us=fetching,
                recompute_unmatched_us=unmatched,
                recompute_all_us=everything,
                cost_us=waiting + min(fetching + unmatched, everything),
            )
        )
    return prices


def price_candidates(entries, blocks, *, block_tokens: int, prompt_tokens: int) -> list[tuple]:
    """``(instance, status, Price)`` for each ``(instance, status)`` entry."""
    entries = list(entries)
    prices = price_all(
        [status for _, status in entries],
        blocks,
        block_tokens=block_tokens,
        prompt_tokens=prompt_tokens,
        mean_output_tokens=settings.KVSP_MEAN_OUTPUT_TOKENS,
    )
    return [
        (instance, status, price) for (instance, status), price in zip(entries, prices, strict=True)
    ]


def cheapest(priced: list[tuple]) -> tuple | None:
    """The entry with the lowest cost; ties go to the lower instance URL (deterministic)."""
    return min(priced, key=lambda entry: (entry[2].cost_us, entry[0].url), default=None)


def breakdown(status, blocks, *, block_tokens: int, prompt_tokens: int) -> cost.CostBreakdown:
    """The reference breakdown of one instance, with the sources of each block to fetch."""
    return cost.price_instance(
        status,
        blocks,
        block_tokens=block_tokens,
        prompt_tokens=prompt_tokens,
        mean_service_time_us=cost.mean_service_time_us(
            status, prompt_tokens, settings.KVSP_MEAN_OUTPUT_TOKENS
        ),
    )
