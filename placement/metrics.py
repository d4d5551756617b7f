"""The Placement Controller's figures, read from the database at each scrape: instances,
prefetch directives and reshards."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from common.metrics import database_figures, gauge
from placement import selectors

# Bounds of the prefetch latency histogram, in seconds.
PREFETCH_LATENCY_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@database_figures("control")
def instance_figures(now):
    yield gauge(
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
        yield gauge(
            f"kvsp_instance_{suffix}",
            documentation,
            ["instance"],
            (((i["name"],), i[member]) for i in shown if i[member] is not None),
        )
    yield gauge(
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


@database_figures("control")
def prefetch_figures(now):
    yield gauge(
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


@database_figures("control")
def reshard_figures(now):
    yield gauge("kvsp_shard_maps", "Shard Maps (6.9).", (), [((), len(selectors.shard_maps()))])
    yield gauge(
        "kvsp_reshard_operations",
        "Reshard operations per phase (6.9).",
        ["phase"],
        (((phase,), count) for phase, count in selectors.reshard_phase_counts().items()),
    )
