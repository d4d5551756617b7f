"""What the apps share in the database: the counters their processes add up (``common.metrics``
``Tally``), in all and per minute."""

from __future__ import annotations

from django.db import models


class CounterTotal(models.Model):
    """A counter series (a metric and its label values) as every process of every role has
    added to it, since the beginning: what ``/metrics`` shows of counts made where no scrape
    reaches, such as a node's Celery worker. One row per series, so a scrape reads a handful."""

    name = models.CharField(max_length=100)
    # The label values, as a JSON array in the order of the metric's label names.
    labels = models.CharField(max_length=500)
    value = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "labels"], name="counter_total_series")
        ]

    def __str__(self) -> str:
        return f"{self.name}{self.labels} {self.value}"


class CounterMinute(models.Model):
    """What one minute added to a counter series: the dashboard's figures over time."""

    minute = models.DateTimeField(db_index=True)
    name = models.CharField(max_length=100)
    labels = models.CharField(max_length=500)
    value = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "name", "labels"], name="counter_minute_series"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name}{self.labels} at {self.minute:%Y-%m-%d %H:%M}: {self.value}"
