"""Reads of the Placement Controller: instances, their status, and prices (spec 6.3, 6.4)."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from index.models import CompatDescriptor
from kvsp import cost
from kvsp.records import InstanceStatusRecord
from placement.models import Instance


def live_status(instance: Instance, now: datetime) -> InstanceStatusRecord | None:
    """The instance's status record while it is unexpired, else None."""
    if instance.last_status is None or instance.expires_at is None or instance.expires_at <= now:
        return None
    return InstanceStatusRecord.from_json(instance.last_status)


def matched_blocks(blocks) -> list[cost.MatchedBlock]:
    """The matched blocks (lists of ``index.selectors.ReplicaRow``) as the cost model's input."""
    return [
        cost.MatchedBlock(rows[0].block_key.hex(), tuple(row.record() for row in rows))
        for rows in blocks
    ]


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
