"""The Index Service's metrics: lookups as they happen, and the replicas the index holds."""

from __future__ import annotations

import collections
import functools
from datetime import datetime

from django.core.signals import request_finished
from django.db import transaction
from django.utils import timezone
from prometheus_client import Counter, Histogram

from common.metrics import (
    PerUnit,
    TalliedCounter,
    Tally,
    count_all,
    database_figures,
    gauge,
    unit_sizes,
)
from index.models import CompatDescriptor
from kvsp.reasons import LOOKUP_STOPS, TIERS, fastest_tier, tier_rank

LOOKUPS = Counter(
    "kvsp_lookups",
    "Prefix lookups in the index (6.2): POST lookup, and the lookup of each placement.",
    ["source"],
)
LOOKUP_BLOCK_KEYS = Counter(
    "kvsp_lookup_block_keys", "Block Keys asked for in lookups.", ["source"]
)
LOOKUP_MATCHED_BLOCKS = Counter(
    "kvsp_lookup_matched_blocks", "Block Keys of the matched prefix of lookups.", ["source"]
)
LOOKUP_MATCHED_RATIO = Histogram(
    "kvsp_lookup_matched_ratio",
    "Per lookup, the matched prefix as a fraction of the Block Keys asked for.",
    ["source"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
)


# What lookups asked for and where they hit, named as vLLM names its prefix cache's figures
# (vllm:prefix_cache_queries, vllm:prefix_cache_hits) where the meaning is the same. ``source``
# is ``lookup`` (POST lookup) or ``placement``. A placement knows its prompt's tokens; a lookup
# names Block Keys only, and its blocks become tokens when the tally is written
# (``BLOCK_TOKENS``), so that the lookup reads nothing more than its replicas.
PREFIX_CACHE_QUERIES = TalliedCounter(
    "kvsp_prefix_cache_queries", "Prompt tokens looked up in the index.", ["source"]
)
PREFIX_CACHE_HITS = TalliedCounter(
    "kvsp_prefix_cache_hits",
    "Prompt tokens of the matched prefix, by the fastest tier among each block's replicas.",
    ["source", "tier"],
)
PREFIX_CACHE_QUERY_BLOCKS = TalliedCounter(
    "kvsp_prefix_cache_query_blocks", "Block Keys looked up in the index.", ["source"]
)
PREFIX_CACHE_HIT_BLOCKS = TalliedCounter(
    "kvsp_prefix_cache_hit_blocks",
    "Blocks of the matched prefix, by the fastest tier among each block's replicas.",
    ["source", "tier"],
)
PREFIX_CACHE_STOPS = TalliedCounter(
    "kvsp_prefix_cache_stops",
    "Lookups whose chain of Block Keys stopped before its end, by why (kvsp.reasons).",
    ["source", "reason"],
)
PREFIX_CACHE_MISSED_BLOCKS = TalliedCounter(
    "kvsp_prefix_cache_missed_blocks",
    "Block Keys asked for at and after the stop of a lookup's chain, by why it stopped.",
    ["source", "reason"],
)


# Blocks of a compat id, in tokens: the ``block_tokens`` of its Compatibility Descriptor.
BLOCK_TOKENS = "block_tokens"

# compat_id -> block_tokens, for this process: a descriptor is stored under the id computed
# from it (4.1), so what a compat id's blocks hold never changes.
_block_tokens: dict[bytes, int] = {}


@unit_sizes(BLOCK_TOKENS)
def block_tokens_of(compat_ids: set[bytes]) -> dict[bytes, int]:
    """The tokens of a block of each compat id registered; one query for those not seen yet."""
    unseen = compat_ids - _block_tokens.keys()
    if unseen:
        rows = CompatDescriptor.objects.filter(compat_id__in=list(unseen))
        for compat_id, block_tokens in rows.values_list("compat_id", "block_tokens"):
            _block_tokens[bytes(compat_id)] = block_tokens
    return {c: _block_tokens[c] for c in compat_ids if c in _block_tokens}


def hit_tiers(replica_lists) -> list[int]:
    """Blocks per tier of ``TIERS``: each block (its list of replicas, ``ReplicaRow``s) counted
    in the fastest tier any of its replicas has layers in. On the lookup's hot path: blocks are
    first counted by their replicas' residencies (a handful of distinct ones), in C."""
    shapes = collections.Counter(
        replicas[0].residency_json
        if len(replicas) == 1
        else tuple(replica.residency_json for replica in replicas)
        for replicas in replica_lists
    )
    counts = [0] * len(TIERS)
    for shape, blocks in shapes.items():
        residencies = (shape,) if isinstance(shape, str) else shape
        counts[min(tier_rank(fastest_tier(residency)) for residency in residencies)] += blocks
    return counts


# --- Lookup outcomes, for /metrics and for the dashboard's hit ratio over time ----------------

# How often a process writes the lookups it counted to the database (index.LookupBucket).
LOOKUP_WRITE_INTERVAL_S = 1.0


# The lookups of a minute as index.LookupBucket adds them up, in the order of its columns.
_BUCKET_COLUMNS = ("lookups", "hits", "block_keys", "matched_blocks")


def _write_lookups(pending: dict) -> None:
    """``Tally`` writer: each minute's counts added to its bucket, one upsert per minute, all or
    none (the tally keeps what a failed write held, to try again)."""
    from index.services import do_record_lookups  # services import this module

    minutes: dict[datetime, dict[str, int]] = {}
    for (minute, column), count in pending.items():
        minutes.setdefault(minute, dict.fromkeys(_BUCKET_COLUMNS, 0))[column] += count
    with transaction.atomic():
        for minute, counts in sorted(minutes.items()):
            do_record_lookups(minute, **counts)


# Lookups this process counted and has not yet added to ``index.LookupBucket`` (the dashboard's
# hit ratio over time): written as ``common.metrics.Tally`` writes, after a response.
lookup_tally = Tally(_write_lookups, lambda: LOOKUP_WRITE_INTERVAL_S)
request_finished.connect(lookup_tally.write_if_due, dispatch_uid="kvsp-lookup-tally")


@functools.cache
def _tallied_series(source: str) -> tuple:
    (stop,) = LOOKUP_STOPS
    return (
        PREFIX_CACHE_QUERY_BLOCKS.series(source),
        [PREFIX_CACHE_HIT_BLOCKS.series(source, tier) for tier in TIERS],
        PREFIX_CACHE_QUERIES.series(source),
        [PREFIX_CACHE_HITS.series(source, tier) for tier in TIERS],
        PREFIX_CACHE_STOPS.series(source, stop),
        PREFIX_CACHE_MISSED_BLOCKS.series(source, stop),
    )


@functools.lru_cache(maxsize=256)
def _token_series(source: str, compat_id: bytes) -> tuple:
    """The series of a lookup's tokens, in blocks of ``compat_id`` (the compat ids in use are
    few; a client's made-up ones only take turns in the cache)."""
    _, _, queries, hits, _, _ = _tallied_series(source)
    return PerUnit(queries, BLOCK_TOKENS, compat_id), [
        PerUnit(hit, BLOCK_TOKENS, compat_id) for hit in hits
    ]


@functools.cache
def _lookup_series(source: str) -> tuple:
    # Resolving labels costs more than counting: once per source, not once per lookup.
    return (
        LOOKUPS.labels(source),
        LOOKUP_BLOCK_KEYS.labels(source),
        LOOKUP_MATCHED_BLOCKS.labels(source),
        LOOKUP_MATCHED_RATIO.labels(source),
    )


def observe_lookup(
    source: str,
    block_keys: int,
    matched: int,
    tiers: list[int] = (),
    *,
    prompt_tokens: int = 0,
    block_tokens: int = 0,
    compat_id: bytes | None = None,
) -> None:
    """One prefix lookup of ``block_keys`` keys whose first ``matched`` matched (6.2), those
    in each of ``TIERS`` as ``hit_tiers`` counts them; in tokens as well, from
    ``prompt_tokens`` and ``block_tokens`` when the caller knows them, else from the blocks of
    ``compat_id`` when the tally is written."""
    lookups, keys, matched_blocks, ratio = _lookup_series(source)
    lookups.inc()
    keys.inc(block_keys)
    matched_blocks.inc(matched)
    if block_keys:
        ratio.observe(matched / block_keys)
    now = timezone.now()
    lookup_tally.add(
        (
            ("lookups", 1),
            ("hits", 1 if matched else 0),
            ("block_keys", block_keys),
            ("matched_blocks", matched),
        ),
        now,
    )
    query_blocks, hit_blocks, queries, hits, stops, missed = _tallied_series(source)
    counts = [(query_blocks, block_keys), *zip(hit_blocks, tiers, strict=False)]
    if prompt_tokens:
        counts.append((queries, prompt_tokens))
        hit_tokens = (blocks * block_tokens for blocks in tiers)
        counts += zip(hits, hit_tokens, strict=False)
    elif compat_id is not None:
        query_tokens, hit_tokens = _token_series(source, compat_id)
        counts.append((query_tokens, block_keys))
        counts += zip(hit_tokens, tiers, strict=False)
    if matched < block_keys:
        counts += ((stops, 1), (missed, block_keys - matched))
    count_all(counts, now)


@database_figures("control")
def replica_figures(now):
    from index import selectors  # selectors import this module

    # Read at every scrape: estimated from a sample past a size, so a scrape's cost does not
    # grow with the number of replicas.
    totals, fraction = selectors.replica_tier_figures(now=now)
    yield gauge(
        "kvsp_replica_figures_sampled_fraction",
        "The fraction of the replica table the replica gauges were read from: 1 when exact, "
        "less when they are estimates from a sample of its pages.",
        (),
        [((), fraction)],
    )
    yield gauge(
        "kvsp_replicas", "Unexpired replicas in the index (6.1).", (), [((), totals["replicas"])]
    )
    yield gauge(
        "kvsp_replica_octets", "Octets of the unexpired replicas.", (), [((), totals["octets"])]
    )
    tiers = totals["tiers"].items()
    yield gauge(
        "kvsp_tier_replicas",
        "Unexpired replicas with layers in a tier (a replica may count in several).",
        ["tier"],
        (((tier,), figures["replicas"]) for tier, figures in tiers),
    )
    yield gauge(
        "kvsp_tier_replica_octets",
        "Octets of the unexpired replicas with layers in a tier.",
        ["tier"],
        (((tier,), figures["octets"]) for tier, figures in tiers),
    )
