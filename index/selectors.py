"""Reads of the Index Service: replica records of keys, and prefix lookup (spec 6.1, 6.2).

Lookup is the hot path measured in bench/: one query per request whatever the number of keys,
raw rows in Postgres' binary format, and Replica Records written straight to JSON fragments
(the residency column already holds canonical JSON) without model instances or dicts.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NamedTuple

import orjson
from django.db import connection
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from common.permissions import may_read_scope
from index import metrics
from index.models import CompatDescriptor, Holder, LookupBucket, Replica, Scope, Tier
from kvsp.records import LookupRequest

_SELECT_REPLICAS = (
    "SELECT r.block_key, h.url, r.codec, r.size, r.digest, r.layer_digests, r.residency, "
    "r.moqt_namespace, r.expires_at "
    "FROM index_replica r JOIN index_holder h ON h.id = r.holder_id "
    "WHERE r.scope_id = %s AND r.compat_id = %s AND r.expires_at > %s AND r.block_key "
)
_SQLITE_CHUNK = 900  # below SQLite's smallest limit on bound parameters per statement


def _rows_for_keys(compat_id: bytes, scope_id: bytes, keys: list[bytes], now: datetime) -> list:
    if connection.vendor == "postgresql":
        import psycopg

        connection.ensure_connection()
        # Binary results (which need server-side binding, not Django's client-side cursors):
        # bytea and timestamptz arrive without text decoding.
        with psycopg.Cursor(connection.connection) as cursor:
            cursor.execute(
                _SELECT_REPLICAS + "= ANY(%b)", [scope_id, compat_id, now, keys], binary=True
            )
            return cursor.fetchall()
    rows = []
    now_param = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        for start in range(0, len(keys), _SQLITE_CHUNK):
            chunk = keys[start : start + _SQLITE_CHUNK]
            placeholders = ", ".join(["%s"] * len(chunk))
            cursor.execute(
                _SELECT_REPLICAS + f"IN ({placeholders})", [scope_id, compat_id, now_param, *chunk]
            )
            rows += cursor.fetchall()
    return rows


@functools.lru_cache(maxsize=4096)
def _json_string(value: str) -> str:
    return orjson.dumps(value).decode()


def _aware(value) -> datetime:
    if isinstance(value, str):  # SQLite
        value = datetime.fromisoformat(value)
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


class ReplicaRow(NamedTuple):
    """One unexpired replica as stored, and the two forms it leaves in: JSON and a record."""

    compat_hex: str
    scope_hex: str
    block_key: bytes
    holder: str
    codec: int
    size: int
    digest: bytes
    layer_digests: bytes
    residency_json: str
    moqt_namespace: str
    ttl_ms: int

    def fragment(self) -> orjson.Fragment:
        """The Replica Record as JSON, written without building a dict per record."""
        text = (
            f'{{"block_key":"{self.block_key.hex()}","compat_id":"{self.compat_hex}",'
            f'"scope_id":"{self.scope_hex}","holder":{_json_string(self.holder)},'
            f'"codec":{self.codec},"size":{self.size},"digest":"sha-256:{self.digest.hex()}",'
            f'"residency":{self.residency_json},"ttl_ms":{self.ttl_ms}'
        )
        if self.layer_digests:
            # One C-level pass: hex with a separator every 32 octets, then quote the pieces.
            hexed = self.layer_digests.hex(",", 32).replace(",", '","')
            text += f',"layer_digests":["{hexed}"]'
        if self.moqt_namespace:
            text += f',"moqt_namespace":{_json_string(self.moqt_namespace)}'
        return orjson.Fragment(text + "}")


def replica_rows_by_key(
    principal, compat_id: bytes, scope_id: bytes, keys: list[bytes], *, now=None
) -> dict[bytes, list[ReplicaRow]]:
    """The unexpired replicas of each key, for a principal; a scope it may not read yields
    nothing, exactly like a scope with no replicas, and without touching the rows.
    """
    if not may_read_scope(principal, scope_id):
        return {}
    now = now or timezone.now()
    compat_hex, scope_hex = compat_id.hex(), scope_id.hex()
    found: dict[bytes, list[ReplicaRow]] = defaultdict(list)
    aware = connection.vendor == "postgresql"
    for key, holder, codec, size, digest, layers, residency, moqt, expires in _rows_for_keys(
        compat_id, scope_id, keys, now
    ):
        remaining = (expires if aware else _aware(expires)) - now
        ttl_ms = max(remaining.days * 86_400_000 + remaining.seconds * 1000, 1)
        key = bytes(key)
        found[key].append(
            ReplicaRow(
                compat_hex,
                scope_hex,
                key,
                holder,
                codec,
                size,
                digest,
                layers,
                residency,
                moqt,
                ttl_ms,
            )
        )
    for replicas in found.values():
        replicas.sort(key=lambda row: row.holder)
    return found


class ReplicaGroup(NamedTuple):
    """The looked-up keys (by position) of which one holder has replicas of one shape: what the
    cost model reads of them (kvsp.pricing.BlockTable)."""

    holder: str
    size: int
    residency_json: str
    positions: list[int]


_SELECT_GROUPS = """
SELECT h.url, g.size, g.residency, g.positions FROM (
    SELECT r.holder_id, r.size, r.residency, array_agg(k.i) AS positions
    FROM generate_series(0, %(count)s - 1) k(i)
    JOIN index_replica r ON r.block_key = substring(%(keys)b FROM 1 + 32 * k.i FOR 32)
    WHERE r.scope_id = %(scope)b AND r.compat_id = %(compat)b AND r.expires_at > %(now)s
    GROUP BY r.holder_id, r.size, r.residency
) g JOIN index_holder h ON h.id = g.holder_id
"""


def replica_groups(
    principal, compat_id: bytes, scope_id: bytes, keys: list[bytes], *, now=None
) -> list[ReplicaGroup]:
    """The unexpired replicas of ``keys`` grouped by holder and shape, for a principal (as
    ``replica_rows_by_key`` judges it). Placement prices a prompt from these: on Postgres a
    handful of rows, not one per replica, and none of the digests it does not read.
    """
    if not may_read_scope(principal, scope_id):
        return []
    now = now or timezone.now()
    if connection.vendor != "postgresql":
        position = {key: p for p, key in enumerate(keys)}
        groups: dict[tuple, list[int]] = defaultdict(list)
        for row in _rows_for_keys(compat_id, scope_id, keys, now):
            groups[(row[1], row[3], row[6])].append(position[bytes(row[0])])
        return [ReplicaGroup(*shape, positions) for shape, positions in groups.items()]
    import psycopg

    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        # The keys go as one value (Block Keys are 32 octets), split by the server, and each
        # replica comes back as the position of its key: a list of thousands of values costs
        # more to send, either way, than the query takes.
        parameters = {
            "keys": b"".join(keys),
            "count": len(keys),
            "scope": scope_id,
            "compat": compat_id,
            "now": now,
        }
        cursor.execute(_SELECT_GROUPS, parameters, binary=True)
        return [ReplicaGroup(*row) for row in cursor.fetchall()]


def matched_prefix_of_groups(count: int, groups: list[ReplicaGroup]) -> int:
    """``matched_prefix`` of ``count`` keys from their groups: the first position none covers."""
    covered = bytearray(count)
    for group in groups:
        for position in group.positions:
            covered[position] = 1
    gap = covered.find(0)
    return count if gap < 0 else gap


def matched_prefix(keys: list[bytes], found: dict[bytes, list]) -> int:
    """Leading keys with at least one replica; Block Keys are chained, so stop at the first gap."""
    for position, key in enumerate(keys):
        if key not in found:
            return position
    return len(keys)


# (targets, compat_id, the matched keys' replicas in order, now=) -> (estimates, unpriced): the
# fetch and recompute estimates of 6.4 per target, and the targets that could not be priced.
PriceTargets = Callable[..., tuple[list[dict], list[dict]]]


def lookup(principal, request: LookupRequest, *, estimate: PriceTargets, now=None) -> dict:
    """The answer to ``POST lookup`` (spec 6.2, DESIGN.md section 3), its estimates per target
    made by ``estimate``: the Placement Controller's cost model, which its caller passes in
    (``placement.api.views.LookupView``)."""
    now = now or timezone.now()
    compat_id, scope_id = bytes.fromhex(request.compat_id), bytes.fromhex(request.scope_id)
    keys = list(map(bytes.fromhex, request.block_keys))
    found = replica_rows_by_key(principal, compat_id, scope_id, keys, now=now)
    matched = matched_prefix(keys, found)
    metrics.observe_lookup(
        "lookup",
        len(keys),
        matched,
        metrics.hit_tiers(found[key] for key in keys[:matched]),
        compat_id=compat_id,
    )
    answer = {
        "matched": matched,
        "blocks": [
            {"block_key": request.block_keys[i], "replicas": [r.fragment() for r in found[key]]}
            for i, key in enumerate(keys[:matched])
        ],
    }
    if request.targets is not None:
        answer["estimates"], answer["unpriced"] = estimate(
            request.targets, compat_id, [found[key] for key in keys[:matched]], now=now
        )
    return answer


def descriptor(compat_id: bytes) -> CompatDescriptor | None:
    return CompatDescriptor.objects.filter(compat_id=compat_id).first()


def scope_for(principal, scope_id: bytes) -> Scope | None:
    """The scope, if the principal may read it; otherwise None, as if it did not exist."""
    if not may_read_scope(principal, scope_id):
        return None
    return Scope.objects.filter(scope_id=scope_id).first()


# --- The operator's view: the dashboard and /metrics read these --------------------------------


def _live_replicas(now: datetime):
    return Replica.objects.filter(expires_at__gt=now)


def _with_tier_bits(queryset):
    """Annotate each replica with one field per tier: nonzero when some layers are in it."""
    return queryset.annotate(**{f"in_{t.label}": F("tier_mask").bitand(t.value) for t in Tier})


def _tier_aggregates() -> dict:
    aggregates = {"replicas": Count("pk"), "octets": Sum("size")}
    for tier in Tier:
        held = Q(**{f"in_{tier.label}__gt": 0})
        aggregates[f"{tier.label}_replicas"] = Count("pk", filter=held)
        aggregates[f"{tier.label}_octets"] = Sum("size", filter=held)
    return aggregates


def _tier_figures(row: dict) -> dict:
    return {
        "replicas": row["replicas"],
        "octets": row["octets"] or 0,
        "tiers": {
            tier.label: {
                "replicas": row[f"{tier.label}_replicas"],
                "octets": row[f"{tier.label}_octets"] or 0,
            }
            for tier in Tier
        },
    }


def replica_tier_totals(*, holder_id: int | None = None, now=None) -> dict:
    """Unexpired replicas and their octets, in all and per tier, at every holder or at one; a
    replica whose layers lie in two tiers counts in both."""
    now = now or timezone.now()
    replicas = _live_replicas(now)
    if holder_id is not None:
        replicas = replicas.filter(holder_id=holder_id)
    return _tier_figures(_with_tier_bits(replicas).aggregate(**_tier_aggregates()))


# The most pages of the replica table a scrape reads for the figures of ``replica_tier_figures``:
# past that they are estimated from a sample of this many pages, so that a scrape costs the same
# however many replicas there are (BENCHMARKS.md, "Metrics").
SCRAPE_SAMPLE_PAGES = 512

_TABLE_SIZE = """
SELECT pg_relation_size(c.oid) / current_setting('block_size')::bigint, c.reltuples, c.relpages
FROM pg_class c WHERE c.oid = 'index_replica'::regclass
"""
_LIVE = "expires_at > %s"
_SAMPLED_TIER_TOTALS = """
SELECT count(*), count(*) FILTER (WHERE {live}), coalesce(sum(size) FILTER (WHERE {live}), 0),
    {tiers}
