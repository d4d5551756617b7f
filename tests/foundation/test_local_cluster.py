"""The README's run command, in its short mode, on the embedded default: a whole cluster on this
machine with no server beyond its own processes, and the summary it prints.
"""

import json
import os
import subprocess

import pytest

from tests.support.processes import PYTHON, ROOT

pytestmark = pytest.mark.slow


def test_local_cluster_short_run(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env["KVSP_VAR_DIR"] = str(tmp_path / "launcher")
    result = subprocess.run(
        [PYTHON, "manage.py", "kvsp_cluster", "--short", "--json", "--dir", str(tmp_path / "c")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["sessions_completed"] == 4
    assert summary["hit_ratio"] > 0  # the shared prefix was found again
    assert summary["ttft_cached_ms"] > 0 and summary["ttft_cold_ms"] > 0
    assert summary["failover_ms"] > 0
    assert summary["failover_indices_once"] is True
    assert summary["reshard"] == "committed"
    assert "KVSP local cluster" in result.stdout
