"""The time of a scrape of the control plane's ``/metrics`` with 1,000,000 replica rows in the
index, against the limit of 100 ms a scrape must stay under.

On a fresh Postgres database (``kvsp_bench_metrics``), migrated in this process, the replica
table is filled in one ``INSERT ... SELECT generate_series`` with rows shaped as the index
stores them (32 layer digests, a residency in one of the four tiers, one in ten expired, spread
over 16 holders), then analyzed as autovacuum would. Each scrape is ``GET /metrics`` through
Django's test client with ``KVSP_ROLE=control``: every figure the database records, read as a
scrape reads it. The first scrape is not timed (it imports and connects); the next ``--repeats``
are, and the median and the slowest are printed with their ratio to the limit. For reference,
the exact replica and tier totals (what a scrape read before it sampled) are timed too.

    .venv/bin/python bench/bench_metrics.py [--rows N] [--repeats N]

Needs Postgres on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_index import timed  # noqa: E402
from bench.support import control_in_process, migrated_in_process  # noqa: E402

DB = "kvsp_bench_metrics"
LIMIT_MS = 100.0
HOLDERS = 16

# Residencies as the index stores them (canonical JSON) with their tier bits.
RESIDENCIES = (
    ('[{"tier":"device","layers":[0,31],"read_mbit_per_s":800000}]', 1),
    ('[{"tier":"host","layers":[0,31],"read_mbit_per_s":200000}]', 2),
    ('[{"tier":"disk","layers":[0,31],"read_mbit_per_s":16000}]', 4),
    ('[{"tier":"host","layers":[0,15]},{"tier":"disk","layers":[16,31]}]', 6),
)

_FILL = """
INSERT INTO index_replica (
    compat_id, scope_id, block_key, holder_id, codec, size, digest, layer_digests, residency,
    tier_mask, moqt_namespace, ttl_ms, expires_at, published_at, refreshed_at, refresh_count
)
SELECT
    %(compat)s, %(scope)s, decode(lpad(to_hex(i), 64, '0'), 'hex'),
    %(first_holder)s + i %% {holders}, 1, 2097152 + 1024,
    decode(lpad(to_hex(i), 64, 'f'), 'hex'),
    decode(repeat(lpad(to_hex(i), 64, 'a'), 32), 'hex'),
    (%(residencies)s::text[])[1 + i %% 4], (%(masks)s::int[])[1 + i %% 4],
    '', 60000,
    CASE WHEN i %% 10 = 0 THEN now() - interval '1 minute' ELSE now() + interval '1 hour' END,
    now(), now(), 0
FROM generate_series(0, %(rows)s - 1) AS i
"""


def fill(rows: int) -> float:
    """Insert ``rows`` replica rows; the seconds it took."""
    from django.db import connection

    from index.models import Holder

    holders = [Holder.objects.create(url=f"http://holder-{h}.bench/kvsp/") for h in range(HOLDERS)]
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            _FILL.format(holders=HOLDERS),
            {
                "compat": b"\x01" * 32,
                "scope": b"\x02" * 16,
                "first_holder": holders[0].pk,
                "residencies": [text for text, _ in RESIDENCIES],
                "masks": [mask for _, mask in RESIDENCIES],
                "rows": rows,
            },
        )
        cursor.execute("ANALYZE index_replica")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=50)
    arguments = parser.parse_args()
    control_in_process(DB)
    migrated_in_process()
    from django.test import Client

    from index import selectors

    print(f"inserting {arguments.rows:,} replica rows ...", flush=True)
    print(f"  {fill(arguments.rows):.1f} s")

    client = Client()

    def scrape() -> None:
        response = client.get("/metrics")
        assert response.status_code == 200 and b"kvsp_database_up 1.0" in response.content

    scrape()
    spent = timed(scrape, arguments.repeats)
    median, slowest = statistics.median(spent), max(spent)
    figures, fraction = selectors.replica_tier_figures()
    exact = selectors.replica_tier_totals()
    exact_ms = timed(selectors.replica_tier_totals, 3)
    error = abs(figures["replicas"] - exact["replicas"]) / exact["replicas"]

    print(f"scrape of /metrics, {arguments.rows:,} replica rows, {arguments.repeats} scrapes:")
    print(f"  median {median:.1f} ms, slowest {slowest:.1f} ms")
    print(f"  median / limit of {LIMIT_MS:.0f} ms: {median / LIMIT_MS:.2f}")
    print(f"  slowest / limit: {slowest / LIMIT_MS:.2f}")
    print(
        f"  replicas estimated from {fraction:.2%} of the table's pages: "
        f"{figures['replicas']:,} against {exact['replicas']:,} exact ({error:.1%} off)"
    )
    exact_median = statistics.median(exact_ms)
    print(f"exact replica and tier totals (what a scrape read before): {exact_median:.0f} ms")


if __name__ == "__main__":
    main()
