"""Schemathesis with every check over the control plane's OpenAPI description, against a real
gunicorn server on Postgres: no 5xx, documented statuses and media types, responses that match
their schemas, authentication never ignored, nothing usable after it is deleted.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.fixtures import make_caller, make_scope
from tests.support.processes import BIN, ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_control_plane_survives_schemathesis(role_env, start_process, artifacts_dir):
    make_scope("tenant-a")
    fuzzer = make_caller("fuzzer", controller=True)
    server = start_process("server", "control", role_env(KVSP_RATE_LIMIT_PER_S="0"), workers=2)
    report = artifacts_dir / "schemathesis"
    shutil.rmtree(report, ignore_errors=True)
    result = subprocess.run(
        [
            str(BIN / "st"),
            "--config-file",
            str(CONFIG),
            "run",
            f"{server.url}/kvsp/schema?format=json",
            "--header",
            f"Authorization: Bearer {fuzzer.token}",
            "--checks",
            "all",
            "--max-time",
            "45",
            "--workers",
            "2",
            "--seed",
            "20261129",
            "--report",
            "junit",
            "--report-dir",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
