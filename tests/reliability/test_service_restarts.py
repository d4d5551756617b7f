"""Redis and Postgres restarted under a running cluster: what was accepted stays accepted, the
work it owes is sent again, and requests during the outage get 503 with Retry-After, never 500.

These restart the machine's shared services, so they run in their own module, serially.
"""

import subprocess
import time

import httpx
import pytest
from django.db import connection

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
from tests.support.standin import StandinNode
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

COMPAT = "c6" * 32


def _redis(*args):
    return subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", "6379", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _start_redis():
    subprocess.run(
        [
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        check=True,
        timeout=30,
    )
    wait_until(lambda: _redis("ping").stdout.strip() == "PONG", "redis back", 30)


def test_work_owed_when_redis_restarts_empty_is_sent_again(role_env, start_process):
    controller = make_caller("pc", controller=True)
    env = role_env(KVSP_TOKEN=controller.token)
    with StandinNode() as node:
        caller = make_instance("ii1", node.url)
        report(caller, "ii1", status_record(node.url, ttl_ms=600_000))
        start_process("worker", "control-worker", env, queues=["control"])
        start_process("beat", "beat", env)
        _redis("shutdown", "nosave")
        try:
            # The broker is gone: the change is still accepted and recorded.
            response = controller.put("/kvsp/instances/ii1/state", {"state": "draining"})
            assert response.status_code == 200
        finally:
            _start_redis()
        # Redis came back empty; the sweep finds the row and the instance gets its state.
        wait_until(lambda: node.received("PUT", "/kvsp/state"), "state pushed", 90)
        wait_until(lambda: Instance.objects.get().pushed_state_version == 1, "recorded", 30)


def test_a_server_started_while_redis_is_down_accepts_work_and_sends_it_later(
    role_env, start_process
):
    controller = make_caller("pc", controller=True)
    env = role_env(KVSP_TOKEN=controller.token)
    with StandinNode() as node:
        caller = make_instance("ii1", node.url)
        report(caller, "ii1", status_record(node.url, ttl_ms=600_000))
        _redis("shutdown", "nosave")
        try:
            # Each server worker makes its task publisher ready as it starts: with the broker
            # gone that must neither stop the server nor fail its requests.
            server = start_process("server", "control", env, workers=1)
            response = httpx.put(
                f"{server.url}/kvsp/instances/ii1/state",
                json={"state": "draining"},
                headers={"Authorization": f"Bearer {controller.token}"},
                timeout=30,
            )
            assert response.status_code == 200, response.text
        finally:
            _start_redis()
        start_process("worker", "control-worker", env, queues=["control"])
        start_process("beat", "beat", env)
        wait_until(lambda: node.received("PUT", "/kvsp/state"), "state pushed", 90)
        wait_until(lambda: Instance.objects.get().pushed_state_version == 1, "recorded", 30)


def test_the_control_plane_rides_out_a_postgres_restart(role_env, start_process):
    scope = make_scope("tenant-a")
    holder = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    server = start_process("server", "control", role_env(), workers=1)
    headers = {"Authorization": f"Bearer {holder.token}"}

    def publish():
        record = replica_json(scope.scope_id_hex, COMPAT, random_key())
        path = f"{server.url}/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{record['block_key']}"
        return httpx.put(path, json=record, headers=headers, timeout=30)

    assert publish().status_code == 201
    cluster = subprocess.run(["ls", "/etc/postgresql"], capture_output=True, text=True).stdout
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", cluster.strip(), "main", "restart"],
        check=True,
        timeout=120,
    )
    connection.close()  # this test's own connection died with the server
    # The first request after the restart may find its pooled connection dead: it is answered
    # 503 with Retry-After (never a 500), and the next one works.
    codes = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = publish()
        codes.append(response.status_code)
        if response.status_code == 201:
            break
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"]
        time.sleep(0.5)
    assert codes[-1] == 201
