"""Both roles start as real servers; a task makes a round trip through the real broker."""

import os
import subprocess

import httpx
import pytest

from tests.foundation.test_settings import NODE_SETTINGS
from tests.support.processes import PYTHON, ROOT, Server, Worker, run_manage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("role", ["control", "node"])
def test_role_serves_health_and_schema(role, role_env, start_process):
    settings = NODE_SETTINGS if role == "node" else {"KVSP_ROLE": role}
    server = start_process("server", f"{role}-server", role_env(**settings), workers=1)
    health = httpx.get(f"{server.url}/healthz").json()
    assert health == {"status": "ok", "role": role}
    schema = httpx.get(f"{server.url}/kvsp/schema", params={"format": "json"})
    assert schema.status_code == 200
    assert schema.json()["openapi"].startswith("3.")
    missing = httpx.get(f"{server.url}/kvsp/nothing-here")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


def test_task_round_trip_through_the_broker(role_env, start_process):
    from kvspsite.celery import ping

    worker = start_process("worker", "control-worker", role_env(), queues=["control"])
    result = ping.apply_async(args=[{"n": 7}], queue="control")
    answer = result.get(timeout=30)
    assert answer["payload"] == {"n": 7}
    assert answer["pid"] != os.getpid()
    assert "kvsp.ping" in worker.log()


def test_embedded_default_runs_with_no_server(tmp_path, log_dir):
    """SQLite and a filesystem broker under var/: migrate, serve, and run a task."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env.update(KVSP_VAR_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    migrated = run_manage("migrate", "--no-input", env=env)
    assert migrated.returncode == 0, migrated.stderr
    assert (tmp_path / "kvsp.sqlite3").exists()

    server = Server("embedded-server", env, log_dir, workers=1)
    worker = Worker("embedded-worker", env, log_dir, queues=["control"])
    try:
        server.start()
        worker.start()
        assert httpx.get(f"{server.url}/healthz").json()["role"] == "control"
        call = subprocess.run(
            [
                PYTHON,
                "-c",
                "import django; django.setup(); from kvspsite.celery import ping; "
                "print(ping.delay('hello').get(timeout=30)['payload'])",
            ],
            cwd=ROOT,
            env={**env, "DJANGO_SETTINGS_MODULE": "kvspsite.settings"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert call.returncode == 0, call.stderr + worker.log()
        assert call.stdout.strip() == "hello"
    finally:
        worker.stop()
        server.stop()
