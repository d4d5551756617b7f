"""Fixtures shared by every test: the real database and broker, and role processes on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.processes import Beat, Server, Worker


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(__file__).resolve().parent.parent / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(autouse=True)
def _fresh_authentication_failures():
    """Each test starts with no failed authentication counted against 127.0.0.1 in this
    process. Servers count theirs in their own processes: a test that needs an address over
    its budget starts a server of its own (``tests/node/test_blocks.py``)."""
    from common.throttling import FAILED_AUTHENTICATIONS

    FAILED_AUTHENTICATIONS.clear()


@pytest.fixture(autouse=True)
def _fresh_lookup_tally():
    """Lookups (and the other tallied counts) counted by earlier tests in this process are
    dropped, never written: the tally
    writes on ``request_finished`` once its interval has passed, and a write landing inside
    another test would add a statement to its pinned query count, or counts to its buckets."""
    from common.metrics import tally
    from index import metrics

    metrics.lookup_tally.take()
    tally.take()
    yield
    metrics.lookup_tally.take()
    tally.take()


@pytest.fixture
def lookup_tally_not_due(monkeypatch):
    """The lookup tally does not come due during the test: the statements of a request that
    looks up do not depend on whether a second has passed since the tally last wrote."""
    from common import metrics as common_metrics
    from index import metrics

    monkeypatch.setattr(metrics, "LOOKUP_WRITE_INTERVAL_S", float("inf"))
    monkeypatch.setattr(common_metrics, "TALLY_WRITE_INTERVAL_S", float("inf"))


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """pytest-django's test database, whose teardown first closes the directive senders of
    this process: they keep their connections while busy, and a database with open
    connections cannot be dropped."""
    yield
    from placement import delivery

    delivery.close_senders()


@pytest.fixture(scope="session")
def database_url(django_db_setup, django_db_blocker) -> str:
    """A URL of the test database, for processes the tests start."""
    from django.db import connection

    settings_dict = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict["USER"] or "postgres"
    password = f":{settings_dict['PASSWORD']}" if settings_dict["PASSWORD"] else ""
    host = settings_dict["HOST"] or "127.0.0.1"
    port = settings_dict["PORT"] or 5432
    return f"postgres://{user}{password}@{host}:{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="session")
def role_env(database_url):
    """Build the environment of a role process that shares this test run's database and broker."""
    from django.conf import settings

    def build(**overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DATABASE_URL=database_url,
            CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
            CELERY_RESULT_BACKEND=settings.CELERY_RESULT_BACKEND,
            KVSP_VAR_DIR=str(settings.VAR_DIR),
            KVSP_ROLE="control",
            PYTHONUNBUFFERED="1",
        )
        env.update({key: str(value) for key, value in overrides.items()})
        return env

    return build


@pytest.fixture
def start_process(log_dir):
    """Start servers and workers; every one is stopped when the test ends."""
    started = []

    def start(kind: str, name: str, env: dict[str, str], **options):
        cls = {"server": Server, "worker": Worker, "beat": Beat}[kind]
        process = cls(name, env, log_dir, **options)
        started.append(process)
        return process.start()

    yield start
    for process in reversed(started):
        process.stop()
