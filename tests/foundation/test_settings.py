"""Settings come from the environment once; bad values stop start-up with one clear line."""

import json
import os
import subprocess

import pytest

from tests.support.processes import PYTHON, ROOT

PRINT_SETTINGS = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'engine': s.DATABASES['default']['ENGINE'], "
    "'name': str(s.DATABASES['default']['NAME']), 'broker': s.CELERY_BROKER_URL, "
    "'role': s.KVSP_ROLE, 'urlconf': s.ROOT_URLCONF, 'max_ttl': s.KVSP_MAX_TTL_MS, "
    "'lease_octets': s.KVSP_LEASE_MAX_OCTETS, 'key_len': len(s.KVSP_MASTER_KEY)}))"
)

CONFIG_NAMES = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "KVSP_ROLE")


def clean_env(tmp_path, **values):
    env = {
        k: v for k, v in os.environ.items() if k not in CONFIG_NAMES and not k.startswith("KVSP_")
    }
    env.update(DJANGO_SETTINGS_MODULE="kvspsite.settings", KVSP_VAR_DIR=str(tmp_path))
    env.update(values)
    return env


def settings_of(tmp_path, **values):
    result = subprocess.run(
        [PYTHON, "-c", PRINT_SETTINGS],
        cwd=ROOT,
        env=clean_env(tmp_path, **values),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def manage_check(tmp_path, **values):
    return subprocess.run(
        [PYTHON, "manage.py", "check"],
        cwd=ROOT,
        env=clean_env(tmp_path, **values),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_embedded_default_needs_no_server(tmp_path):
    values = settings_of(tmp_path)
    assert values["engine"] == "django.db.backends.sqlite3"
    assert values["name"].startswith(str(tmp_path))
    assert values["broker"] == "filesystem://"
    assert values["role"] == "control"
    assert values["urlconf"] == "kvspsite.urls_control"
    assert values["key_len"] == 32
    # The generated development secret is reused, not regenerated, by the next process.
    first = (tmp_path / "secrets" / "KVSP_MASTER_KEY").read_text()
    settings_of(tmp_path)
    assert (tmp_path / "secrets" / "KVSP_MASTER_KEY").read_text() == first


def test_production_urls_and_numbers_are_read(tmp_path):
    values = settings_of(
        tmp_path,
        DATABASE_URL="postgres://kvsp@db.internal:5433/kvsp",
        CELERY_BROKER_URL="redis://cache.internal:6379/2",
        KVSP_ROLE="node",
        KVSP_MAX_TTL_MS="1234",
        KVSP_LEASE_MAX_OCTETS="4096",
    )
    assert values["engine"] == "django.db.backends.postgresql"
    assert values["name"] == "kvsp"
    assert values["broker"] == "redis://cache.internal:6379/2"
    assert values["urlconf"] == "kvspsite.urls_node"
    assert values["max_ttl"] == 1234
    assert values["lease_octets"] == 4096


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"KVSP_ROLE": "janitor"}, "KVSP_ROLE"),
        ({"DATABASE_URL": "not a url"}, "DATABASE_URL"),
        ({"DATABASE_URL": "oracle2://x/y"}, "DATABASE_URL"),
        ({"CELERY_BROKER_URL": "ftp://broker"}, "CELERY_BROKER_URL"),
        ({"KVSP_MAX_TTL_MS": "ten minutes"}, "KVSP_MAX_TTL_MS"),
        ({"KVSP_MASTER_KEY": "c2hvcnQ="}, "KVSP_MASTER_KEY"),
        ({"KVSP_PRODUCTION": "1"}, "KVSP_PRODUCTION"),
        ({"KVSP_ROLE": "node", "KVSP_CONTROL_URL": "cp.internal"}, "KVSP_CONTROL_URL"),
    ],
)
def test_bad_configuration_stops_startup_in_one_line(tmp_path, values, named):
    result = manage_check(tmp_path, **values)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stderr
