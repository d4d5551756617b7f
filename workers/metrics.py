"""The node's metrics: blocks sent as they are, and the leases every holder records."""

from __future__ import annotations

from django.conf import settings
from prometheus_client import Counter

from common.metrics import database_figures, gauge
from workers.selectors import lease_totals

BLOCKS_SENT = Counter(
    "kvsp_blocks_sent",
    "Block representations a holder sent (6.7), whole or a layer range, per request that asked "
    "for them: a GET of one block, or a batch (POST blocks/{compat}/{scope}), one per part.",
    ["request"],
)


@database_figures("control", "node")
def lease_figures(now):
    # The control plane shows every holder's; a node its own.
    instance = None if settings.KVSP_ROLE == "control" else (settings.KVSP_INSTANCE or None)
    totals = lease_totals(instance=instance, now=now)
    yield gauge(
        "kvsp_leases",
        "Unexpired leases (6.6) per holder instance.",
        ["instance"],
        (((row["instance"],), row["leases"]) for row in totals),
    )
    yield gauge(
        "kvsp_lease_octets",
        "Octets kept from eviction by unexpired leases, per holder instance.",
        ["instance"],
        (((row["instance"],), row["octets"]) for row in totals),
    )
