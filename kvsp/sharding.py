"""Resharding of sequence-sharded caches: spec 6.9, with the plan shape of DESIGN.md section 3.

``plan_reshard`` computes, for a move of a Shard Map from version v to v+1, one reshard plan per
member of either version:

- ``retain``: exactly what the member holds in both versions (6.9: such a range MUST be
  retained and MUST NOT be transferred);
- ``fetch``: what it gains, each piece with the member that holds it in version v as ``from``;
- ``release``: what it loses, released after the commit.

Tokens that no shard of v covers are neither fetched nor retained: nobody holds them, so the
member computes them itself. Ranges are half-open ``(start, end)`` pairs; every list in a plan
is sorted by start and maximal (adjacent ranges merged; in ``fetch``, merged per source).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from kvsp.records import FetchRange, ReshardPlan, Shard, ShardMap, TokenRange

# --- Range arithmetic on half-open ranges -----------------------------------------------------


def _check(ranges: Iterable[TokenRange]) -> list[TokenRange]:
    out = []
    for start, end in ranges:
        if start >= end:
            raise ValueError(f"empty or reversed range [{start}, {end})")
        out.append((start, end))
    return out


def merge_ranges(ranges: Iterable[TokenRange]) -> list[TokenRange]:
    """The union of ``ranges``: sorted by start, overlapping and adjacent ranges merged."""
    merged: list[TokenRange] = []
    for start, end in sorted(_check(ranges)):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def intersect_ranges(a: Iterable[TokenRange], b: Iterable[TokenRange]) -> list[TokenRange]:
    """The tokens in both ``a`` and ``b``, as merged ranges."""
    left, right = merge_ranges(a), merge_ranges(b)
    out: list[TokenRange] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if start < end:
            out.append((start, end))
        # Advance the range that ends first; the other may still meet the next one.
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return merge_ranges(out)


def subtract_ranges(a: Iterable[TokenRange], b: Iterable[TokenRange]) -> list[TokenRange]:
    """The tokens of ``a`` that are not in ``b``, as merged ranges."""
    removed = merge_ranges(b)
    out: list[TokenRange] = []
    j = 0
    for start, end in merge_ranges(a):
        # Ranges of b that end before this range starts can never matter again.
        while j < len(removed) and removed[j][1] <= start:
            j += 1
        cursor = start
        k = j
        while k < len(removed) and removed[k][0] < end:
            if removed[k][0] > cursor:
                out.append((cursor, removed[k][0]))
            cursor = max(cursor, removed[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def range_length(ranges: Iterable[TokenRange]) -> int:
    """How many tokens ``ranges`` cover, counting each once."""
    return sum(end - start for start, end in merge_ranges(ranges))


# --- Reshard plans ----------------------------------------------------------------------------


def next_shard_map(current: ShardMap, next_shards: Sequence[Shard]) -> ShardMap:
    """Version v+1 of ``current`` with ``next_shards``; validated like any Shard Map."""
    return ShardMap(map=current.map, version=current.version + 1, shards=tuple(next_shards))


def _sources(gained: list[TokenRange], current: ShardMap) -> tuple[FetchRange, ...]:
    """``gained`` split by the member holding each piece in ``current``, merged per source."""
    starts = [shard.tokens[0] for shard in current.shards]
    pieces: dict[str, list[TokenRange]] = {}
    for start, end in gained:
        # The shards are contiguous and sorted, so the first one that can overlap is found by
        # bisection; tokens outside current.covered fall in no shard and are dropped.
        index = max(bisect.bisect_right(starts, start) - 1, 0)
        while index < len(current.shards) and current.shards[index].tokens[0] < end:
            shard = current.shards[index]
            low, high = max(start, shard.tokens[0]), min(end, shard.tokens[1])
            if low < high:
                pieces.setdefault(shard.instance, []).append((low, high))
            index += 1
    fetch = [
        FetchRange(tokens=tokens, source=source)
        for source, ranges in pieces.items()
        for tokens in merge_ranges(ranges)
    ]
    return tuple(sorted(fetch, key=lambda f: f.tokens))


def plan_reshard(
    current: ShardMap, next_shards: Sequence[Shard], deadline_ms: int
) -> list[ReshardPlan]:
    """One reshard plan per member of either version, members of v first, in shard order."""
    following = next_shard_map(current, next_shards)
    members = tuple(dict.fromkeys(current.instances + following.instances))
    plans = []
    for member in members:
        held = current.ranges_of(member)
        wanted = following.ranges_of(member)
        plans.append(
            ReshardPlan(
                map=current.map,
                from_version=current.version,
                to_version=following.version,
                deadline_ms=deadline_ms,
                retain=tuple(intersect_ranges(held, wanted)),
                fetch=_sources(subtract_ranges(wanted, held), current),
                release=tuple(subtract_ranges(held, wanted)),
                instance=member,
            )
        )
    return plans
