"""Crashes: the control plane killed mid-request, a worker killed mid-task, Redis and Postgres
restarted. No acknowledged write is lost, every task is idempotent, the cluster converges.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from index.models import Replica
from placement.models import Instance
from tests.support.fixtures import (
    HOLDER_A,
    make_caller,
    make_instance,
    make_scope,
    random_key,
    replica_json,
    report,
    status_record,
)
from tests.support.processes import Server
from tests.support.standin import StandinNode
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

COMPAT = "c5" * 32


# Publishes acknowledged before the kill: whatever the machine's speed, the kill comes after
# some publishes were answered and before the last ones were sent; most of them, so that few
# are left to retry one by one.
ACKNOWLEDGED_BEFORE_THE_KILL = 320


def test_no_acknowledged_publish_is_lost_when_the_control_plane_is_killed(role_env, log_dir):
    scope = make_scope("tenant-a")
    holder = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    env = role_env(KVSP_RATE_LIMIT_PER_S="0")
    server = Server("doomed", env, log_dir, workers=2).start()
    records = [replica_json(scope.scope_id_hex, COMPAT, random_key()) for _ in range(400)]
    headers = {"Authorization": f"Bearer {holder.token}"}

    def publish(record, base=server.url):
        path = f"{base}/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{record['block_key']}"
        try:
            return httpx.put(path, json=record, headers=headers, timeout=10).status_code
        except httpx.HTTPError:
            return None

    answered: list[str] = []
    enough, killed = threading.Event(), threading.Event()

    def publish_until_killed(record):
        # Once enough were answered, a publish not yet sent waits for the kill: the ones in
        # flight then are the ones the kill interrupts.
        if enough.is_set():
            killed.wait()
        code = publish(record)
        if code in (200, 201):
            answered.append(record["block_key"])
            if len(answered) >= ACKNOWLEDGED_BEFORE_THE_KILL:
                enough.set()
        return code

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(publish_until_killed, record) for record in records]
        try:
            assert enough.wait(timeout=120), f"{len(answered)} publishes answered"
            server.kill()  # SIGKILL, mid-flight
        finally:
            killed.set()
        codes = [future.result() for future in futures]
    acknowledged = {r["block_key"] for r, c in zip(records, codes, strict=True) if c in (200, 201)}
    assert acknowledged, "the kill came before any publish was answered"
    assert len(acknowledged) < len(records), "the kill came after every publish was answered"
    stored = {r.block_key_hex for r in Replica.objects.all()}
    assert acknowledged <= stored  # every acknowledged write survived
    # Holders retry what was not acknowledged; publishing is idempotent, so all converge.
    restarted = Server("restarted", env, log_dir, workers=1).start()
    try:
        retried = [publish(r, restarted.url) for r in records if r["block_key"] not in acknowledged]
        assert set(retried) <= {200, 201}
    finally:
        restarted.stop()
    assert Replica.objects.count() == len(records)


def test_a_task_whose_worker_was_killed_is_delivered_again(role_env, start_process):
    controller = make_caller("pc", controller=True)
    env = role_env(
        KVSP_TOKEN=controller.token,
        KVSP_BROKER_VISIBILITY_TIMEOUT_S="3",
        KVSP_BROKER_RESTORE_INTERVAL_S="1",
    )
    with StandinNode() as node:
        caller = make_instance("ii1", node.url)
        report(caller, "ii1", status_record(node.url))
        answer = threading.Event()
        node.holds[("PUT", "/kvsp/state")] = answer  # the first worker dies waiting for it
        first = start_process("worker", "first-worker", env, queues=["control"])
        assert controller.put("/kvsp/instances/ii1/state", {"state": "draining"}).status_code == 200
        node.wait_for("PUT", "/kvsp/state")
        first.kill()
        del node.holds[("PUT", "/kvsp/state")]
        answer.set()
        start_process("worker", "second-worker", env, queues=["control"])
        wait_until(
            lambda: Instance.objects.get().pushed_state_version == 1,
            "state pushed after redelivery",
        )
        assert node.received("PUT", "/kvsp/state")[-1] == {"state": "draining"}
