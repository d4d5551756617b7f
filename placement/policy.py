"""The Placement Controller's local policy (spec 6.3, 6.4): the knobs the spec leaves to it.

Each rule reads its thresholds from settings, so an operator tunes them without code changes.
"""

from __future__ import annotations

from django.conf import settings

from kvsp.cost import CostBreakdown
from kvsp.records import InstanceStatusRecord
from placement.models import Instance, InstanceState


def accept_sleep(instance: Instance, record: InstanceStatusRecord) -> bool:
    """Whether to let an instance that asks to sleep drain (spec 6.3).

    Accepted when its load is at most ``KVSP_SLEEP_MAX_RUNNING`` running plus queued requests
    and at least ``KVSP_SLEEP_MIN_ACTIVE`` other instances stay active.
    """
    if record.running + record.queued > settings.KVSP_SLEEP_MAX_RUNNING:
        return False
    others = Instance.objects.filter(state=InstanceState.ACTIVE).exclude(pk=instance.pk).count()
    return others >= settings.KVSP_SLEEP_MIN_ACTIVE


def has_capacity(status: InstanceStatusRecord) -> bool:
    """Whether an instance can take one more request (spec 6.4 "acceptable capacity")."""
    if status.kv_utilization >= settings.KVSP_PLACEMENT_MAX_KV_UTILIZATION:
        return False
    if status.batch_size and status.running + status.queued >= (
        status.batch_size * settings.KVSP_PLACEMENT_MAX_QUEUE_FACTOR
    ):
        return False
    return True


def acceptable(status: InstanceStatusRecord, breakdown: CostBreakdown) -> bool:
    """Acceptable cost and capacity; ``KVSP_PLACEMENT_MAX_COST_US`` of 0 sets no cost limit."""
    limit = settings.KVSP_PLACEMENT_MAX_COST_US
    return has_capacity(status) and (not limit or breakdown.cost_us <= limit)
