"""What the benchmarks share: a fresh Postgres database, the management commands, the geometry
of a Llama-3-8B block, a control plane with registered nodes to start processes for, and nginx
serving files as the limit a block transfer is compared with."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pwd
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.processes import register_node  # noqa: E402
from tests.support.descriptors import descriptor  # noqa: E402
from tests.support.processes import Process, Server, Worker, free_port, run_manage  # noqa: E402

PG = "postgres://postgres@127.0.0.1:5432"
BLOCK_TOKENS = 16
# A Llama-3-8B block of 16 tokens: 32 layers, 8 KV heads of 128, float16 (2 MiB).
DESCRIPTOR = descriptor(
    model="bench-llama-8b",
    model_digest="sha-256:" + "a1" * 32,
    tokenizer_digest="sha-256:" + "b2" * 32,
    layers=32,
    kv_heads=8,
    head_dim=128,
    positional="rope;theta=500000",
    block_tokens=BLOCK_TOKENS,
)
SECTION = BLOCK_TOKENS * 8 * 128 * 2  # octets of one K or V section of such a block


def store_random_block(
    client: httpx.Client,
    holder: str,
    ids: tuple[str, str, str],
    *,
    layers: int = 32,
    section: int = SECTION,
) -> int:
    """PUT a container of random octets (seeded by its key) at ``holder``; its size."""
    from kvsp.container import RAW_CODEC, encode, store_headers

    compat, scope, key = ids
    local = random.Random(key)
    data = encode(
        RAW_CODEC,
        0,
        BLOCK_TOKENS,
        [(local.randbytes(section), local.randbytes(section)) for _ in range(layers)],
    )
    response = client.put(
        f"{holder}blocks/{compat}/{scope}/{key}",
        content=data,
        headers=store_headers(hashlib.sha256(data).digest()),
    )
    assert response.status_code == 201, response.text
    return len(data)


def fresh_database(name: str) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def control_env(database: str, broker: str = "redis://127.0.0.1:6379/0", **extra: str) -> dict:
    """The environment of a control-plane process on ``database``: this process's, ``extra``
    added, with ``broker`` unless a broker is set already."""
    env = {**os.environ, "DATABASE_URL": f"{PG}/{database}", "KVSP_ROLE": "control", **extra}
    env.setdefault("CELERY_BROKER_URL", broker)
    return env


def control_in_process(database: str) -> None:
    """This process made the control plane on ``database``, created afresh; Django is set up
    after (``migrated_in_process``)."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="kvspsite.settings",
        DATABASE_URL=f"{PG}/{database}",
        KVSP_ROLE="control",
        KVSP_LOG_LEVEL="ERROR",
    )
    fresh_database(database)


