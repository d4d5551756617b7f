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

import functools
import logging
import os
import threading
import time
from datetime import datetime

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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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
LOOKUPS = Counter(
    "kvsp_lookups",
    "Prefix lookups in the index (6.2): POST lookup, and the lookup of each placement.",
    ["source"],
)
LOOKUP_BLOCK_KEYS = Counter(
    "kvsp_lookup_block_keys", "Block Keys asked for in lookups.", ["source"]
)
LOOKUP_MATCHED_BLOCKS = Counter(
    "kvsp_lookup_matched_blocks", "Block Keys of the matched prefix of lookups.", ["source"]
)
LOOKUP_MATCHED_RATIO = Histogram(
    "kvsp_lookup_matched_ratio",
    "Per lookup, the matched prefix as a fraction of the Block Keys asked for.",
    ["source"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
)

OUTPUT_TOKENS = Counter(
    "kvsp_output_tokens",
    "Output tokens posted to sessions (6.8), per outcome: stored, or a duplicate of an index "
    "the session held already (sent again after a lost answer, or the final mark of a resume).",
    ["outcome"],
)

BLOCKS_SENT = Counter(
    "kvsp_blocks_sent",
    "Block representations a holder sent (6.7), whole or a layer range, per request that asked "
    "for them: a GET of one block, or a batch (POST blocks/{compat}/{scope}), one per part.",
    ["request"],
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


# --- Lookup outcomes, for /metrics and for the dashboard's hit ratio over time ----------------

# How often a process writes the lookups it counted to the database (index.LookupBucket).
LOOKUP_WRITE_INTERVAL_S = 1.0


class LookupTally:
    """Lookups this process counted and has not yet added to ``index.LookupBucket``.

    A lookup only adds to memory; the counts go to the database in one upsert per minute
    bucket, after a response has been sent and at most once per ``LOOKUP_WRITE_INTERVAL_S``,
    so the hot path never waits on a write. A process that stops loses at most that long.
    """

    def __init__(self):
        self._lock = threading.Lock()
        # minute -> [lookups, hits, block_keys, matched_blocks]
        self._pending: dict[datetime, list[int]] = {}
        self._written_at = 0.0

    def add(self, block_keys: int, matched: int, now: datetime) -> None:
        minute = now.replace(second=0, microsecond=0)
        with self._lock:
            counts = self._pending.setdefault(minute, [0, 0, 0, 0])
            counts[0] += 1
            counts[1] += 1 if matched else 0
            counts[2] += block_keys
            counts[3] += matched

    def take(self) -> dict[datetime, list[int]]:
        """The counts not yet written, which this tally then forgets."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._written_at = time.monotonic()
        return pending

    def write_if_due(self, **_) -> None:
        """``request_finished`` receiver: write when there is something and the time has come."""
        with self._lock:
            due = time.monotonic() - self._written_at >= LOOKUP_WRITE_INTERVAL_S
            if not (self._pending and due):
                return
        self._write(self.take())

    def write(self) -> None:
        """Write everything counted so far, now."""
        self._write(self.take())

    def _write(self, pending: dict[datetime, list[int]]) -> None:
        from index.services import do_record_lookups

        for minute, (lookups, hits, block_keys, matched) in sorted(pending.items()):
            try:
                do_record_lookups(
                    minute,
                    lookups=lookups,
                    hits=hits,
                    block_keys=block_keys,
                    matched_blocks=matched,
                )
            except DatabaseError:
                # Counts are figures for a chart: keep them for the next try, never fail a request.
                log.warning("could not record %d lookups of %s; will retry", lookups, minute)
                with self._lock:
                    counts = self._pending.setdefault(minute, [0, 0, 0, 0])
                    for position, value in enumerate((lookups, hits, block_keys, matched)):
                        counts[position] += value


lookup_tally = LookupTally()
request_finished.connect(lookup_tally.write_if_due, dispatch_uid="kvsp-lookup-tally")


@functools.cache
def _lookup_series(source: str) -> tuple:
    # Resolving labels costs more than counting: once per source, not once per lookup.
    return (
        LOOKUPS.labels(source),
        LOOKUP_BLOCK_KEYS.labels(source),
        LOOKUP_MATCHED_BLOCKS.labels(source),
        LOOKUP_MATCHED_RATIO.labels(source),
    )


def observe_lookup(source: str, block_keys: int, matched: int) -> None:
    """One prefix lookup of ``block_keys`` keys whose first ``matched`` matched (6.2)."""
    lookups, keys, matched_blocks, ratio = _lookup_series(source)
    lookups.inc()
    keys.inc(block_keys)
    matched_blocks.inc(matched)
    if block_keys:
        ratio.observe(matched / block_keys)
    lookup_tally.add(block_keys, matched, timezone.now())


# --- Read from the database at scrape time -----------------------------------------------------

# Bounds of the prefetch latency histogram, in seconds.
PREFETCH_LATENCY_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _gauge(name: str, documentation: str, labels=(), values=()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


def _instance_metrics(now):
    from placement import selectors

    yield _gauge(
        "kvsp_instances",
        "Instances per lifecycle state (6.3).",
        ["state"],
        (((state,), count) for state, count in selectors.instance_state_counts().items()),
    )
    shown = selectors.instances(now=now)
    figures = (
        ("running", "running", "Requests running, as last reported."),
        ("queued", "queued", "Requests queued, as last reported."),
        ("kv_utilization", "kv_utilization", "KV cache utilization, as last reported."),
        ("load", "load", "(running + queued) / batch_size, as last reported."),
        (
            "prefill_tokens_per_second",
            "prefill_tokens_per_s",
            "Prefill rate, as last reported.",
        ),
        ("decode_tokens_per_second", "decode_tokens_per_s", "Decode rate, as last reported."),
    )
    for suffix, member, documentation in figures:
        yield _gauge(
            f"kvsp_instance_{suffix}",
            documentation,
            ["instance"],
            (((i["name"],), i[member]) for i in shown if i[member] is not None),
        )
    yield _gauge(
        "kvsp_instance_last_report_age_seconds",
        "Time since the instance's last accepted status record, on the controller's clock.",
        ["instance"],
        (
            ((i["name"],), i["last_report_age_ms"] / 1000)
            for i in shown
            if i["last_report_age_ms"] is not None
        ),
    )
    restarts = CounterMetricFamily(
        "kvsp_instance_restarts", "Restarts seen (a higher epoch, 6.3).", labels=["instance"]
    )
    for instance in shown:
        restarts.add_metric([instance["name"]], instance["restarts"])
    yield restarts


def _replica_metrics(now):
    from index import selectors

    totals = selectors.replica_tier_totals(now=now)
    yield _gauge(
        "kvsp_replicas", "Unexpired replicas in the index (6.1).", (), [((), totals["replicas"])]
    )
    yield _gauge(
        "kvsp_replica_octets", "Octets of the unexpired replicas.", (), [((), totals["octets"])]
    )
    tiers = totals["tiers"].items()
    yield _gauge(
        "kvsp_tier_replicas",
        "Unexpired replicas with layers in a tier (a replica may count in several).",
        ["tier"],
        (((tier,), figures["replicas"]) for tier, figures in tiers),
    )
    yield _gauge(
        "kvsp_tier_replica_octets",
        "Octets of the unexpired replicas with layers in a tier.",
        ["tier"],
        (((tier,), figures["octets"]) for tier, figures in tiers),
    )


def _prefetch_metrics():
    from placement import selectors

    yield _gauge(
        "kvsp_prefetch_directives",
        "Prefetch directives recorded (6.5), per state.",
        ["state"],
        (((state,), count) for state, count in selectors.directive_state_counts().items()),
    )
    histogram = HistogramMetricFamily(
        "kvsp_prefetch_latency_seconds",
        "Time from a directive being recorded to its final state, per final state.",
        labels=["state"],
    )
    bounds = PREFETCH_LATENCY_BOUNDS_S
    for state, figures in selectors.prefetch_latency_histogram(bounds).items():
        buckets = [(repr(b), count) for b, count in zip(bounds, figures["buckets"], strict=True)]
        buckets.append(("+Inf", figures["count"]))
        histogram.add_metric([state], buckets, figures["sum_s"])
    yield histogram


def _session_metrics():
    from sessions import selectors

    yield _gauge(
        "kvsp_sessions",
        "Sessions per state (6.8).",
        ["state"],
        (((state,), count) for state, count in selectors.session_state_counts().items()),
    )
    failovers = CounterMetricFamily(
        "kvsp_session_failovers", "Failovers: each raised a session's epoch and resumed it."
    )
    failovers.add_metric([], selectors.failover_total())
    yield failovers
    yield _gauge(
        "kvsp_output_streams",
        "Output event streams open, in every process of the control plane.",
        (),
        [((), selectors.open_stream_count())],
    )


def _reshard_metrics():
    from placement import selectors

    yield _gauge("kvsp_shard_maps", "Shard Maps (6.9).", (), [((), len(selectors.shard_maps()))])
    yield _gauge(
        "kvsp_reshard_operations",
        "Reshard operations per phase (6.9).",
        ["phase"],
        (((phase,), count) for phase, count in selectors.reshard_phase_counts().items()),
    )


def _lease_metrics(now, instance: str | None):
    from workers.selectors import lease_totals

    totals = lease_totals(instance=instance, now=now)
    yield _gauge(
        "kvsp_leases",
        "Unexpired leases (6.6) per holder instance.",
        ["instance"],
        (((row["instance"],), row["leases"]) for row in totals),
    )
    yield _gauge(
        "kvsp_lease_octets",
        "Octets kept from eviction by unexpired leases, per holder instance.",
        ["instance"],
        (((row["instance"],), row["octets"]) for row in totals),
    )


class DatabaseCollector:
    """The figures the database records, read at each scrape: the whole cluster on the control
    plane; on a node, its own leases."""

    def describe(self):
        return []  # names are only known by querying; nothing to check at registration

    def collect(self):
        now = timezone.now()
        try:
            if settings.KVSP_ROLE == "control":
                families = [
                    *_instance_metrics(now),
                    *_replica_metrics(now),
                    *_prefetch_metrics(),
                    *_session_metrics(),
                    *_reshard_metrics(),
                    *_lease_metrics(now, None),
                ]
            else:
                families = list(_lease_metrics(now, settings.KVSP_INSTANCE or None))
            up = 1
        except DatabaseError:
            log.exception("reading metrics from the database failed")
            families, up = [], 0
        yield from families
        yield _gauge(
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
