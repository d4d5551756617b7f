"""The Placement Controller's figures: where each placement's prompt tokens come from, and why
it recomputes them (counted as placements happen), and the instances, prefetch directives and
reshards the database records (read at each scrape)."""

from __future__ import annotations

import functools

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from common.metrics import TalliedCounter, count_all, database_figures, gauge, state_gauge
from kvsp.reasons import RECOMPUTE_REASONS, TIERS
from placement import selectors

# The tokens of each placed prompt by where the chosen instance gets them.
TOKEN_ORIGINS = ("own", "peer", "recompute")

PLACEMENT_TOKENS = TalliedCounter(
    "kvsp_placement_tokens",
    "Prompt tokens of placements, by the instance chosen and where it gets them: its own tiers "
    "(own), a peer through the prefetch directive (peer), or computing them (recompute).",
    ["instance", "origin"],
)
PLACEMENT_RECOMPUTES = TalliedCounter(
    "kvsp_placement_recomputes",
    "Placements whose chosen instance loads no block and computes the whole prompt, by why.",
    ["instance", "reason"],
)
# vLLM's vllm:external_prefix_cache_hits counts the tokens its KV connector loads: here, what a
# directive has the instance load from peers.
EXTERNAL_PREFIX_CACHE_HITS = TalliedCounter(
    "kvsp_external_prefix_cache_hits",
    "Prompt tokens a placement's directive loads from peers, by the tier at the first source.",
    ["tier"],
)
EXTERNAL_PREFIX_CACHE_HIT_BLOCKS = TalliedCounter(
    "kvsp_external_prefix_cache_hit_blocks",
    "Blocks a placement's directive loads from peers, by the tier at the first source.",
    ["tier"],
)


@functools.cache
def _series(instance: str) -> tuple:
    return (
        {origin: PLACEMENT_TOKENS.series(instance, origin) for origin in TOKEN_ORIGINS},
        {reason: PLACEMENT_RECOMPUTES.series(instance, reason) for reason in RECOMPUTE_REASONS},
        [EXTERNAL_PREFIX_CACHE_HITS.series(tier) for tier in TIERS],
        [EXTERNAL_PREFIX_CACHE_HIT_BLOCKS.series(tier) for tier in TIERS],
    )


def observe_placement(
    instance: str,
    *,
    prompt_tokens: int,
    block_tokens: int,
    loaded_blocks: int,
    peer_blocks_by_tier: list[int],
    recompute_reason: str | None,
) -> None:
    """One placement: the chosen ``instance`` (its name) loads ``loaded_blocks`` (those of
    ``peer_blocks_by_tier`` from peers, the rest from its own tiers) and computes the rest of
    the prompt; ``recompute_reason`` (of ``RECOMPUTE_REASONS``) when it loads nothing."""
    tokens, recomputes, external, external_blocks = _series(instance)
    peer = sum(peer_blocks_by_tier)
    counts = [
        (tokens["own"], (loaded_blocks - peer) * block_tokens),
        (tokens["peer"], peer * block_tokens),
        (tokens["recompute"], prompt_tokens - loaded_blocks * block_tokens),
        *zip(external_blocks, peer_blocks_by_tier, strict=True),
        *zip(external, (blocks * block_tokens for blocks in peer_blocks_by_tier), strict=True),
    ]
    if recompute_reason is not None:
        counts.append((recomputes[recompute_reason], 1))
    count_all(counts)


# Bounds of the prefetch latency histogram, in seconds.
PREFETCH_LATENCY_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@database_figures("control")
def instance_figures(now):
    yield state_gauge(
        "kvsp_instances",
        "Instances per lifecycle state (6.3).",
        selectors.instance_state_counts(),
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
    yield state_gauge(
        "kvsp_prefetch_directives",
        "Prefetch directives recorded (6.5), per state.",
        selectors.directive_state_counts(),
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
