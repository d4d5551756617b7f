"""Concurrent publishes against a real server on Postgres, and expiry housekeeping."""

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from index.authentication import principal_for_token
from index.models import Replica
from index.services import do_delete_expired_replicas, do_publish_replica
from kvsp.records import ReplicaRecord
from tests.support.fixtures import HOLDER_A, make_caller, make_scope, random_key, replica_json
from tests.support.waiting import wait_until

COMPAT = "c2" * 32


@pytest.mark.django_db(transaction=True)
def test_concurrent_publishes_of_one_replica(role_env, start_process):
    scope = make_scope("tenant-a")
    caller = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    server = start_process("server", "control", role_env(), workers=2)
    key = random_key()
    path = f"{server.url}/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{key}"
    headers = {"Authorization": f"Bearer {caller.token}"}

    def publish(size):
        record = replica_json(scope.scope_id_hex, COMPAT, key, size=size)
        return httpx.put(path, json=record, headers=headers, timeout=30).status_code

    with ThreadPoolExecutor(max_workers=16) as pool:
        codes = list(pool.map(publish, range(1000, 1064)))
    assert sorted(codes) == [200] * 63 + [201]
    row = Replica.objects.get()
    assert row.refresh_count == 63
    assert 1000 <= row.size < 1064


@pytest.mark.django_db
def test_expired_rows_are_deleted_in_batches_and_live_ones_kept():
    scope = make_scope("tenant-a")
    principal = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    publisher = principal_for_token(principal.token)
    past = timezone.now() - timedelta(minutes=5)
    for _ in range(7):
        record = ReplicaRecord.from_json(replica_json(scope.scope_id_hex, COMPAT, random_key()))
        do_publish_replica(publisher, record, now=past)
    live = ReplicaRecord.from_json(replica_json(scope.scope_id_hex, COMPAT, random_key()))
    do_publish_replica(publisher, live)
    assert do_delete_expired_replicas(batch=3) == 7
    assert [r.block_key_hex for r in Replica.objects.all()] == [live.block_key]


@pytest.mark.django_db(transaction=True)
def test_housekeeping_task_runs_on_a_worker(role_env, start_process):
    from index.tasks import delete_expired_replicas

    scope = make_scope("tenant-a")
    caller = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    publisher = principal_for_token(caller.token)
    record = ReplicaRecord.from_json(replica_json(scope.scope_id_hex, COMPAT, random_key()))
    do_publish_replica(publisher, record, now=timezone.now() - timedelta(hours=1))
    start_process("worker", "control-worker", role_env(), queues=["control"])
    delete_expired_replicas.apply_async(queue="control")
    wait_until(lambda: not Replica.objects.exists(), "the expired replica deleted", timeout=30)
