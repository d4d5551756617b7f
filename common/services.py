"""Writes of what the apps share: the counts of ``common.metrics.Tally``."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from common.models import CounterMinute

_ADD_TOTALS = """
INSERT INTO common_countertotal (name, labels, value) VALUES {rows}
ON CONFLICT (name, labels) DO UPDATE SET value = common_countertotal.value + excluded.value
"""
_ADD_MINUTES = """
INSERT INTO common_counterminute (minute, name, labels, value) VALUES {rows}
ON CONFLICT (minute, name, labels)
DO UPDATE SET value = common_counterminute.value + excluded.value
"""


def do_add_counts(pending: dict[tuple[datetime, tuple[str, str]], int]) -> None:
    """Add one process's counts (``{(minute, (name, labels)): count}``) to the totals of their
    series and to their minutes: two upserts however many series, so that processes adding at
    once lose nothing."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for (_, series), amount in pending.items():
        totals[series] += amount
    # Sorted, so that two processes adding the same series lock their rows in the same order.
    total_rows = sorted(totals.items())
    minute_rows = sorted(pending.items())
    adapt = connection.ops.adapt_datetimefield_value
    # Both or neither: the tally keeps what a failed write held, to try again.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            _ADD_TOTALS.format(rows=", ".join(["(%s, %s, %s)"] * len(total_rows))),
            [value for (name, labels), amount in total_rows for value in (name, labels, amount)],
        )
        cursor.execute(
            _ADD_MINUTES.format(rows=", ".join(["(%s, %s, %s, %s)"] * len(minute_rows))),
            [
                value
                for (minute, (name, labels)), amount in minute_rows
                for value in (adapt(minute), name, labels, amount)
            ],
        )


def do_prune_counter_minutes(*, keep: timedelta = timedelta(days=1), now=None) -> int:
    now = now or timezone.now()
    deleted, _ = CounterMinute.objects.filter(minute__lt=now - keep).delete()
    return deleted
