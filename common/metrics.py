"""Prometheus metrics at ``/metrics``, served by both roles.

Two kinds of figures:

- What happens inside a server process — requests and their latency per endpoint, lookups and
  how much of each matched — is counted with prometheus-client as it happens. Under gunicorn
  with several workers, ``gunicorn.conf.py`` gives each server its own
  ``PROMETHEUS_MULTIPROC_DIR`` and a scrape adds up the files of all its workers
  (prometheus-client's multiprocess mode).
- What the database records — instances and their figures, replicas per tier, prefetch
  directives and their latency, sessions and their failovers, leases, reshards — is read from
  it at scrape time. Work that Celery workers finish (a directive's outcome, a failover) is
  counted that way too, and every server of a role answers alike.
- Counters that the dashboard charts over time, or that are counted where no scrape reaches (a
  node's Celery worker loading blocks or evicting them), are ``TalliedCounter``s: a process adds
  to memory, and its ``Tally`` adds what it holds to ``common.CounterTotal`` (one row per
  series) and ``common.CounterMinute`` (one per series and minute) in one batch, after a
  response at most once per ``TALLY_WRITE_INTERVAL_S``, and after every Celery task that
  counted. A scrape reads the totals, one row per series: on a node, its own. A count whose
  unit is costly to convert where it is made (``PerUnit``: blocks of a compat id, counted as
  tokens) is converted when it is written.

Endpoints are labelled by URL pattern name, never by path, so the number of series stays bounded.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from datetime import datetime
from typing import NamedTuple

import orjson
from django.conf import settings
from django.core.signals import request_finished
from django.db import DatabaseError
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# --- Counted as it happens ------------------------------------------------------------------

REQUEST_SECONDS = Histogram(
    "kvsp_http_request_duration_seconds",
    "Time to answer a request, until the response is handed to the server, per endpoint.",
    ["endpoint", "method"],
)
REQUESTS = Counter(
    "kvsp_http_requests",
    "Requests answered, per endpoint and status code.",
    ["endpoint", "method", "status"],
)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestMetricsMiddleware:
    """Counts every request by the name of the URL pattern that answered it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        elapsed = time.perf_counter() - started
        match = request.resolver_match
        endpoint = match.view_name if match is not None else "unmatched"
        method = request.method if request.method in _METHODS else "other"
        REQUEST_SECONDS.labels(endpoint, method).observe(elapsed)
        REQUESTS.labels(endpoint, method, str(response.status_code)).inc()
        return response


# --- Read from the database at scrape time -----------------------------------------------------

# Figures read from the database at each scrape, registered by the apps (their ``metrics``
# modules, imported by their AppConfig): (the roles that show them, a function of the scrape's
# time that yields metric families).
DATABASE_FIGURES: list[tuple[frozenset[str], Callable[[datetime], Iterable]]] = []


def database_figures(*roles: str):
    """Register a function whose metric families every scrape of the given roles shows."""

    def register(figures):
        DATABASE_FIGURES.append((frozenset(roles), figures))
        return figures

    return register


def gauge(name: str, documentation: str, labels=(), values=()) -> GaugeMetricFamily:
    """A gauge family of ``(label values, value)`` pairs."""
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


def state_gauge(name: str, documentation: str, counts: dict[str, int]) -> GaugeMetricFamily:
    """A gauge of ``counts``, rows per state, labelled ``state``."""
    return gauge(name, documentation, ["state"], (((state,), n) for state, n in counts.items()))


class DatabaseCollector:
    """The figures the database records, read at each scrape: the whole cluster on the control
    plane; on a node, its own."""

    def describe(self):
        return []  # names are only known by querying; nothing to check at registration

    def collect(self):
        now = timezone.now()
        try:
            families = [
                family
                for roles, figures in DATABASE_FIGURES
                if settings.KVSP_ROLE in roles
                for family in figures(now)
            ]
            up = 1
        except DatabaseError:
            log.exception("reading metrics from the database failed")
            families, up = [], 0
        yield from families
        yield gauge(
            "kvsp_database_up", "Whether this scrape could read the database.", (), [((), up)]
        )


# --- Counted in memory, added to the database in batches ---------------------------------------


