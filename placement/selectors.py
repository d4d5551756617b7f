"""Reads of the Placement Controller: instances, their live status, and prices (spec 6.3, 6.4)."""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import NamedTuple

import numpy as np
import orjson
from django.db import connection
from django.db.models import Avg, Count, DurationField, ExpressionWrapper, F, Max, Q, Sum
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import TruncMinute
from django.utils import timezone

from common.permissions import may_read_scope
from index.models import CompatDescriptor
from kvsp import cost, pricing
from kvsp.records import InstanceStatusRecord, ResidencyEntry
from placement.models import (
    Directive,
    DirectiveState,
    Instance,
    InstanceState,
    ReshardOperation,
    ReshardPhase,
    ShardMap,
    StatusSample,
    serves,
)


def live_status(instance: Instance, now: datetime) -> InstanceStatusRecord | None:
    """The instance's status record while it is unexpired, else None."""
    if instance.last_status is None or instance.expires_at is None or instance.expires_at <= now:
        return None
    return InstanceStatusRecord.from_json(instance.last_status)


class PricedReplica(NamedTuple):
    """What the cost model reads of a replica: its holder, size and residency."""

    block_key: str
    holder: str
    size: int
    residency: tuple[ResidencyEntry, ...]


@functools.lru_cache(maxsize=1024)
def _residency(residency_json: str) -> tuple[ResidencyEntry, ...]:
    # Stored residency is canonical JSON the IS wrote after validation; a fleet has few shapes.
    return tuple(ResidencyEntry.from_json(entry) for entry in json.loads(residency_json))


def matched_blocks(blocks) -> list[cost.MatchedBlock]:
    """Matched blocks (lists of ``index.selectors.ReplicaRow``, in prefix order) as the cost
    model's input.
    """
    matched = []
    for rows in blocks:
        key = rows[0].block_key.hex()
        replicas = tuple(
            PricedReplica(key, row.holder, row.size, _residency(row.residency_json)) for row in rows
        )
        matched.append(cost.MatchedBlock(key, replicas))
    return matched


def matched_block_table(keys: list[bytes], groups, matched: int) -> pricing.BlockTable:
    """The first ``matched`` of ``keys`` with their replicas (``index.selectors.ReplicaGroup``
    of the lookup) as the fleet's pricing reads them."""
    holders = sorted({group.holder for group in groups})
    shape_index: dict[tuple, int] = {}
    placed = []
    for group in groups:
        positions = np.asarray(group.positions, dtype=np.int64)
        positions = positions[positions < matched]
        if len(positions):
            shape = (group.size, group.residency_json)
            s = shape_index.setdefault(shape, len(shape_index))
            placed.append((group.holder, s, positions))
    shapes = [(size, _residency(residency)) for size, residency in shape_index]
    return pricing.BlockTable.build([k.hex() for k in keys[:matched]], holders, placed, shapes)


def lookup_estimates(
    targets, compat_id: bytes, blocks, *, now: datetime | None = None
) -> tuple[list[dict], list[dict]]:
    """``fetch_us`` and ``recompute_us`` per target (6.2 with 6.4), and the targets the IS could
    not price with the reason, so that a client knows why an estimate is missing.
    """
    now = now or timezone.now()
    descriptor = CompatDescriptor.objects.filter(compat_id=compat_id).only("block_tokens").first()
    if descriptor is None:
        reason = "no Compatibility Descriptor is registered for compat_id"
        return [], [{"target": target, "reason": reason} for target in targets]
    instances = {i.url: i for i in Instance.objects.filter(url__in=list(targets))}
    inputs = matched_blocks(blocks)
    estimates, unpriced = [], []
    for target in targets:
        instance = instances.get(target)
        status = live_status(instance, now) if instance is not None else None
        if status is None:
            reason = "unknown instance" if instance is None else "no unexpired status record"
            unpriced.append({"target": target, "reason": reason})
            continue
        estimate = cost.lookup_estimate(status, inputs, block_tokens=descriptor.block_tokens)
        if estimate is None:
            unpriced.append({"target": target, "reason": "no link to a holder of a matched block"})
        else:
            estimates.append(estimate.to_json())
    return estimates, unpriced


