"""The 6.4 cost of many candidate instances at once.

``kvsp.cost.price_instance`` is the reference: it prices one instance, block by block. Placing a
long prompt over a fleet multiplies that by every instance (2,048 blocks x 100 instances is some
200,000 greedy decisions), so the matched blocks become one table of holder columns and replica
shapes (``BlockTable``), the fleet's links another (``LinkTable``), and ``kvsp.fetchplan`` walks
them compiled. It performs the same floating-point operations in the same order, with the same
tie-breaking (the lower holder URL), so its figures equal the reference's exactly, and so do the
sources of the chosen instance's directive; tests/core/test_pricing.py holds both to that.

The fleet's figures are ``kvsp.cost.CostBreakdown``s without their fetch plan: where the blocks
would come from is worked out for the chosen instance alone (``directive_sources``,
``block_sources``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsp import cost, fetchplan, reasons
from kvsp.records import InstanceStatusRecord


@dataclass(frozen=True, slots=True)
class BlockTable:
    """Matched blocks (in prefix order) as ``kvsp.fetchplan`` reads them: which holder
    column has a replica of which block, in which of a few replica shapes (size and residency).
    """

    block_keys: tuple[str, ...]
    holders: tuple[str, ...]  # sorted: a lower column is a lower URL, the reference's tie-break
    shape_of: np.ndarray  # (blocks, holders) int32, -1 where the holder has no replica
    shape_size: np.ndarray  # (shapes,) int64
    shape_layers: np.ndarray  # (shapes, entries) int64 layer counts, 0 past the last entry
    shape_read: np.ndarray  # (shapes, entries) float64 read rates, 0.0 where none is given
    # (shapes,) int64: the fastest tier each shape has layers in, as its rank in reasons.TIERS
    shape_tier: np.ndarray

    def __len__(self) -> int:
        return len(self.block_keys)

    @classmethod
    def build(cls, block_keys, holders, placed, shapes) -> BlockTable:
        """``placed``: (holder, shape index, block positions) triples; ``shapes``: (size,
        residency) pairs, residency a sequence of ``ResidencyEntry``."""
        column = {holder: h for h, holder in enumerate(holders)}
        shape_of = np.full((len(block_keys), len(holders)), -1, dtype=np.int32)
        for holder, shape, positions in placed:
            shape_of[positions, column[holder]] = shape
        entries = max((len(residency) for _, residency in shapes), default=0)
        shape_size = np.zeros(len(shapes), dtype=np.int64)
        shape_layers = np.zeros((len(shapes), max(entries, 1)), dtype=np.int64)
        shape_read = np.zeros((len(shapes), max(entries, 1)))
        shape_tier = np.zeros(len(shapes), dtype=np.int64)
        for s, (size, residency) in enumerate(shapes):
            shape_size[s] = size
            shape_tier[s] = reasons.tier_rank(reasons.fastest(entry.tier for entry in residency))
            for e, entry in enumerate(residency):
                shape_layers[s, e] = entry.layer_count
                shape_read[s, e] = entry.read_mbit_per_s or 0.0
        return cls(
            tuple(block_keys),
            tuple(holders),
            shape_of,
            shape_size,
            shape_layers,
            shape_read,
            shape_tier,
        )

    @classmethod
    def from_matched_blocks(cls, blocks: Sequence[cost.MatchedBlock]) -> BlockTable:
        holders = sorted({replica.holder for block in blocks for replica in block.replicas})
        shape_index: dict[tuple, int] = {}
        shapes, placed = [], []
        for b, block in enumerate(blocks):
            for replica in block.replicas:
                shape = (replica.size, tuple(replica.residency))
                s = shape_index.setdefault(shape, len(shapes))
                if s == len(shapes):
                    shapes.append(shape)
                placed.append((replica.holder, s, [b]))
        return cls.build([block.block_key for block in blocks], holders, placed, shapes)


@dataclass(frozen=True, slots=True)
class LinkTable:
    """Every instance's links to the holder columns of a ``BlockTable``."""

    rate: np.ndarray
    rtt: np.ndarray
    usable: np.ndarray
    own_column: np.ndarray

    @classmethod
    def build(cls, statuses: Sequence[InstanceStatusRecord], holders: Sequence[str]) -> LinkTable:
        column = {holder: h for h, holder in enumerate(holders)}
        shape = (len(statuses), len(holders))
        rate, rtt, usable = np.ones(shape), np.zeros(shape), np.zeros(shape, dtype=bool)
        own_column = np.full(len(statuses), -1, dtype=np.int64)
        for i, status in enumerate(statuses):
            own_column[i] = column.get(status.instance, -1)
            for link in status.links:  # as the reference's dict of links: the last one wins
                h = column.get(link.holder)
                if h is not None and link.holder != status.instance:
                    rate[i, h], rtt[i, h], usable[i, h] = link.mbit_per_s, link.rtt_us, True
        return cls(rate, rtt, usable, own_column)


def _as_table(blocks) -> BlockTable:
    return blocks if isinstance(blocks, BlockTable) else BlockTable.from_matched_blocks(blocks)


def _arrays(table: BlockTable, links: LinkTable) -> tuple:
    return (
        table.shape_of,
        table.shape_size,
        table.shape_layers,
        table.shape_read,
        links.rate,
        links.rtt,
        links.usable,
        links.own_column,
    )