FROM index_replica TABLESAMPLE SYSTEM (%s)
"""


def replica_tier_figures(*, now=None, sample_pages: int | None = None) -> tuple[dict, float]:
    """``replica_tier_totals`` of every holder, and the fraction of the replica table read for
    them: 1.0 when they are exact. A table larger than ``sample_pages`` (Postgres) is sampled
    (``TABLESAMPLE SYSTEM``: each page with the same chance), and the figures are the sample's
    share of its rows times the rows the table holds, as the planner estimates them (rows per
    page at the last ANALYZE times the pages now), which varies far less than the number of
    pages a sample happens to take."""
    now = now or timezone.now()
    sample_pages = SCRAPE_SAMPLE_PAGES if sample_pages is None else sample_pages
    if connection.vendor != "postgresql":
        return replica_tier_totals(now=now), 1.0
    with connection.cursor() as cursor:
        cursor.execute(_TABLE_SIZE)
        pages, analyzed_rows, analyzed_pages = cursor.fetchone()
        if pages <= sample_pages:
            return replica_tier_totals(now=now), 1.0
        fraction = sample_pages / pages
        held = [f"tier_mask & {t.value} > 0" for t in Tier]
        tiers = ", ".join(
            f"count(*) FILTER (WHERE {_LIVE} AND {h}), "
            f"coalesce(sum(size) FILTER (WHERE {_LIVE} AND {h}), 0)"
            for h in held
        )
        query = _SAMPLED_TIER_TOTALS.format(live=_LIVE, tiers=tiers)
        cursor.execute(query, [now] * (2 + 2 * len(held)) + [100.0 * fraction])
        sampled, *figures = (int(value) for value in cursor.fetchone())
    if analyzed_pages > 0 and analyzed_rows >= 0:
        rows = analyzed_rows / analyzed_pages * pages
    else:  # never analyzed: the sample's rows scaled by its expected share of the pages
        rows = sampled / fraction
    scale = rows / sampled if sampled else 0.0
    replicas, octets, *per_tier = (round(figure * scale) for figure in figures)
    totals = {
        "replicas": replicas,
        "octets": octets,
        "tiers": {
            tier.label: {"replicas": per_tier[2 * i], "octets": per_tier[2 * i + 1]}
            for i, tier in enumerate(Tier)
        },
    }
    return totals, fraction


def replicas_by_holder(*, now=None) -> list[dict]:
    """Per holder: its id and URL, and the figures of ``replica_tier_totals`` for its replicas."""
    now = now or timezone.now()
    rows = (
        _with_tier_bits(_live_replicas(now))
        .values("holder_id", "holder__url")
        .annotate(**_tier_aggregates())
        .order_by("holder__url")
    )
    return [{"id": r["holder_id"], "url": r["holder__url"], **_tier_figures(r)} for r in rows]


def holder_by_id(holder_id: int) -> Holder | None:
    return Holder.objects.filter(pk=holder_id).first()


def holder_by_url(url: str) -> Holder | None:
    return Holder.objects.filter(url=url).first()


def holder_replicas(holder_id: int, *, tier: Tier | None = None, limit: int = 200, now=None):
    """A holder's unexpired replicas, the most recently refreshed first."""
    now = now or timezone.now()
    replicas = _live_replicas(now).filter(holder_id=holder_id)
    if tier is not None:
        replicas = _with_tier_bits(replicas).filter(**{f"in_{tier.label}__gt": 0})
    return list(replicas.order_by("-refreshed_at")[:limit])


def replica_ids_at(holder_id: int, replica_ids) -> list[int]:
    """Those of the given replica ids that are replicas at the holder."""
    rows = Replica.objects.filter(holder_id=holder_id, pk__in=list(replica_ids))
    return list(rows.values_list("pk", flat=True))


def lookup_buckets(since: datetime) -> list[LookupBucket]:
    """The per-minute lookup counts from ``since`` on, oldest first."""
    return list(LookupBucket.objects.filter(minute__gte=since).order_by("minute"))


def lookup_totals(since: datetime) -> dict:
    """Lookups, hits, Block Keys asked and matched since a time, summed over minutes."""
    row = LookupBucket.objects.filter(minute__gte=since).aggregate(
        lookups=Sum("lookups"),
        hits=Sum("hits"),
        block_keys=Sum("block_keys"),
        matched_blocks=Sum("matched_blocks"),
    )
    totals = {name: value or 0 for name, value in row.items()}
    keys = totals["block_keys"]
    totals["matched_ratio"] = totals["matched_blocks"] / keys if keys else None
    return totals