class Tally:
    """Counts this process made and has not yet written, per minute and key; ``write`` is given
    them as ``{(minute, key): count}`` and loses nothing when it raises ``DatabaseError``: the
    counts are kept for the next try, so that a count never fails the request that made it.

    Counting only adds to memory; the counts go to the database after a response has been
    sent (``write_if_due``), at most once per ``interval()`` seconds, so the hot path never
    waits on a write. A process that stops loses at most what it counted since.
    """

    def __init__(self, write: Callable[[dict], None], interval: Callable[[], float]):
        self._write_pending = write
        self._interval = interval
        self._lock = threading.Lock()
        self._pending: dict[tuple[datetime, Hashable], int] = {}
        self._written_at = 0.0

    def add(self, counts: Iterable[tuple[Hashable, int]], now: datetime) -> None:
        minute = now.replace(second=0, microsecond=0)
        with self._lock:
            pending = self._pending
            for key, amount in counts:
                if amount:
                    pending[minute, key] = pending.get((minute, key), 0) + amount

    def take(self) -> dict[tuple[datetime, Hashable], int]:
        """The counts not yet written, which this tally then forgets."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._written_at = time.monotonic()
        return pending

    def write_if_due(self, **_) -> None:
        """``request_finished`` receiver: write when there is something and the time has come."""
        with self._lock:
            due = time.monotonic() - self._written_at >= self._interval()
            if not (self._pending and due):
                return
        self._write(self.take())

    def write(self, **_) -> None:
        """Write everything counted so far, now (a receiver of Celery's ``task_postrun``)."""
        if self._pending:
            self._write(self.take())

    def _write(self, pending: dict) -> None:
        if not pending:
            return
        try:
            self._write_pending(pending)
        except DatabaseError:
            log.warning("could not write %d counts; will retry", len(pending))
            with self._lock:
                for key, amount in pending.items():
                    self._pending[key] = self._pending.get(key, 0) + amount


# How often a server process writes what its tally counted.
TALLY_WRITE_INTERVAL_S = 1.0

# Every ``TalliedCounter`` by name, for the scrape and the dashboard.
TALLIED: dict[str, TalliedCounter] = {}


class PerUnit(NamedTuple):
    """A count in units whose worth in the series' own unit is costly to learn where the count
    is made (a lookup knows its blocks, not how many tokens a block of its compat id holds):
    ``UNIT_SIZES[kind]`` says it when the tally is written, for all of a write's units at once,
    so that counting stays an addition in memory."""

    series: tuple[str, str]
    kind: str
    unit: Hashable


# What one unit of each kind is worth, registered by the apps (``unit_sizes``): a function of
# the units a write holds that returns {unit: size}; a unit it does not know is not counted.
UNIT_SIZES: dict[str, Callable[[set], dict]] = {}


def unit_sizes(kind: str):
    """Register the function that sizes the units of ``kind`` (see ``PerUnit``)."""

    def register(sizes):
        UNIT_SIZES[kind] = sizes
        return sizes

    return register


def in_series_units(pending: dict) -> dict:
    """``pending`` with every ``PerUnit`` count multiplied by the size of its unit, under its
    series."""
    units: dict[str, set] = defaultdict(set)
    for _, key in pending:
        if isinstance(key, PerUnit):
            units[key.kind].add(key.unit)
    if not units:
        return pending
    sizes = {kind: UNIT_SIZES[kind](found) for kind, found in units.items()}
    counts: dict = defaultdict(int)
    for (minute, key), amount in pending.items():
        if isinstance(key, PerUnit):
            size = sizes[key.kind].get(key.unit)
            if not size:
                continue
            key, amount = key.series, amount * size
        counts[minute, key] += amount
    return counts


def _add_counts(pending: dict) -> None:
    from common import services  # models load after this module

    counts = in_series_units(pending)
    if counts:
        services.do_add_counts(counts)


tally = Tally(_add_counts, lambda: TALLY_WRITE_INTERVAL_S)


class TalliedCounter:
    """A counter whose counts every process adds to the database through ``tally``, shown at
    the scrapes of ``roles``. A counter with an ``instance`` label (the node that counted,
    first) shows on a node only its own series."""

    def __init__(self, name: str, documentation: str, labels=(), *, roles=("control",)):
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(labels)
        self.roles = frozenset(roles)
        self.per_instance = self.label_names[:1] == ("instance",)
        TALLIED[name] = self

    @functools.cache  # noqa: B019 - one per counter and label values, kept for the process
    def series(self, *values: str) -> tuple[str, str]:
        """The key of one series (kept: a hot path resolves it once, then passes it to
        ``count_all`` with its amount)."""
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} has labels {self.label_names}")
        return self.name, orjson.dumps(values).decode()

    def count(self, *values: str, amount: int = 1, now: datetime | None = None) -> None:
        tally.add([(self.series(*values), amount)], now or timezone.now())


def count_all(
    counts: Iterable[tuple[tuple[str, str] | PerUnit, int]], now: datetime | None = None
) -> None:
    """Several ``(series, amount)`` at once, under one lock (a series may be ``PerUnit``)."""
    tally.add(counts, now or timezone.now())


def connect_tally() -> None:
    request_finished.connect(tally.write_if_due, dispatch_uid="kvsp-counter-tally")
    from celery.signals import task_postrun

    task_postrun.connect(tally.write, weak=False, dispatch_uid="kvsp-counter-tally")


@database_figures("control", "node")
def tallied_figures(now):
    """The totals of every ``TalliedCounter`` this role shows, one row per series."""
    from common.models import CounterTotal

    role = settings.KVSP_ROLE
    shown = {name: counter for name, counter in TALLIED.items() if role in counter.roles}
    if not shown:
        return
    families = {
        name: CounterMetricFamily(name, counter.documentation, labels=counter.label_names)
        for name, counter in shown.items()
    }
    own = settings.KVSP_INSTANCE if role == "node" else None
    rows = CounterTotal.objects.filter(name__in=list(shown)).values_list("name", "labels", "value")
    for name, labels, value in rows:
        values = orjson.loads(labels)
        if own is not None and shown[name].per_instance and values[0] != own:
            continue
        families[name].add_metric(values, value)
    yield from families.values()


class _ThisProcess:
    """The metrics of this process alone, when it is the only one serving."""

    def describe(self):
        return []

    def collect(self):
        return REGISTRY.collect()


def scrape_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_ThisProcess())
    registry.register(DatabaseCollector())
    return registry


@require_safe
def metrics_view(request):
    """GET /metrics: the Prometheus text format."""
    return HttpResponse(generate_latest(scrape_registry()), content_type=CONTENT_TYPE_LATEST)
