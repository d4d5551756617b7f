"""A cluster on loopback for the node tests, started once for the package: the control plane
(gunicorn, and its Celery worker on queue ``control``) and three nodes, each a gunicorn server
with ``KVSP_ROLE=node`` and a Celery worker on its queue ``ii.<name>`` with a pool of threads,
all on the test database and the Redis broker.

- ``n1`` and ``n2`` are ordinary nodes; ``n2`` runs the reference engine.
- ``n3`` has tiny tiers (two blocks of host, two of disk, half a block of device) and a lease
  quota of two blocks, for the eviction and quota tests.
- Every node marks a block used at each GET (``KVSP_ACCESS_RESOLUTION_MS=0``), so that the LRU
  tests need not wait out the default resolution of a second.
- The storage-only holders ``n1`` and ``n3`` report ``"engine": false``, so placement and
  failover never choose them, and a prefill and decode rate of one token a second.

The data the cluster needs (scopes, principals, instances, the descriptor) is committed
outside any test transaction, so that every process sees it; the tests run in transactions of
their own (``django_db``) and only read. The tables are flushed when the package is done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.node.support import Api
from tests.support.processes import Process, Server, Worker, free_port

BLOCK_OCTETS = 16_468  # a container of the reference geometry
TINY = {
    "KVSP_TIER_HOST_OCTETS": str(2 * BLOCK_OCTETS + 1000),
    "KVSP_TIER_DISK_OCTETS": str(2 * BLOCK_OCTETS + 1000),
    "KVSP_TIER_DEVICE_OCTETS": str(BLOCK_OCTETS // 2),
    "KVSP_LEASE_MAX_OCTETS": str(2 * BLOCK_OCTETS + 1000),
}
STATUS_TTL_MS = 3000
REPLICA_TTL_MS = 60_000
# Every GET marks its block used, so that a read shows in the LRU order at once, without waiting
# out the default resolution of a second.
ACCESS_RESOLUTION_MS = 0


@dataclass
class Node:
    name: str
    port: int
    env: dict
    log_dir: Path
    shm_dir: Path
    disk_dir: Path
    token: str
    server: Server | None = None
    worker: Worker | None = None
    http_workers: int = 2

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kvsp/"

    @property
    def queue(self) -> str:
        return f"ii.{self.name}"

    def processes(self) -> list[Process]:
        self.server = Server(
            f"{self.name}-http",
            self.env,
            self.log_dir,
            port=self.port,
            workers=self.http_workers,
        )
        self.worker = Worker(
            f"{self.name}-worker",
            self.env,
            self.log_dir,
            queues=[self.queue],
            pool="threads",
            concurrency=4,
        )
        return [self.server, self.worker]

    def stop(self) -> None:
        for process in (self.worker, self.server):
            if process is not None:
                process.stop()

    def restart(self) -> None:
        self.stop()
        start_all(self.processes())

    def api(self, token: str | None) -> Api:
        return Api(self.url, token)

    def host_files(self) -> list[Path]:
        directory = self.shm_dir / self.name
        return sorted(directory.iterdir()) if directory.is_dir() else []

    def disk_files(self) -> list[Path]:
        directory = self.disk_dir / self.name
        return sorted(directory.iterdir()) if directory.is_dir() else []


@dataclass
class Cluster:
    cp_url: str
    compat: str
    scope_a: str
    scope_b: str
    tokens: dict[str, str]
    nodes: dict[str, Node]
    model_dir: Path
    # The Placement Controller's worker (queue ``control``), for tests that crash it.
    control_worker: Worker | None = None

    def control(self, who: str = "controller") -> Api:
        return Api(self.cp_url, self.tokens[who])

    def node(self, key: str) -> Node:
        return self.nodes[key]


def start_all(processes: list[Process]) -> None:
    """Start every process first and then wait for each, so that they start side by side."""
    for process in processes:
        process.launch()
    for process in processes:
        process.wait_ready(timeout=90)


@contextmanager
def serving_http(nodes: dict[str, Node]):
    """The HTTP process of each of ``nodes`` started, one process of one worker each (no Celery
    worker), and every node stopped after."""
    for node in nodes.values():
        node.http_workers = 1
    try:
        start_all([node.processes()[0] for node in nodes.values()])
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


def extra_node(
    cluster: Cluster, role_env, log_dir: Path, name: str, scope_ids: list[bytes], **settings
) -> Node:
    """A further node, registered with a principal of ``scope_ids``, storing its tiers beside
    n1's and reporting to the cluster's control plane, with no engine (the caller needs the
    database unblocked and starts its processes)."""
    from index.services import do_create_principal
    from placement.models import Instance
    from placement.services import do_register_instance

    # The cluster outlives the nodes of earlier tests, and their instances stay registered: a
    # port one of them had, free again, is not a new instance's.
    port = free_port()
    while Instance.objects.filter(url=f"http://127.0.0.1:{port}/kvsp/").exists():
        port = free_port()
    url = f"http://127.0.0.1:{port}/kvsp/"
    do_register_instance(name, url)
    token = do_create_principal(
        f"node-{name}", scope_ids=scope_ids, holder_urls=[url], instance=name
    ).token
    holder = cluster.node("n1")
    env = role_env(
        KVSP_ROLE="node",
        KVSP_INSTANCE=name,
        KVSP_PUBLIC_URL=url,
        KVSP_CONTROL_URL=cluster.cp_url,
        KVSP_TOKEN=token,
        KVSP_SHM_DIR=str(holder.shm_dir),
        KVSP_DISK_DIR=str(holder.disk_dir),
        KVSP_REPLICA_TTL_MS="60000",
        KVSP_LEASE_MAX_TTL_MS="60000",
        KVSP_PREFILL_TOKENS_PER_S="1",
        KVSP_DECODE_TOKENS_PER_S="1",
        KVSP_ACCESS_RESOLUTION_MS=str(ACCESS_RESOLUTION_MS),
        **settings,
    )
    return Node(name, port, env, log_dir, holder.shm_dir, holder.disk_dir, token)


@pytest.fixture(scope="package")
def cluster(django_db_setup, django_db_blocker, role_env, log_dir, tmp_path_factory):
    from django.core.management import call_command

    from index.services import do_create_principal, do_create_scope, do_register_descriptor
    from kvsp.compat import compat_id_hex
    from placement.services import do_register_instance
    from workers.engines.modeldir import create_reference_model, reference_descriptor

    run = os.urandom(3).hex()
    shm_dir = Path(tempfile.mkdtemp(prefix=f"kvsp-test-{run}-", dir="/dev/shm"))
    nodes: dict[str, Node] = {}
    processes: list[Process] = []
    try:
        disk_dir = tmp_path_factory.mktemp("disk")
        model_dir = create_reference_model(tmp_path_factory.mktemp("model"))
        descriptor = reference_descriptor(model_dir, block_tokens=16)
        names = {key: f"{key}-{run}" for key in ("n1", "n2", "n3")}
        ports = {key: free_port() for key in names}
        urls = {key: f"http://127.0.0.1:{ports[key]}/kvsp/" for key in names}

        with django_db_blocker.unblock():
            compat = compat_id_hex(descriptor)
            do_register_descriptor(descriptor, compat)
            scope_a = do_create_scope(f"tenant-a-{run}")
            scope_b = do_create_scope(f"tenant-b-{run}")
            both = [bytes(scope_a.scope_id), bytes(scope_b.scope_id)]
            tokens = {
                "controller": do_create_principal(f"pc-{run}", controller=True).token,
                "reader_a": do_create_principal(f"reader-a-{run}", scope_ids=both[:1]).token,
                "reader_a2": do_create_principal(f"reader-a2-{run}", scope_ids=both[:1]).token,
                "reader_b": do_create_principal(f"reader-b-{run}", scope_ids=both[1:]).token,
            }
            for key, name in names.items():
                do_register_instance(name, urls[key])
                tokens[key] = do_create_principal(
                    f"node-{name}", scope_ids=both, holder_urls=[urls[key]], instance=name
                ).token

        # The control plane presents the controller's token to nodes (PUT state, directives,
        # resumes).
        cp_env = role_env(KVSP_TOKEN=tokens["controller"])
        cp = Server(f"cp-{run}", cp_env, log_dir, workers=2)
        cp_worker = Worker(f"cp-worker-{run}", cp_env, log_dir, queues=["control"])
        for key, name in names.items():
            env = role_env(
                KVSP_ROLE="node",
                KVSP_INSTANCE=name,
                KVSP_PUBLIC_URL=urls[key],
                KVSP_CONTROL_URL=f"{cp.url}/kvsp/",
                KVSP_TOKEN=tokens[key],
                KVSP_SHM_DIR=str(shm_dir),
                KVSP_DISK_DIR=str(disk_dir),
                KVSP_STATUS_TTL_MS=str(STATUS_TTL_MS),
                KVSP_REPLICA_TTL_MS=str(REPLICA_TTL_MS),
                KVSP_LEASE_MAX_TTL_MS="60000",
                KVSP_ACCESS_RESOLUTION_MS=str(ACCESS_RESOLUTION_MS),
            )
            if key == "n2":
                env["KVSP_MODEL_DIR"] = str(model_dir)
            else:
                env.update(KVSP_PREFILL_TOKENS_PER_S="1", KVSP_DECODE_TOKENS_PER_S="1")
            if key == "n3":
                env.update(TINY)
            nodes[key] = Node(name, ports[key], env, log_dir, shm_dir, disk_dir, tokens[key])

        processes = [cp, cp_worker] + [p for node in nodes.values() for p in node.processes()]
        start_all(processes)
        yield Cluster(
            cp_url=f"{cp.url}/kvsp/",
            compat=compat,
            scope_a=scope_a.scope_id_hex,
            scope_b=scope_b.scope_id_hex,
            tokens=tokens,
            nodes=nodes,
            model_dir=model_dir,
            control_worker=cp_worker,
        )
    finally:
        for node in nodes.values():
            node.stop()
        for process in processes:
            process.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@dataclass
class Standin:
    """A stand-in holder and the principal that publishes its records."""

    holder: object
    cluster: Cluster
    token: str

    def add(self, key: str, data: bytes, scope: str | None = None) -> dict:
        """Serve ``data`` under ``key`` and publish its record at the IS."""
        scope = scope or self.cluster.scope_a
        self.holder.blocks[key] = data
        record = self.holder.record(self.cluster.compat, scope, key)
        published = Api(self.cluster.cp_url, self.token).put(
            f"replicas/{self.cluster.compat}/{scope}/{key}", json=record
        )
        assert published.status_code in (200, 201), published.text
        return record


@pytest.fixture(scope="module")
def standin(cluster, django_db_blocker):
    from index.services import do_create_principal
    from tests.node.support import StandinHolder

    with StandinHolder() as holder:
        with django_db_blocker.unblock():
            from index.models import Scope

            scope = Scope.objects.get(scope_id=bytes.fromhex(cluster.scope_a))
            token = do_create_principal(
                f"standin-{os.urandom(3).hex()}",
                scope_ids=[bytes(scope.scope_id)],
                holder_urls=[holder.url],
            ).token
        yield Standin(holder, cluster, token)
