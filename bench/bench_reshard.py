"""Resharding (spec 6.9): the octets a reshard moves against the minimum its two Shard Maps
require, and its wall time against the cost model's estimate (6.4) for the links the members
report.

A control plane (HTTP server and its Celery worker on queue ``control``) and three nodes (HTTP
server and worker each), all on loopback with Postgres and Redis. A context of ``--blocks``
blocks of 2 MiB (32 layers, 8 KV heads of dimension 128, float16: a Llama-3-8B block of 16
tokens) is placed on two members as version 1 of a Shard Map that carries the context; then the
map goes through a grow (two members to three), a shift, a swap and a shrink back to two.

For each reshard:

- moved: the octets the members fetched for it (their moves' ``fetched_octets``), checked
  against the block GETs the members answered meanwhile (their ``/metrics``), and compared with
  the minimum the two maps require: each block whose member differs between the versions,
  once. The target is a ratio of 1.00: retained ranges are never transferred (6.9).
- time: from POST reshard to the last member told the outcome (wall, the controller's clock),
  the prepare phase (start to decision, the same clock), and the load (plan received to all
  fetch ranges loaded, on the fetching members' clocks, the longest). The estimate is
  ``kvsp.cost.plan_fetch`` for each member that fetches, from its sources, priced with the
  links it reports (measured by its loads), and the largest of them: the members load side by
  side. ``load/est`` compares like with like; ``wall/est`` adds the two round trips of the
  commit protocol, the queueing of the plans, and the commit's publications and releases.

    .venv/bin/python bench/bench_reshard.py [--blocks N]

Needs Postgres and Redis on 127.0.0.1 (CELERY_BROKER_URL, default redis://127.0.0.1:6379/3).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from bench.support import (  # noqa: E402
    BLOCK_TOKENS,
    DESCRIPTOR,
    BenchCluster,
    store_random_block,
)
from kvsp.compat import compat_id_hex  # noqa: E402
from kvsp.cost import MatchedBlock, plan_fetch  # noqa: E402
from kvsp.records import Link, ReplicaRecord  # noqa: E402
from tests.node.support import block_gets  # noqa: E402
from tests.support.processes import Server, Worker  # noqa: E402

DB = "kvsp_bench_reshard"
MEMBERS = ("a", "b", "c")


def scenarios(blocks: int) -> list[tuple[str, list[tuple[int, int, str]]]]:
    """The versions the map goes through, as (first block, end block, member) spans."""
    third, half = blocks // 3, blocks // 2
    return [
        ("v1", [(0, half, "a"), (half, blocks, "b")]),
        ("grow 2 -> 3", [(0, third, "a"), (third, 2 * third, "c"), (2 * third, blocks, "b")]),
        (
            "shift",
            [
                (0, third + third // 4, "a"),
                (third + third // 4, 2 * third + third // 4, "c"),
                (2 * third + third // 4, blocks, "b"),
            ],
        ),
        (
            "swap a <-> c",
            [
                (0, third + third // 4, "c"),
                (third + third // 4, 2 * third + third // 4, "a"),
                (2 * third + third // 4, blocks, "b"),
            ],
        ),
        ("shrink 3 -> 2", [(0, half, "a"), (half, blocks, "b")]),
    ]


def owners(spans, blocks: int) -> list[str | None]:
    out: list[str | None] = [None] * blocks
    for first, end, member in spans:
        for index in range(first, end):
            out[index] = member
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=96)
    options = parser.parse_args()

    cluster = BenchCluster("reshard", DB, MEMBERS)
    work = cluster.work
    processes = [
        Server("bench-cp", cluster.control_env, work, workers=2, port=cluster.cp_port),
        Worker("bench-cp-worker", cluster.control_env, work, queues=["control"]),
    ]
    for member in MEMBERS:
        processes += [cluster.node_server(member), cluster.node_worker(member)]
    cluster.run(processes, lambda started: run(options, started))


def run(options, cluster: BenchCluster) -> None:
    import django

    cp_url, urls, names, scope = cluster.cp_url, cluster.urls, cluster.names, cluster.scope
    tokens, controller = cluster.tokens, cluster.controller
    os.environ["DATABASE_URL"] = cluster.database_url
    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line a request otherwise
    from placement.models import ReshardOperation
    from workers.models import MeasuredLink, ReshardMove

    compat = compat_id_hex(DESCRIPTOR)
    pc = httpx.Client(headers={"Authorization": f"Bearer {controller}"}, timeout=60)
    assert pc.put(f"{cp_url}compat/{compat}", json=DESCRIPTOR).status_code in (200, 201)
    rng = random.Random(6009)
    keys = [rng.randbytes(32).hex() for _ in range(options.blocks)]
    plan = scenarios(options.blocks)
    first = owners(plan[0][1], options.blocks)
    clients = {
        member: httpx.Client(headers={"Authorization": f"Bearer {tokens[member]}"}, timeout=60)
        for member in MEMBERS
    }

    def put(index: int) -> int:
        member = first[index]
        return store_random_block(clients[member], urls[member], (compat, scope, keys[index]))

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        sizes = list(pool.map(put, range(options.blocks)))
    size = sizes[0]
    print(
        f"context: {options.blocks} blocks of {size / (1 << 20):.2f} MiB on a and b, stored in "
        f"{time.perf_counter() - started:.1f} s"
    )

    map_id = f"bench-{os.urandom(3).hex()}"

    def shards(spans):
        return [
            {"tokens": [f * BLOCK_TOKENS, e * BLOCK_TOKENS], "instance": urls[m]}
            for f, e, m in spans
        ]

    document = {
        "map": map_id,
        "version": 1,
        "shards": shards(plan[0][1]),
        "context": {
            "scope_id": scope,
            "compat_id": compat,
            "block_tokens": BLOCK_TOKENS,
            "block_keys": keys,
        },
    }
    assert pc.put(f"{cp_url}shardmaps/{map_id}", json=document).status_code == 201

    print(
        f"{'reshard':<14}{'min MiB':>8}{'moved MiB':>10}{'GET MiB':>8}{'ratio':>6}"
        f"{'wall ms':>8}{'prepare ms':>11}{'load ms':>8}{'est ms':>7}{'load/est':>9}{'wall/est':>9}"
    )
    current = first
    for version, (label, spans) in enumerate(plan[1:], start=2):
        following = owners(spans, options.blocks)
        minimum = sum(1 for old, new in zip(current, following, strict=True) if old and old != new)
        # The records of version v's holders: what the members verify against, and what the
        # estimate prices (the size and the tier of each replica). A record whose publication
        # failed is published again by its node's keeper; the wait says so when it happens.
        waited = time.perf_counter()
        while True:
            found = pc.post(
                f"{cp_url}lookup",
                json={"scope_id": scope, "compat_id": compat, "block_keys": keys},
            ).json()
            if found["matched"] == len(keys):
                break
            assert time.perf_counter() - waited < 30, f"only {found['matched']} blocks listed"
            time.sleep(0.1)
        if time.perf_counter() - waited > 1:
            print(f"  (the records took {time.perf_counter() - waited:.1f} s to be listed)")
        records = {
            (block["block_key"], replica["holder"]): ReplicaRecord.from_json(replica)
            for block in found["blocks"]
            for replica in block["replicas"]
        }
        gets_before = sum(block_gets(url) for url in urls.values())
        began = time.perf_counter()
        answer = pc.post(
            f"{cp_url}shardmaps/{map_id}/reshard",
            json={"shards": shards(spans), "deadline_ms": 600_000},
        )
        assert answer.status_code == 202, answer.text
        location = f"{cp_url}shardmaps/{map_id}/reshards/{version}"
        while True:
            operation = pc.get(location).json()
            members = {p["instance"] for p in operation["plans"]}
            if members <= set(operation["informed"]):
                break
            time.sleep(0.01)
        wall = time.perf_counter() - began
        assert operation["state"] == "committed", operation
        # The committed try of the move (an aborted one, if any, is a row of its own).
        row = ReshardOperation.objects.get(
            shard_map__map=map_id, to_version=version, phase="committed"
        )
        prepare = (row.decided_at - row.started_at).total_seconds()
        moves = ReshardMove.objects.filter(map=map_id, to_version=version, phase="committed")
        moved = sum(move.fetched_octets for move in moves)
        load = max(
            (move.loaded_at - move.received_at).total_seconds() for move in moves if move.fetch_keys
        )
        got = (sum(block_gets(url) for url in urls.values()) - gets_before) * size

        # The estimate: each fetching member's load from its sources (6.4), priced with the
        # links it reports, the slowest member deciding.
        estimates = []
        for member_plan in operation["plans"]:
            if not member_plan["fetch"]:
                continue
            target = member_plan["instance"]
            name = next(names[m] for m in MEMBERS if urls[m] == target)
            links = [
                Link(holder=link.holder, mbit_per_s=link.mbit_per_s, rtt_us=link.rtt_us)
                for link in MeasuredLink.objects.filter(instance=name)
            ]
            matched = []
            for item in member_plan["fetch"]:
                first_block, end_block = (t // BLOCK_TOKENS for t in item["tokens"])
                for index in range(first_block, end_block):
                    record = records[keys[index], item["from"]]
                    matched.append(MatchedBlock(keys[index], (record,)))
            estimates.append(plan_fetch(target, links, matched).fetch_us)
        estimate_us = max(estimates)
        print(
            f"{label:<14}{minimum * size / 2**20:>8.0f}{moved / 2**20:>10.0f}{got / 2**20:>8.0f}"
            f"{moved / (minimum * size):>6.2f}{wall * 1e3:>8.0f}{prepare * 1e3:>11.0f}"
            f"{load * 1e3:>8.0f}{estimate_us / 1e3:>7.0f}{load * 1e6 / estimate_us:>9.2f}"
            f"{wall * 1e6 / estimate_us:>9.2f}"
        )
        current = following
    for member in MEMBERS:
        for link in MeasuredLink.objects.filter(instance=names[member]).order_by("holder"):
            source = next(m for m in MEMBERS if urls[m] == link.holder)
            print(
                f"  link {member} <- {source} as {member} reports it: "
                f"{link.mbit_per_s:,.0f} Mbit/s, rtt {link.rtt_us:,.0f} us ({link.samples} loads)"
            )


if __name__ == "__main__":
    main()
