"""The README's run command on the embedded default: a whole cluster on this machine with no
server beyond its own processes, the summary it prints, and how it stops.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import PYTHON, ROOT
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def embedded_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env["KVSP_VAR_DIR"] = str(tmp_path / "launcher")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def processes_of(directory: Path) -> list[int]:
    """Processes whose environment names ``directory``: those a cluster there started."""
    found = []
    marker = str(directory).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_local_cluster_short_run(tmp_path):
    cluster_dir = tmp_path / "c"
    result = subprocess.run(
        [PYTHON, "manage.py", "kvsp_cluster", "--short", "--json", "--dir", str(cluster_dir)],
        cwd=ROOT,
        env=embedded_env(tmp_path),
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
    # A placement sent a prefetch directive, and the node loaded the prefix from a peer.
    assert summary["directives"] >= 1 and summary["blocks_prefetched"] >= 1
    # Every node stayed active after the run, and no process ever waited out a database lock.
    assert summary["instances_active"] == summary["instances"] == 4  # 3 engines, 1 holder
    locked = [
        log.name
        for log in (cluster_dir / "logs").glob("*.log")
        if "database is locked" in log.read_text(errors="replace")
    ]
    assert locked == []
    assert "KVSP local cluster" in result.stdout
    assert processes_of(cluster_dir) == []


def _as_a_background_job() -> None:
    # What a shell does to a job it starts in the background: the cluster must stop on
    # Ctrl-C all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_every_process_within_seconds(tmp_path):
    cluster_dir = tmp_path / "c"
    launcher = subprocess.Popen(
        [PYTHON, "manage.py", "kvsp_cluster", "--requests", "2", "--dir", str(cluster_dir)],
        cwd=ROOT,
        env=embedded_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_a_background_job,
    )
    try:
        output = []
        for line in launcher.stdout:
            output.append(line)
            if "Ctrl-C stops the cluster" in line:
                break
        else:
            pytest.fail("the cluster never came up:\n" + "".join(output[-60:]))
        started = processes_of(cluster_dir)
        assert len(started) >= 11  # a control plane, its worker, beat and four nodes
        interrupted = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        try:
            rest, _ = launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Where it is stuck: the launcher runs with faulthandler, which prints every
            # thread's stack on SIGABRT.
            launcher.send_signal(signal.SIGABRT)
            rest, _ = launcher.communicate(timeout=30)
            pytest.fail("the launcher did not stop within 30 s after Ctrl-C:\n" + rest[-8000:])
        stopped_in = time.monotonic() - interrupted
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, rest
    assert "stopping 11 processes" in rest  # it says what it stops: all of them
    assert stopped_in < 15, stopped_in
    assert processes_of(cluster_dir) == []


LAUNCHER = """
import sys, time
from pathlib import Path
from devtools.processes import Process
Process("sleeper", ["sleep", "120"], {"KVSP_MARK": sys.argv[1]}, Path(sys.argv[1])).start()
print("started", flush=True)
time.sleep(120)
"""


def test_role_processes_die_with_a_launcher_that_is_killed(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout.readline().strip() == "started"
    [child] = processes_of(tmp_path)
    launcher.kill()
    launcher.wait(timeout=10)
    wait_until(lambda: processes_of(tmp_path) == [], f"end of process {child}", timeout=10)
