"""Settings come from the environment once; bad values stop start-up with one clear line."""

import base64
import json
import os
import re
import subprocess

import pytest

from tests.support.processes import PYTHON, ROOT

PRINT_SETTINGS = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'engine': s.DATABASES['default']['ENGINE'], "
    "'name': str(s.DATABASES['default']['NAME']), 'broker': s.CELERY_BROKER_URL, "
    "'role': s.KVSP_ROLE, 'urlconf': s.ROOT_URLCONF, 'max_ttl': s.KVSP_MAX_TTL_MS, "
    "'lease_octets': s.KVSP_LEASE_MAX_OCTETS, 'key': s.KVSP_MASTER_KEY.hex()}))"
)

CONFIG_NAMES = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "KVSP_ROLE")
# What every node needs: its name, its base URL, the control plane's and its token.
NODE_SETTINGS = {
    "KVSP_ROLE": "node",
    "KVSP_INSTANCE": "ii1",
    "KVSP_PUBLIC_URL": "http://ii1.internal:8001/kvsp/",
    "KVSP_CONTROL_URL": "http://cp.internal:8000/kvsp/",
    "KVSP_TOKEN": "kvsp_node-token",
}


def clean_env(tmp_path, **values):
    env = {
        k: v for k, v in os.environ.items() if k not in CONFIG_NAMES and not k.startswith("KVSP_")
    }
    env.update(DJANGO_SETTINGS_MODULE="kvspsite.settings", KVSP_VAR_DIR=str(tmp_path))
    env.update(values)
    return env


def printed_by(tmp_path, script: str, **values):
    result = subprocess.run(
        [PYTHON, "-c", script],
        cwd=ROOT,
        env=clean_env(tmp_path, **values),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def settings_of(tmp_path, **values):
    return printed_by(tmp_path, PRINT_SETTINGS, **values)


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
    assert len(bytes.fromhex(values["key"])) == 32
    # The generated development secret is reused, not regenerated, by the next process.
    first = (tmp_path / "secrets" / "KVSP_MASTER_KEY").read_text()
    settings_of(tmp_path)
    assert (tmp_path / "secrets" / "KVSP_MASTER_KEY").read_text() == first


def test_production_urls_and_numbers_are_read(tmp_path):
    values = settings_of(
        tmp_path,
        DATABASE_URL="postgres://kvsp@db.internal:5433/kvsp",
        CELERY_BROKER_URL="redis://cache.internal:6379/2",
        **NODE_SETTINGS,
        KVSP_MAX_TTL_MS="1234",
        KVSP_LEASE_MAX_OCTETS="4096",
    )
    assert values["engine"] == "django.db.backends.postgresql"
    assert values["name"] == "kvsp"
    assert values["broker"] == "redis://cache.internal:6379/2"
    assert values["urlconf"] == "kvspsite.urls_node"
    assert values["max_ttl"] == 1234
    assert values["lease_octets"] == 4096


KEY = bytes(range(32))


@pytest.mark.parametrize(
    ("value", "key"),
    [
        # 64 hex digits are valid base64 too, but of 48 octets: they are read as hex.
        (KEY.hex(), KEY),
        (KEY.hex().upper(), KEY),
        (base64.b64encode(KEY).decode(), KEY),
        ("hex:" + KEY.hex(), KEY),
        ("base64:" + base64.b64encode(KEY).decode(), KEY),
        ("hex:" + KEY[:16].hex(), KEY[:16]),
        # 48 hex digits are base64 of 36 octets, no AES key: hex, a 24-octet key.
        (KEY[:24].hex(), KEY[:24]),
        # 32 hex digits are base64 of a 24-octet key, and were always read so: a scope key
        # stored under that key stays readable. The prefix says which is meant.
        (KEY[:16].hex(), base64.b64decode(KEY[:16].hex())),
    ],
    ids=["hex", "hex-upper", "base64", "hex:", "base64:", "hex:-16", "hex-24", "32-digits"],
)
def test_master_key_in_hex_or_base64(tmp_path, value, key):
    assert settings_of(tmp_path, KVSP_MASTER_KEY=value)["key"] == key.hex()


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"KVSP_ROLE": "janitor"}, "KVSP_ROLE"),
        ({"DATABASE_URL": "not a url"}, "DATABASE_URL"),
        ({"DATABASE_URL": "oracle2://x/y"}, "DATABASE_URL"),
        ({"CELERY_BROKER_URL": "ftp://broker"}, "CELERY_BROKER_URL"),
        ({"KVSP_MAX_TTL_MS": "ten minutes"}, "KVSP_MAX_TTL_MS"),
        ({"KVSP_MASTER_KEY": "c2hvcnQ="}, "KVSP_MASTER_KEY"),
        ({"KVSP_MASTER_KEY": "hex:" + "ab" * 31}, "KVSP_MASTER_KEY"),
        ({"KVSP_MASTER_KEY": "hex:" + "zz" * 32}, "KVSP_MASTER_KEY"),
        ({"KVSP_MASTER_KEY": "base64:" + "ab" * 32}, "KVSP_MASTER_KEY"),
        ({"KVSP_PRODUCTION": "1"}, "KVSP_PRODUCTION"),
        ({**NODE_SETTINGS, "KVSP_CONTROL_URL": "cp.internal"}, "KVSP_CONTROL_URL"),
        ({**NODE_SETTINGS, "KVSP_PUBLIC_URL": "http://ii1.internal/<b>/"}, "KVSP_PUBLIC_URL"),
        ({**NODE_SETTINGS, "KVSP_SESSION_HOLDERS": 'http://h.test/"/'}, "KVSP_SESSION_HOLDERS"),
    ],
)
def test_bad_configuration_stops_startup_in_one_line(tmp_path, values, named):
    result = manage_check(tmp_path, **values)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stderr


PRINT_MIDDLEWARE = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "print(json.dumps(s.MIDDLEWARE))"
)


def middleware_of(tmp_path, **values) -> list[str]:
    return printed_by(tmp_path, PRINT_MIDDLEWARE, **values)


# What a node serves none of: logins, sessions, forms, admin messages, HTML pages, static files.
BROWSER_MIDDLEWARE = {
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
}
API_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "common.metrics.RequestMetricsMiddleware",
    "common.api.ProblemDetailsMiddleware",
    "django.middleware.common.CommonMiddleware",
]


def test_a_node_runs_only_the_middleware_an_api_needs_and_passes_its_checks(tmp_path):
    control = middleware_of(tmp_path)
    assert BROWSER_MIDDLEWARE <= set(control)
    assert [name for name in control if name not in BROWSER_MIDDLEWARE] == API_MIDDLEWARE
    assert middleware_of(tmp_path, **NODE_SETTINGS) == API_MIDDLEWARE
    checked = manage_check(tmp_path, **NODE_SETTINGS)
    assert checked.returncode == 0, checked.stderr


def test_every_variable_the_code_reads_is_documented():
    """An operator configures a process from docs/configuration.md alone: a variable the
    settings (or the servers' configuration) read and the page does not name is a setting no
    one can find."""
    sources = [ROOT / "kvspsite" / "settings.py", ROOT / "gunicorn.conf.py"]
    read = set()
    for source in sources:
        read |= set(
            re.findall(
                r"\"((?:KVSP|DJANGO|DATABASE|CELERY|PROMETHEUS)_[A-Z0-9_]+)\"", source.read_text()
            )
        )
    read.discard("DJANGO_SETTINGS_MODULE")
    documented = (ROOT / "docs" / "configuration.md").read_text()
    assert len(read) > 50
    assert sorted(name for name in read if f"`{name}`" not in documented) == []
