"""Soak: a control plane under steady load for minutes, with a node killed in the middle.

Load, all from other processes on loopback:
- status reports from 1,000 simulated instances (wrk, one Lua script cycling over the
  instances and their tokens, as fast as the server answers on 4 connections);
- publishes of fresh replicas by 2 holders, and lookups of what was published (Python threads
  that record every answer);
- a real node (gunicorn + Celery worker) reporting its own status, killed with SIGKILL half way.

At the end: the error rate of each stream, p50/p99 latencies, and "nothing lost": every publish
that was acknowledged is found again by a lookup (the holders stay alive), and the killed node is
marked failed on the controller's clock.

Run: .venv/bin/python bench/soak.py --seconds 300   (Postgres and Redis on 127.0.0.1; wrk)
The reliability suite runs it for a short time (tests/reliability/test_soak.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_index import ensure_wrk, percentile  # noqa: E402
from bench.bench_placement import write_status_script  # noqa: E402
from bench.support import control_env, fresh_database  # noqa: E402
from devtools.processes import Beat, Server, Worker, free_port, run_manage  # noqa: E402
from tests.support.replicas import replica_json  # noqa: E402

COMPAT = "ab" * 32
HOLDERS = ["http://soak-holder-a.test/kvsp/", "http://soak-holder-b.test/kvsp/"]


def _json(result):
    if result.returncode:
        sys.exit(result.stderr)
    return json.loads(result.stdout)


def prepare(env: dict, instances: int) -> dict:
    """Database, principals and the simulated instances, through the management commands."""
    fresh_database(env["DATABASE_URL"].rsplit("/", 1)[1])
    if run_manage("migrate", "--no-input", env=env).returncode:
        sys.exit("migrate failed")
    scope = _json(run_manage("kvsp_scope", "create", "soak", env=env))["scope_id"]
    holder_args = [arg for url in HOLDERS for arg in ("--holder", url)]
    holders = _json(
        run_manage(
            "kvsp_principal", "create", "soak-holders", "--scope", scope, *holder_args, env=env
        )
    )["token"]
    controller = _json(run_manage("kvsp_principal", "create", "soak-pc", "--controller", env=env))
    # Simulated instances: registered and given principals in one process, for speed.
    script = (
        "import django, json, sys; django.setup()\n"
        "from index.services import do_create_principal\n"
        "from placement.services import do_register_instance\n"
        "tokens = {}\n"
        f"for i in range({instances}):\n"
        "    name = f'sim{i:04d}'\n"
        "    do_register_instance(name, f'http://{name}.test/kvsp/')\n"
        "    tokens[name] = do_create_principal(f'node-{name}', instance=name).token\n"
        "print(json.dumps(tokens))\n"
    )
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "DJANGO_SETTINGS_MODULE": "kvspsite.settings"},
    )
    return {
        "scope": scope,
        "holders": holders,
        "controller": controller["token"],
        "instances": _json(result),
    }


def status_body(name: str, epoch: int, ttl_ms: int) -> dict:
    return {
        "instance": f"http://{name}.test/kvsp/",
        "epoch": epoch,
        "state": "active",
        "running": 1,
        "queued": 0,
        "batch_size": 16,
        "kv_utilization": 0.2,
        "prefill_tokens_per_s": 20_000,
        "decode_tokens_per_s": 2_000,
        "links": [],
        "requested_state": None,
        "ttl_ms": ttl_ms,
    }


class Stream:
    """Outcomes and latencies of one kind of request."""

    def __init__(self, name: str):
        self.name = name
        self.latencies: list[float] = []
        self.errors = 0
        self.lock = threading.Lock()

    def record(self, seconds: float, ok: bool) -> None:
        with self.lock:
            self.latencies.append(seconds * 1000)
            self.errors += not ok

    def line(self) -> str:
        count = len(self.latencies)
        if not count:
            return f"  {self.name}: none"
        return (
            f"  {self.name}: {count} requests, error rate {self.errors / count:.4f}, "
            f"p50 {statistics.median(self.latencies):.1f} ms, "
            f"p99 {percentile(self.latencies, 0.99):.1f} ms"
        )


def run(seconds: int, instances: int) -> dict:
    env = control_env(
        "kvsp_soak",
        "redis://127.0.0.1:6379/8",
        KVSP_RATE_LIMIT_PER_S="0",
        KVSP_FAILURE_CHECK_S="0.5",
    )
    setup = prepare(env, instances)
    logs = Path(tempfile.mkdtemp(prefix="kvsp-soak-"))
    control = Server(
        "soak-control", {**env, "KVSP_TOKEN": setup["controller"]}, logs, workers=2
    ).start()
    control_worker = Worker(
        "soak-control-worker", {**env, "KVSP_TOKEN": setup["controller"]}, logs, queues=["control"]
    ).start()
    beat = Beat("soak-beat", {**env, "KVSP_TOKEN": setup["controller"]}, logs).start()
    # A real node that reports its own status, to be killed half way.
    node_port = free_port()
    node_url = f"http://127.0.0.1:{node_port}/kvsp/"
    run_manage("kvsp_instance", "add", "soak-node", "--url", node_url, env=env)
    node_token = _json(
        run_manage(
            "kvsp_principal",
            "create",
            "node-soak-node",
            "--instance",
            "soak-node",
            "--holder",
            node_url,
            env=env,
        )
    )["token"]
    node_env = {
        **env,
        "KVSP_ROLE": "node",
        "KVSP_INSTANCE": "soak-node",
        "KVSP_PUBLIC_URL": node_url,
        "KVSP_CONTROL_URL": f"{control.url}/kvsp/",
        "KVSP_TOKEN": node_token,
        "KVSP_STATUS_TTL_MS": "1500",
        "KVSP_SHM_DIR": str(logs / "shm"),
        "KVSP_DISK_DIR": str(logs / "disk"),
    }
    node_http = Server("soak-node-http", node_env, logs, workers=1, port=node_port).start()
    node_worker = Worker(
        "soak-node-worker", node_env, logs, queues=["ii.soak-node"], pool="threads", concurrency=2
    ).start()
    processes = [node_worker, node_http, beat, control_worker, control]

    stop = threading.Event()
    publishes, lookups = Stream("publishes"), Stream("lookups")
    acknowledged: list[str] = []
    headers = {"Authorization": f"Bearer {setup['holders']}"}
    base = control.url

    def publisher(holder: str):
        rng = random.Random(holder)
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                key = rng.randbytes(32).hex()
                path = f"{base}/kvsp/replicas/{COMPAT}/{setup['scope']}/{key}"
                start = time.perf_counter()
                try:
                    answer = client.put(
                        path,
                        json=replica_json(
                            setup["scope"],
                            COMPAT,
                            key,
                            holder,
                            layers=8,
                            size=65536,
                            ttl_ms=600_000,
                        ),
                        headers=headers,
                    )
                    ok = answer.status_code in (200, 201)
                except httpx.HTTPError:
                    ok = False
                publishes.record(time.perf_counter() - start, ok)
                if ok:
                    with publishes.lock:
                        acknowledged.append(key)

    def looker():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                with publishes.lock:
                    sample = random.sample(acknowledged, min(32, len(acknowledged)))
                if not sample:
                    time.sleep(0.05)
                    continue
                start = time.perf_counter()
                try:
                    answer = client.post(
                        f"{base}/kvsp/lookup",
                        headers=headers,
                        json={
                            "scope_id": setup["scope"],
                            "compat_id": COMPAT,
                            "block_keys": sample,
                        },
                    )
                    ok = answer.status_code == 200 and answer.json()["matched"] == len(sample)
                except httpx.HTTPError:
                    ok = False
                lookups.record(time.perf_counter() - start, ok)

    threads = [threading.Thread(target=publisher, args=(h,)) for h in HOLDERS]
    threads.append(threading.Thread(target=looker))
    # Every instance reports about every instances / rate seconds; the TTL leaves room for it.
    ttl_ms = 60_000
    lines = [
        (token, f"/kvsp/instances/{name}/status", status_body(name, 1, ttl_ms))
        for name, token in setup["instances"].items()
    ]
    status_result = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            script = write_status_script(directory, lines)
            wrk_bin = ensure_wrk()
            import subprocess

            def reporter():
                # Closed loop on 4 connections: as many reports as the server takes, which is
                # the status rate of BENCHMARKS.md on this machine.
                out = subprocess.run(
                    [wrk_bin, "-t1", "-c4", f"-d{seconds}s", "--latency", "-s", script, base],
                    capture_output=True,
                    text=True,
                )
                status_result["out"] = out.stdout

            threads.append(threading.Thread(target=reporter))
            for thread in threads:
                thread.start()
            time.sleep(seconds / 2)
            killed_at = time.monotonic()
            node_worker.kill()
            node_http.kill()
            detected_after_s = None
            with httpx.Client(timeout=30) as watcher:
                auth = {"Authorization": f"Bearer {setup['controller']}"}
                while time.monotonic() - killed_at < seconds / 2:
                    state = watcher.get(f"{base}/kvsp/instances/soak-node", headers=auth)
                    if detected_after_s is None and state.json()["state"] == "failed":
                        detected_after_s = time.monotonic() - killed_at
                    time.sleep(0.2)
            stop.set()
            for thread in threads:
                thread.join(timeout=seconds + 60)
        # Nothing lost: every acknowledged publish is found.
        with httpx.Client(timeout=60) as client:
            missing = 0
            for start in range(0, len(acknowledged), 1000):
                keys = acknowledged[start : start + 1000]
                found = 0
                for key in keys:
                    answer = client.get(
                        f"{base}/kvsp/replicas/{COMPAT}/{setup['scope']}/{key}", headers=headers
                    )
                    found += answer.status_code == 200
                missing += len(keys) - found
            node = client.get(
                f"{base}/kvsp/instances/soak-node",
                headers={"Authorization": f"Bearer {setup['controller']}"},
            ).json()
    finally:
        for process in processes:
            process.stop()
    out = status_result.get("out", "")
    import re

    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    total = re.search(r"(\d+) requests in", out)
    p99 = re.search(r"99%\s+([\d.]+)(\w+)", out)
    return {
        "seconds": seconds,
        "status_rate": float(rate.group(1)) if rate else 0.0,
        "status_requests": int(total.group(1)) if total else 0,
        "status_errors": int(non2xx.group(1)) if non2xx else 0,
        "status_p99": f"{p99.group(1)} {p99.group(2)}" if p99 else "n/a",
        "publishes": publishes,
        "lookups": lookups,
        "acknowledged": len(acknowledged),
        "missing": missing,
        "killed_node_state": node["state"],
        "failed_after_s": detected_after_s,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=300)
    parser.add_argument("--instances", type=int, default=1000)
    args = parser.parse_args()
    result = run(args.seconds, args.instances)
    print(
        f"soak: {result['seconds']} s, {args.instances} simulated instances, a node killed half way"
    )
    print(
        f"  status reports: {result['status_requests']} at {result['status_rate']:.0f}/s, "
        f"{result['status_errors']} errors, p99 {result['status_p99']}"
    )
    print(result["publishes"].line())
    print(result["lookups"].line())
    print(
        f"  nothing lost: {result['acknowledged']} acknowledged publishes, "
        f"{result['missing']} missing"
    )
    detected = result["failed_after_s"]
    print(
        f"  killed node: {result['killed_node_state']}, marked failed "
        + (f"{detected:.1f} s after the kill" if detected is not None else "never")
    )


if __name__ == "__main__":
    main()
