"""Reads of the Placement Controller: instances, their live status, and prices (spec 6.3, 6.4)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import NamedTuple

from django.utils import timezone

from index.models import CompatDescriptor
from kvsp import cost
from kvsp.records import InstanceStatusRecord, ResidencyEntry
from placement.models import Instance, InstanceState


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


def candidates(compat_id_hex: str, states=(InstanceState.ACTIVE,), *, now=None):
    """(instance, live status) of the instances in ``states`` that serve the compat id."""
    now = now or timezone.now()
    for instance in Instance.objects.filter(state__in=states):
        if not instance.serves(compat_id_hex):
            continue
        status = live_status(instance, now)
        if status is not None:
            yield instance, status


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
        "compat_ids": sorted(set(instance.compat_ids) | set(instance.reported_compat_ids)),
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