class LinkFigures(NamedTuple):
    holder: str
    mbit_per_s: int | float
    rtt_us: int | float


class LiveStatus(NamedTuple):
    """What pricing and policy read of an accepted, unexpired Instance Status Record: the
    instance row's copy of its figures and the record's links, as the PC stored them after
    validating the record (so not validated again for every placement)."""

    instance: str
    running: int
    queued: int
    batch_size: int
    kv_utilization: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    links: tuple[LinkFigures, ...]


class Candidate(NamedTuple):
    """An instance as placement reads it: enough to price it, name it and send it a directive
    (``Instance.objects.get(pk=...)`` for the row itself)."""

    pk: int
    name: str
    url: str
    state: str


# An instance row as placement reads it: not the whole status record, only its links and the
# one member ``serves`` needs, in the order ``candidates`` takes them.
_CANDIDATE_FIELDS = (
    "id",
    "name",
    "url",
    "state",
    "running",
    "queued",
    "batch_size",
    "kv_utilization",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "compat_ids",
    "reported_compat_ids",
)
# What ``_candidate_rows`` asks of Postgres (the JSON null fails ``last_status = 'null'`` as
# SQL NULL does), written once and read into tuples: a placement reads the whole fleet, and the
# ORM took a third of the time compiling the query, decoding the JSON columns and building model
# instances. The JSON comes as text for orjson.
_SELECT_CANDIDATES = (
    "SELECT id, name, url, state, running, queued, batch_size, kv_utilization, "
    "prefill_tokens_per_s, decode_tokens_per_s, compat_ids::text, reported_compat_ids::text, "
    "(last_status -> 'links')::text, (last_status -> 'engine')::text "
    "FROM placement_instance WHERE expires_at > %s AND state = ANY(%s) "
    "AND NOT (last_status = 'null'::jsonb) ORDER BY name"
)