def fetch_plans(
    statuses: Sequence[InstanceStatusRecord], blocks: BlockTable | Sequence[cost.MatchedBlock]
) -> tuple[np.ndarray, np.ndarray]:
    """For each instance, the loadable prefix length and fetch_us of ``kvsp.cost.plan_fetch``."""
    table = _as_table(blocks)
    if not table.holders:  # no block has a replica: nothing is loadable anywhere
        return np.zeros(len(statuses), dtype=np.int64), np.zeros(len(statuses))
    return fetchplan.plan_fleet(*_arrays(table, LinkTable.build(statuses, table.holders)))


def _ranked_prefix(status: InstanceStatusRecord, blocks: BlockTable) -> np.ndarray:
    """Each block of the loadable prefix at ``status.instance``, its usable sources (holder
    columns) by finish time, -1 after the last; a resident block's row is all -1."""
    loadable, ranked = fetchplan.plan_sources(
        0, *_arrays(blocks, LinkTable.build([status], blocks.holders))
    )
    return ranked[:loadable]


def directive_sources(
    status: InstanceStatusRecord, blocks: BlockTable
) -> tuple[np.ndarray, list[list[str]], np.ndarray]:
    """The blocks of a prefetch directive (6.5) for one instance: each block of its loadable
    prefix that is not resident there, with its usable sources by finish time (the ``fetch`` of
    ``kvsp.cost.price_instance``). As arrays: the blocks' positions in ``blocks``, the distinct
    lists of sources (holder URLs the IS validated), and which of them is each block's.
    """
    if not blocks.holders:
        return np.zeros(0, dtype=np.int64), [], np.zeros(0, dtype=np.int64)
    ranked = _ranked_prefix(status, blocks)
    positions = np.flatnonzero(ranked[:, 0] >= 0)  # the others are resident
    if not len(positions):
        return positions, [], np.zeros(0, dtype=np.int64)
    rows, source_of = _distinct_rows(ranked[positions])
    sources = [[blocks.holders[h] for h in row if h >= 0] for row in rows]
    return positions, sources, source_of


def block_sources(
    status: InstanceStatusRecord, blocks: BlockTable
) -> tuple[tuple[str, ...], tuple[cost.BlockSources, ...]]:
    """The loadable prefix at one instance as the reference's ``FetchPlan`` has it: the blocks
    resident there (``resident``), and each other block with its usable sources by finish time
    (``fetched``)."""
    if not blocks.holders:
        return (), ()
    resident, fetched = [], []
    for position, row in enumerate(_ranked_prefix(status, blocks).tolist()):
        key = blocks.block_keys[position]
        if row[0] < 0:
            resident.append(key)
        else:
            fetched.append(cost.BlockSources(key, tuple(blocks.holders[h] for h in row if h >= 0)))
    return tuple(resident), tuple(fetched)


def _distinct_rows(ranked: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """The distinct rows of ``ranked`` (columns from -1 up) in the order they first appear, and
    the position among them of each row."""
    columns = ranked.shape[1]
    if (columns + 1) ** columns >= 2**62:  # more holders than one int64 code per row holds
        found: dict[tuple, int] = {}
        source_of = [found.setdefault(row, len(found)) for row in map(tuple, ranked.tolist())]
        return [list(row) for row in found], np.asarray(source_of, dtype=np.int64)
    # Each row as one number in base columns + 1, so that numpy finds the distinct ones.
    codes = (ranked.astype(np.int64) + 1) @ ((columns + 1) ** np.arange(columns, dtype=np.int64))
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return ranked[first[order]].tolist(), rank[inverse.reshape(-1)]


def hit_tiers(blocks: BlockTable) -> np.ndarray:
    """Matched blocks per tier of ``reasons.TIERS``: each in the fastest tier among its
    replicas."""
    if not blocks.holders:
        return np.zeros(len(reasons.TIERS), dtype=np.int64)
    other = len(reasons.TIERS) - 1
    ranks = np.where(blocks.shape_of >= 0, blocks.shape_tier[blocks.shape_of], other)
    return np.bincount(ranks.min(axis=1), minlength=len(reasons.TIERS))


def source_tiers(
    blocks: BlockTable, positions: np.ndarray, sources: list, source_of: np.ndarray
) -> np.ndarray:
    """Blocks per tier of ``reasons.TIERS`` among those of a directive (``directive_sources``):
    each in the fastest tier its first source has layers of it in."""
    if not len(positions):
        return np.zeros(len(reasons.TIERS), dtype=np.int64)
    column = {holder: h for h, holder in enumerate(blocks.holders)}
    first_source = np.asarray([column[row[0]] for row in sources], dtype=np.int64)
    shapes = blocks.shape_of[positions, first_source[source_of]]
    ranks = blocks.shape_tier[shapes[shapes >= 0]]
    return np.bincount(ranks, minlength=len(reasons.TIERS))


def directive_blocks(status: InstanceStatusRecord, blocks: BlockTable) -> list[dict]:
    """``directive_sources`` as the directive's JSON "blocks" (6.5)."""
    positions, sources, source_of = directive_sources(status, blocks)
    return [
        {"block_key": blocks.block_keys[p], "sources": sources[s]}
        for p, s in zip(positions.tolist(), source_of.tolist(), strict=True)
    ]


def price_all(
    statuses: Sequence[InstanceStatusRecord],
    blocks: BlockTable | Sequence[cost.MatchedBlock],
    *,
    block_tokens: int,
    prompt_tokens: int,
    mean_output_tokens: int,
) -> list[cost.CostBreakdown]:
    """The 6.4 cost of each instance, equal to ``kvsp.cost.price_instance`` for each (without
    its fetch plan)."""
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
            cost.CostBreakdown(
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
