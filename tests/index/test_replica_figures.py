"""The replica gauges of /metrics: exact on a small table, estimated from a sample of pages on a
large one, so that a scrape's cost does not grow with the replicas (BENCHMARKS.md "Metrics")."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from index import selectors
from index.models import Holder, Replica, Tier

pytestmark = pytest.mark.django_db


def fill(count: int, *, tier: Tier, expired: int = 0) -> None:
    holder = Holder.objects.create(url="http://figures.test/kvsp/")
    now = timezone.now()
    Replica.objects.bulk_create(
        Replica(
            compat_id=b"\x01" * 32,
            scope_id=b"\x02" * 16,
            block_key=i.to_bytes(32, "big"),
            holder=holder,
            codec=1,
            size=4096,
            digest=b"\x03" * 32,
            layer_digests=b"\x04" * 1024,  # 32 layers: a few rows a page, as in the index
            residency=f'[{{"tier":"{tier.label}","layers":[0,31]}}]',
            tier_mask=tier.value,
            ttl_ms=60_000,
            expires_at=now + timedelta(minutes=-1 if i < expired else 1),
            published_at=now,
            refreshed_at=now,
        )
        for i in range(count)
    )


def pages() -> int:
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE index_replica")  # as autovacuum would
        cursor.execute(
            "SELECT pg_relation_size('index_replica') / current_setting('block_size')::bigint"
        )
        return cursor.fetchone()[0]


def test_a_small_table_is_counted_exactly():
    fill(40, tier=Tier.DISK, expired=10)
    figures, fraction = selectors.replica_tier_figures()
    assert fraction == 1.0
    assert figures == selectors.replica_tier_totals()
    assert figures["replicas"] == 30 and figures["tiers"]["disk"]["octets"] == 30 * 4096


def test_past_the_sample_size_the_figures_are_scaled_from_a_sample_of_pages():
    fill(600, tier=Tier.HOST)
    table_pages = pages()
    assert table_pages > 20
    figures, fraction = selectors.replica_tier_figures(sample_pages=table_pages // 2)
    assert fraction == pytest.approx((table_pages // 2) / table_pages)
    # Every row is live and on the host tier: the sample's shares are exact, and so is the
    # table's row count after ANALYZE.
    assert figures["replicas"] == 600 and figures["octets"] == 600 * 4096
    assert figures["tiers"]["host"] == {"replicas": 600, "octets": 600 * 4096}
    assert figures["tiers"]["device"] == {"replicas": 0, "octets": 0}