def migrated_in_process():
    """Django set up in this process (on the database its environment names) and migrated;
    returns a function that runs a management command of the project and gives back the JSON
    it printed."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)

    def manage(*args: str) -> dict:
        out = io.StringIO()
        call_command(*args, stdout=out)
        return json.loads(out.getvalue())

    return manage


def manage_json(env: dict, *args: str) -> dict:
    done = run_manage(*args, env=env)
    if done.returncode:
        sys.exit(done.stderr)
    return json.loads(done.stdout)


class BenchCluster:
    """A fresh database with a scope, a controller principal and registered nodes (each with a
    principal of the scope, bound to its instance and its holder URL), and the environment of
    every process; the caller starts the processes it needs."""

    def __init__(self, label: str, database: str, members: list[str] | tuple[str, ...]):
        self.work = Path(tempfile.mkdtemp(prefix=f"kvsp-bench-{label}-"))
        self.shm = Path(tempfile.mkdtemp(prefix=f"kvsp-bench-{label}-", dir="/dev/shm"))
        run_id = os.urandom(3).hex()
        self.cp_port = free_port()
        self.ports = {member: free_port() for member in members}
        self.cp_url = f"http://127.0.0.1:{self.cp_port}/kvsp/"
        self.urls = {
            member: f"http://127.0.0.1:{port}/kvsp/" for member, port in self.ports.items()
        }
        self.names = {member: f"{member}-{run_id}" for member in members}
        broker = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/3")
        self.database_url = f"{PG}/{database}"
        self.base = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": broker,
            "CELERY_RESULT_BACKEND": broker,
            "KVSP_VAR_DIR": str(ROOT / "var"),
            "KVSP_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
        fresh_database(database)
        migrated = run_manage("migrate", "--no-input", env=self.base)
        if migrated.returncode:
            sys.exit(migrated.stderr)
        self.scope = manage_json(self.base, "kvsp_scope", "create", "bench")["scope_id"]
        self.controller = manage_json(
            self.base, "kvsp_principal", "create", "bench-pc", "--controller"
        )["token"]
        self.tokens = {}
        for member, name in self.names.items():
            self.tokens[member] = register_node(
                lambda *argv: manage_json(self.base, *argv), name, self.urls[member], self.scope
            )

    @property
    def control_env(self) -> dict:
        return {**self.base, "KVSP_TOKEN": self.controller}

    def node_env(self, member: str, **extra: str) -> dict:
        return {
            **self.base,
            "KVSP_ROLE": "node",
            "KVSP_INSTANCE": self.names[member],
            "KVSP_PUBLIC_URL": self.urls[member],
            "KVSP_CONTROL_URL": self.cp_url,
            "KVSP_TOKEN": self.tokens[member],
            "KVSP_SHM_DIR": str(self.shm),
            "KVSP_DISK_DIR": str(self.work / "disk"),
            **extra,
        }

    def node_server(self, member: str, **extra: str) -> Server:
        """The HTTP server of node ``member`` (not started), ``extra`` added to its
        environment."""
        env = self.node_env(member, **extra)
        return Server(f"bench-{member}", env, self.work, workers=2, port=self.ports[member])

    def node_worker(self, member: str, **extra: str) -> Worker:
        """The worker of node ``member`` (not started), ``extra`` added to its environment."""
        return Worker(
            f"bench-{member}-worker",
            self.node_env(member, **extra),
            self.work,
            queues=[f"ii.{self.names[member]}"],
            pool="threads",
            concurrency=4,
        )

    def run(self, processes: list, work) -> None:
        """Start ``processes``, call ``work(self)``, and stop them and remove the files
        whatever happens."""
        try:
            for process in processes:
                process.start()
            work(self)
        finally:
            for process in reversed(processes):
                process.stop()
            shutil.rmtree(self.shm, ignore_errors=True)
            shutil.rmtree(self.work, ignore_errors=True)


class CpuMeter:
    """CPU seconds (user + system) the processes of a run spend between two readings, by role:
    each started process with its descendants, Postgres and Redis, and this script. On a
    machine of few cores every role's CPU is taken from the others, so where a transfer's CPU
    goes says more than its wall time."""

    def __init__(self, processes: list):
        self.processes = processes
        self._tick = os.sysconf("SC_CLK_TCK")

    def _stats(self) -> dict[int, tuple[int, str, float]]:
        stats = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            stats[int(entry.name)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])))
        return stats

    def read(self) -> dict[str, float]:
        stats = self._stats()
        roles = {p.proc.pid: p.name for p in self.processes if p.proc is not None}
        roles[os.getpid()] = "this script"
        seconds: dict[str, float] = {}
        for pid, (ppid, name, ticks) in stats.items():
            role, parent = roles.get(pid), ppid
            while role is None and parent in stats:
                role = roles.get(parent)
                parent = stats[parent][0]
            if role is None and name.startswith(("postgres", "redis")):
                role = name.split(":")[0].split("-")[0]
            if role is not None:
                seconds[role] = seconds.get(role, 0.0) + ticks / self._tick
        return seconds

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {role: after[role] - before.get(role, 0.0) for role in after}


def ensure_nginx() -> str:
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if found is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "nginx-light"], check=True, capture_output=True
        )
        found = shutil.which("nginx") or "/usr/sbin/nginx"
    return found


class Nginx(Process):
    """nginx as a child process of its own: a temporary prefix, configuration and port."""

    def __init__(self, binary: str, root: Path, workdir: Path, log_dir: Path):
        self.port = free_port()
        user = pwd.getpwuid(os.geteuid()).pw_name
        for sub in ("client", "proxy", "fastcgi", "uwsgi", "scgi"):
            (workdir / sub).mkdir(exist_ok=True)
        conf = workdir / "nginx.conf"
        conf.write_text(
            f"""
{"user " + user + ";" if os.geteuid() == 0 else ""}
daemon off;
master_process on;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {workdir}/client;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{self.port};
        root {root};
    }}
}}
"""
        )
        super().__init__("nginx", [binary, "-p", str(workdir), "-c", str(conf)], {}, log_dir)

    ready_sign = "nginx listening"

    def ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1).status_code < 500
        except httpx.HTTPError:
            return False
