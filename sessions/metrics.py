"""The front end's metrics: output tokens as they are posted, sessions and failovers read from
the database at each scrape."""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily

from common.metrics import database_figures, gauge

OUTPUT_TOKENS = Counter(
    "kvsp_output_tokens",
    "Output tokens posted to sessions (6.8), per outcome: stored, or a duplicate of an index "
    "the session held already (sent again after a lost answer, or the final mark of a resume).",
    ["outcome"],
)


@database_figures("control")
def session_figures(now):
    from sessions import selectors  # services import this module, selectors import services

    yield gauge(
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
    yield gauge(
        "kvsp_output_streams",
        "Output event streams open, in every process of the control plane.",
        (),
        [((), selectors.open_stream_count())],
    )