def _candidate_rows(states, now) -> list[tuple]:
    """The ``_CANDIDATE_FIELDS``, then the links and the engine member of the status record
    (None when absent), of the instances in ``states`` with an unexpired status record, by
    name; the JSON decoded."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_SELECT_CANDIDATES, [now, [str(state) for state in states]])
            rows = cursor.fetchall()
        loads = orjson.loads
        return [
            (
                *row[:10],
                loads(row[10]),
                None if row[11] is None else loads(row[11]),
                loads(row[12]),
                None if row[13] is None else loads(row[13]),
            )
            for row in rows
        ]
    return list(
        Instance.objects.filter(state__in=states, expires_at__gt=now)
        .exclude(last_status=None)
        .annotate(
            status_links=KeyTransform("links", "last_status"),
            status_engine=KeyTransform("engine", "last_status"),
        )
        .values_list(*_CANDIDATE_FIELDS, "status_links", "status_engine")
    )


def candidates(compat_id_hex: str, states=(InstanceState.ACTIVE,), *, now=None):
    """(Candidate, live status) of the instances in ``states`` that serve the compat id."""
    now = now or timezone.now()
    for row in _candidate_rows(states, now):
        pk, name, url, state, running, queued, batch_size, kv_utilization = row[:8]
        prefill, decode, compat_ids, reported, links, engine = row[8:]
        if not serves(compat_id_hex, compat_ids, reported, engine=engine):
            continue
        yield (
            Candidate(pk, name, url, state),
            LiveStatus(
                url,
                running,
                queued,
                batch_size,
                kv_utilization,
                prefill,
                decode,
                tuple(
                    LinkFigures(link["holder"], link["mbit_per_s"], link["rtt_us"])
                    for link in links
                ),
            ),
        )


def instance_urls(name: str, among: Collection[str] | None = None) -> set[str]:
    """The URLs of the instance ``name``, among ``among`` when given: what the index asks to
    know where a principal bound to an instance publishes (``index.authz.instance_urls``)."""
    rows = Instance.objects.filter(name=name)
    if among is not None:
        rows = rows.filter(url__in=list(among))
    return set(rows.values_list("url", flat=True))


def instance_json(instance: Instance, *, now=None) -> dict:
    """An instance as the API and the dashboard show it."""
    now = now or timezone.now()
    age_ms = (
        int((now - instance.last_report_at).total_seconds() * 1000)
        if instance.last_report_at
        else None
    )
    return {
        "name": instance.name,
        "url": instance.url,
        "state": instance.state,
        "epoch": instance.epoch,
        "compat_ids": sorted(set(instance.compat_ids) | set(instance.reported_compat_ids or ())),
        "running": instance.running,
        "queued": instance.queued,
        "batch_size": instance.batch_size,
        "kv_utilization": instance.kv_utilization,
        "prefill_tokens_per_s": instance.prefill_tokens_per_s,
        "decode_tokens_per_s": instance.decode_tokens_per_s,
        "links": instance.links,
        "requested_state": instance.requested_state or None,
        "last_report_age_ms": age_ms,
        "live": instance.expires_at is not None and instance.expires_at > now,
        "restarts": instance.restarts,
        "state_pushed": instance.pushed_state_version >= instance.state_version,
    }


# --- The operator's view: the dashboard and /metrics read these --------------------------------


def instance_by_name(name: str) -> Instance | None:
    return Instance.objects.filter(name=name).first()


def instance_figures(instance: Instance, *, now=None) -> dict:
    """An instance as ``instance_json`` shows it, with its load: (running + queued) per slot of
    its batch (1.0 is a full batch and no queue)."""
    document = instance_json(instance, now=now)
    document["load"] = (instance.running + instance.queued) / (instance.batch_size or 1)
    return document


def instances(*, now=None) -> list[dict]:
    """Every instance, as ``instance_figures`` shows it."""
    now = now or timezone.now()
    return [instance_figures(instance, now=now) for instance in Instance.objects.all()]


def instance_state_counts() -> dict[str, int]:
    """Instances per lifecycle state, every state present (zero when none)."""
    counts = dict.fromkeys(InstanceState.values, 0)
    for row in Instance.objects.values("state").annotate(n=Count("pk")):
        counts[row["state"]] = row["n"]
    return counts


def status_samples(instance: Instance, since: datetime) -> list[StatusSample]:
    """An instance's sampled figures from ``since`` on, oldest first."""
    return list(instance.samples.filter(at__gte=since).order_by("at"))


def cluster_load(since: datetime) -> list[dict]:
    """Per minute since ``since``: running and queued requests summed over instances (each
    instance's mean over the minute) and the mean KV utilization of the instances sampled."""
    rows = (
        StatusSample.objects.filter(at__gte=since)
        .annotate(minute=TruncMinute("at"))
        .values("minute", "instance_id")
        .annotate(running=Avg("running"), queued=Avg("queued"), kv=Avg("kv_utilization"))
        .order_by("minute")
    )
    minutes: dict[datetime, dict] = defaultdict(
        lambda: {"running": 0.0, "queued": 0.0, "kv": 0.0, "instances": 0}
    )
    for row in rows:
        minute = minutes[row["minute"]]
        minute["running"] += row["running"]
        minute["queued"] += row["queued"]
        minute["kv"] += row["kv"]
        minute["instances"] += 1
    return [
        {
            "minute": minute,
            "running": figures["running"],
            "queued": figures["queued"],
            "kv_utilization": figures["kv"] / figures["instances"],
        }
        for minute, figures in minutes.items()
    ]


def _directives(instance: Instance | None):
    directives = Directive.objects.all()
    return directives if instance is None else directives.filter(instance=instance)


def _with_latency(queryset):
    return queryset.annotate(
        latency=ExpressionWrapper(F("finished_at") - F("created_at"), output_field=DurationField())
    )


def directive_state_counts(instance: Instance | None = None) -> dict[str, int]:
    """Prefetch directives (6.5) per state, every state present."""
    counts = dict.fromkeys(DirectiveState.values, 0)
    for row in _directives(instance).values("state").annotate(n=Count("pk")):
        counts[row["state"]] = row["n"]
    return counts


