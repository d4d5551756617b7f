"""Reads of what the apps share: the counters of ``common.metrics.TalliedCounter`` over time."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

import orjson
from django.db.models import Sum

from common.models import CounterMinute


def counter_minutes(names, since: datetime) -> dict[str, list[tuple[datetime, tuple, int]]]:
    """Per counter name: ``(minute, label values, count)`` from ``since`` on, oldest first."""
    rows = (
        CounterMinute.objects.filter(name__in=list(names), minute__gte=since)
        .order_by("minute", "labels")
        .values_list("name", "minute", "labels", "value")
    )
    found = defaultdict(list)
    for name, minute, labels, value in rows:
        found[name].append((minute, tuple(orjson.loads(labels)), value))
    return found


def counter_sums(name: str, since: datetime) -> dict[tuple, int]:
    """A counter's counts since a time, per label values."""
    rows = (
        CounterMinute.objects.filter(name=name, minute__gte=since)
        .values_list("labels")
        .annotate(total=Sum("value"))
    )
    return {tuple(orjson.loads(labels)): total for labels, total in rows}
