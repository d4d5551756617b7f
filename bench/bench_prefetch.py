"""Prefetch of 256 blocks from a peer (spec 6.5) against the cost model's ``fetch_us`` (6.4) for
that link.

A control plane, a source node ``n1`` holding 256 blocks of 2 MiB (32 layers, 8 KV heads of
dimension 128, float16: a Llama-3-8B block of 16 tokens) and a target node ``n2`` with its Celery
worker (threads), all on loopback with Postgres and Redis. The controller sends ``n2`` one
directive for all 256 blocks with ``n1`` as their source; ``n2`` leases, fetches, verifies every
digest, stores, keeps device copies (CPU tensors here) and publishes each block.

The wall time (directive received to directive complete, on the node's clock) is compared with
``kvsp.cost.plan_fetch`` for the same blocks, priced with two links to ``n1``:

- the link as measured by this script before the prefetch, one block at a time, the way the
  node measures it: the quickest response head of a verified 2 MiB block GET as the round
  trip, and the quickest transfer after it as the rate;
- the link ``n2`` measured during the prefetch and reports in its status record.

``wall / fetch_us`` above 1 is what the protocol's per-block work costs beyond moving octets
(lease, verification, placement, publication) once parallel loads are taken into account.

    .venv/bin/python bench/bench_prefetch.py [--blocks N] [--parallel P]

Needs Postgres and Redis on 127.0.0.1 (CELERY_BROKER_URL, default redis://127.0.0.1:6379/3).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from bench.support import DESCRIPTOR, SECTION, BenchCluster  # noqa: E402
from kvsp.compat import compat_id_hex  # noqa: E402
from kvsp.container import RAW_CODEC, encode, store_headers  # noqa: E402
from kvsp.cost import MatchedBlock, plan_fetch  # noqa: E402
from kvsp.records import Link, ReplicaRecord  # noqa: E402
from tests.support.processes import Server, Worker  # noqa: E402

DB = "kvsp_bench_node"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--parallel", type=int, default=4)
    options = parser.parse_args()

    cluster = BenchCluster("prefetch", DB, ("n1", "n2"))
    work, names = cluster.work, cluster.names
    parallel = {"KVSP_PREFETCH_PARALLEL": str(options.parallel)}
    processes = [
        Server("bench-cp", cluster.control_env, work, workers=2, port=cluster.cp_port),
        Server(
            "bench-n1",
            cluster.node_env("n1", **parallel),
            work,
            workers=2,
            port=cluster.ports["n1"],
        ),
        Server(
            "bench-n2",
            cluster.node_env("n2", **parallel),
            work,
            workers=2,
            port=cluster.ports["n2"],
        ),
        Worker(
            "bench-n2-worker",
            cluster.node_env("n2", **parallel),
            work,
            queues=[f"ii.{names['n2']}"],
            pool="threads",
            concurrency=4,
        ),
    ]
    cluster.run(processes, lambda started: run(options, started))


def run(options, cluster: BenchCluster) -> None:
    import django

    cp_url, urls, names, scope = cluster.cp_url, cluster.urls, cluster.names, cluster.scope
    tokens, controller = cluster.tokens, cluster.controller
    os.environ["DATABASE_URL"] = cluster.database_url
    django.setup()
    from workers.fetch import fetch_block
    from workers.models import Directive, MeasuredLink

    compat = compat_id_hex(DESCRIPTOR)
    pc = httpx.Client(headers={"Authorization": f"Bearer {controller}"}, timeout=60)
    assert pc.put(f"{cp_url}compat/{compat}", json=DESCRIPTOR).status_code in (200, 201)

    rng = random.Random(9001)
    keys = [rng.randbytes(32).hex() for _ in range(options.blocks)]
    n1 = httpx.Client(headers={"Authorization": f"Bearer {tokens['n1']}"}, timeout=60)

    def put(key: str) -> int:
        local = random.Random(key)
        data = encode(
            RAW_CODEC,
            0,
            16,
            [(local.randbytes(SECTION), local.randbytes(SECTION)) for _ in range(32)],
        )
        response = n1.put(
            f"{urls['n1']}blocks/{compat}/{scope}/{key}",
            content=data,
            headers=store_headers(hashlib.sha256(data).digest()),
        )
        assert response.status_code == 201, response.text
        return len(data)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        sizes = list(pool.map(put, keys))
    total = sum(sizes)
    print(
        f"source n1: {len(keys)} blocks of {sizes[0] / (1 << 20):.2f} MiB "
        f"({total / (1 << 20):.0f} MiB) stored in {time.perf_counter() - started:.1f} s"
    )

    records = {}
    found = pc.post(
        f"{cp_url}lookup", json={"scope_id": scope, "compat_id": compat, "block_keys": keys}
    ).json()
    assert found["matched"] == len(keys)
    for block in found["blocks"]:
        records[block["block_key"]] = ReplicaRecord.from_json(block["replicas"][0])

    # The link to n1 as this script sees it, measured as the node measures it (workers.prefetch)
    # but one block at a time: the quickest response head, the quickest transfer after it.
    probe = httpx.Client(headers={"Authorization": f"Bearer {tokens['n2']}"}, timeout=60)
    heads, transfers = [], []
    for key in keys[:8]:
        fetched = fetch_block(probe, urls["n1"], records[key], max_size=1 << 30)
        heads.append(fetched.first_byte_s)
        transfers.append(fetched.elapsed_s - fetched.first_byte_s)
    probed = Link(
        holder=urls["n1"],
        mbit_per_s=8 * sizes[0] / (min(transfers) * 1e6),
        rtt_us=min(heads) * 1e6,
    )

    directive = str(uuid.uuid4())
    body = {
        "directive": directive,
        "scope_id": scope,
        "compat_id": compat,
        "blocks": [{"block_key": key, "sources": [urls["n1"]]} for key in keys],
        "deadline_ms": 600_000,
        "lease_ms": 60_000,
    }
    client_started = time.perf_counter()
    accepted = pc.post(f"{urls['n2']}prefetch", json=body)
    assert accepted.status_code == 202, accepted.text
    while True:
        state = pc.get(accepted.headers["location"]).json()
        if state["state"] != "pending":
            break
        time.sleep(0.05)
    client_wall = time.perf_counter() - client_started
    assert state["state"] == "complete" and len(state["loaded"]) == len(keys), state
    row = Directive.objects.get(directive=directive)
    wall = (row.finished_at - row.received_at).total_seconds()
    measured = MeasuredLink.objects.get(instance=names["n2"], holder=urls["n1"])
    reported = Link(holder=urls["n1"], mbit_per_s=measured.mbit_per_s, rtt_us=measured.rtt_us)
    matched = [MatchedBlock(key, (records[key],)) for key in keys]

    print(f"prefetch of {len(keys)} blocks n1 -> n2, {options.parallel} at a time")
    print(f"  wall time on the node (received -> complete): {wall * 1e3:9.1f} ms")
    print(f"  wall time seen by the controller (POST -> poll): {client_wall * 1e3:7.1f} ms")
    print(f"  throughput: {total / wall / 1e9:.2f} GB/s, {len(keys) / wall:.0f} blocks/s")
    for name, link in (("probed before", probed), ("reported by n2", reported)):
        plan = plan_fetch(urls["n2"], [link], matched)
        print(
            f"  cost model fetch_us, link {name} ({link.mbit_per_s:,.0f} Mbit/s, "
            f"rtt {link.rtt_us:,.0f} us): {plan.fetch_us / 1e3:9.1f} ms  "
            f"wall/fetch_us {wall * 1e6 / plan.fetch_us:5.2f}"
        )


if __name__ == "__main__":
    main()