def recent_directives(limit: int = 20, *, instance: Instance | None = None) -> list[Directive]:
    """The latest prefetch directives, newest first, with their instance."""
    return list(_directives(instance).select_related("instance").order_by("-created_at")[:limit])


def prefetch_latency(since: datetime, *, instance: Instance | None = None) -> list[dict]:
    """Per minute since ``since``: directives finished, and their mean and longest time from
    being recorded to a final state, in milliseconds."""
    rows = (
        _with_latency(_directives(instance).filter(finished_at__gte=since))
        .annotate(minute=TruncMinute("finished_at"))
        .values("minute")
        .annotate(finished=Count("pk"), mean=Avg("latency"), longest=Max("latency"))
        .order_by("minute")
    )
    return [
        {
            "minute": row["minute"],
            "finished": row["finished"],
            "mean_ms": row["mean"].total_seconds() * 1000,
            "max_ms": row["longest"].total_seconds() * 1000,
        }
        for row in rows
    ]


def prefetch_latency_histogram(bounds_s: tuple[float, ...]) -> dict:
    """Finished directives by latency: cumulative counts at or below each bound (seconds), the
    count and the sum of all latencies in seconds, per final state."""
    aggregates = {"count": Count("pk"), "sum": Sum("latency")}
    for position, bound in enumerate(bounds_s):
        aggregates[f"le_{position}"] = Count("pk", filter=Q(latency__lte=timedelta(seconds=bound)))
    rows = (
        _with_latency(Directive.objects.filter(finished_at__isnull=False))
        .values("state")
        .annotate(**aggregates)
        .order_by("state")
    )
    return {
        row["state"]: {
            "buckets": [row[f"le_{position}"] for position in range(len(bounds_s))],
            "count": row["count"],
            "sum_s": row["sum"].total_seconds() if row["sum"] is not None else 0.0,
        }
        for row in rows
    }


def shard_maps() -> list[ShardMap]:
    return list(ShardMap.objects.all())


def _may_read_contexts(principal, *contexts: dict | None) -> bool:
    """A Shard Map's context names a scope's Block Keys and the instances that hold them: only
    a principal that may read that scope sees it. A map without a context names no scope."""
    return all(
        may_read_scope(principal, bytes.fromhex(context["scope_id"]))
        for context in contexts
        if context is not None
    )


def readable_shard_map(principal, map_id: str) -> ShardMap | None:
    """The Shard Map ``map_id``, or None when there is none or its context is a scope the
    principal may not read (the two answer alike)."""
    row = ShardMap.objects.filter(map=map_id).first()
    if row is None or not _may_read_contexts(principal, row.context):
        return None
    return row


def readable_reshard(principal, map_id: str, to_version: int) -> ReshardOperation | None:
    """The latest attempt of the move of ``map_id`` to ``to_version``, or None when there is
    none or the map's context or the operation's is a scope the principal may not read."""
    operation = (
        ReshardOperation.objects.select_related("shard_map")
        .filter(shard_map__map=map_id, to_version=to_version)
        .order_by("-attempt")
        .first()
    )
    if operation is None or not _may_read_contexts(
        principal, operation.shard_map.context, operation.next_context
    ):
        return None
    return operation


def reshard_operation(operation_id: int) -> ReshardOperation | None:
    return ReshardOperation.objects.select_related("shard_map").filter(pk=operation_id).first()


def recent_reshard_operations(limit: int = 20) -> list[ReshardOperation]:
    """Reshard operations (6.9), those still preparing first, then the latest."""
    operations = ReshardOperation.objects.select_related("shard_map")
    preparing = list(operations.filter(phase=ReshardPhase.PREPARING).order_by("started_at"))
    done = operations.exclude(phase=ReshardPhase.PREPARING).order_by("-started_at")
    return preparing + list(done[: max(limit - len(preparing), 0)])


def reshard_phase_counts() -> dict[str, int]:
    counts = dict.fromkeys(ReshardPhase.values, 0)
    for row in ReshardOperation.objects.values("phase").annotate(n=Count("pk")):
        counts[row["phase"]] = row["n"]
    return counts
