"""Prefetch never blocks admitted work (spec 6.5): while a long prefetch runs on n2, its engine's
decode loop and its block GETs keep their pace."""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import pytest

from tests.node.support import container, random_key
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db

DECODE_STEPS = 256


def decode_loop(cluster) -> dict:
    from workers.tasks import measure_engine

    result = measure_engine.apply_async(args=[DECODE_STEPS], queue=cluster.node("n2").queue)
    return result.get(timeout=120)


def get_latencies(api, compat, scope, key, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = api.get_block(compat, scope, key)
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200
    return latencies


def test_decode_and_block_gets_keep_their_pace_during_a_long_prefetch(cluster, standin):
    from workers.models import Directive

    n2 = cluster.node("n2")
    reader = n2.api(cluster.tokens["reader_a"])
    served = random_key()
    assert (
        reader.put_block(cluster.compat, cluster.scope_a, served, container(700)).status_code == 201
    )
    keys = [random_key() for _ in range(32)]
    for seed, key in enumerate(keys, start=710):
        standin.add(key, container(seed))
        standin.holder.trickle_s[key] = 0.3  # 32 blocks, 4 at a time: about 2.5 s

    decode_loop(cluster)  # the engine is loaded and warm
    idle = decode_loop(cluster)
    idle_gets = get_latencies(reader, cluster.compat, cluster.scope_a, served, 20)

    body = {
        "directive": str(uuid.uuid4()),
        "scope_id": cluster.scope_a,
        "compat_id": cluster.compat,
        "blocks": [{"block_key": key, "sources": [standin.holder.url]} for key in keys],
        "deadline_ms": 60_000,
        "lease_ms": 10_000,
    }
    controller = n2.api(cluster.tokens["controller"])
    assert controller.post("prefetch", json=body).status_code == 202
    row = wait_until(
        lambda: Directive.objects.filter(
            directive=body["directive"], started_at__isnull=False
        ).first(),
        "the prefetch to start",
    )
    busy_gets: list[float] = []
    getter = threading.Thread(
        target=lambda: busy_gets.extend(
            get_latencies(reader, cluster.compat, cluster.scope_a, served, 20)
        )
    )
    getter.start()
    busy = decode_loop(cluster)
    getter.join()
    still_pending = controller.get(f"prefetch/{body['directive']}").json()["state"] == "pending"
    final = wait_until(
        lambda: (
            (s := controller.get(f"prefetch/{body['directive']}").json())["state"] != "pending"
            and s
        ),
        "the prefetch's end",
        timeout=60,
    )
    assert final["state"] == "complete" and final["loaded"] == keys

    # The decode loop ran inside the prefetch, not after it.
    assert busy["started"] >= row.started_at.timestamp()
    assert still_pending, "the prefetch ended before the decode loop did: nothing was shown"
    idle_step = statistics.median(idle["step_ms"])
    busy_step = statistics.median(busy["step_ms"])
    assert busy_step <= 3 * idle_step + 2, (idle_step, busy_step)
    idle_get = statistics.median(idle_gets)
    busy_get = statistics.median(busy_gets)
    assert busy_get <= 3 * idle_get + 0.02, (idle_get, busy_get)
