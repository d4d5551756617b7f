"""The front end's metrics: output tokens as they are posted, each session's time to first
token and its steps as its instance reports them, sessions and failovers read from the database
at each scrape."""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily

from common.metrics import database_figures, gauge, state_gauge
from kvsp.timeline import first_token_parts

OUTPUT_TOKENS = Counter(
    "kvsp_output_tokens",
    "Output tokens posted to sessions (6.8), per outcome: stored, or a duplicate of an index "
    "the session held already (sent again after a lost answer, or the final mark of a resume).",
    ["outcome"],
)


# The steps of a session's time to first token are ``kvsp.timeline.FIRST_TOKEN_STEPS``.
# Placement, before them, is the placements endpoint's request time
# (kvsp_http_request_duration_seconds{endpoint="placements"}).
TTFT_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIME_TO_FIRST_TOKEN = Histogram(
    "kvsp_time_to_first_token_seconds",
    "A served session's time to first token (per epoch: a resume counts again), from the steps "
    "its instance reports with its first checkpoint.",
    buckets=TTFT_BOUNDS_S,
)
TIME_TO_FIRST_TOKEN_STEP = Histogram(
    "kvsp_time_to_first_token_step_seconds",
    "The time of each step of a session's time to first token, as its instance reports it.",
    ["step"],
    buckets=TTFT_BOUNDS_S,
)


def observe_timeline(timings_us: dict) -> None:
    """A session's reported timeline (``kvsp.timeline``), once per checkpoint that carries one;
    steps of other names are not shown (each would be a series)."""
    parts, total = first_token_parts(timings_us)
    for step, spent in parts:
        TIME_TO_FIRST_TOKEN_STEP.labels(step).observe(spent / 1e6)
    if total is not None:
        TIME_TO_FIRST_TOKEN.observe(total / 1e6)


@database_figures("control")
def session_figures(now):
    from sessions import selectors  # services import this module, selectors import services

    yield state_gauge(
        "kvsp_sessions", "Sessions per state (6.8).", selectors.session_state_counts()
    )
    failovers = CounterMetricFamily(
        "kvsp_session_failovers", "Failovers: each raised a session's epoch and resumed it."
    )
    failovers.add_metric([], selectors.failover_total())
    yield failovers
    yield gauge(
        "kvsp_output_streams",
        "Output event streams open, in every process of the control plane.",
        (),
        [((), selectors.open_stream_count())],
    )
