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

Endpoints are labelled by URL pattern name, never by path, so the number of series stays bounded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime

from django.conf import settings
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
from prometheus_client.core import GaugeMetricFamily

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
