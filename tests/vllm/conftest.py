"""vLLM engines on KVSP: a control plane and a node on loopback, and vLLM engines (vLLM's CPU
build, in ``.venv-vllm``), each in a process of its own, driven by ``engine_process.py``.

- ``recompute``: no connector, the answer of computing every token;
- ``producer``: the connector on scope A; computes prompts and stores their blocks at the node;
- ``consumer``: the connector on scope A, fresh: what it does not compute it loads from KVSP.

The model is the reference model's architecture with head_dim 32 (the CPU attention backend
takes 32 and more), built locally from seeded random weights; blocks are 32 tokens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.processes import Server, free_port
from tests.vllm.engines import EngineProcess

BLOCK_TOKENS = 32
MAX_MODEL_LEN = 1024
MODEL = "kvsp-vllm-test-llama"
# head_dim 32: 128 hidden / 4 heads; 2 KV heads, 4 layers.
MODEL_SHAPE = {"layers": 4, "hidden_size": 128, "heads": 4, "kv_heads": 2}


@dataclass
class Engines:
    recompute: EngineProcess
    producer: EngineProcess
    consumer: EngineProcess


@dataclass
class VllmCluster:
    cp_url: str
    node_url: str
    node: Server
    compat: str
    scope_a: str
    scope_b: str
    scope_key_a: bytes
    tokens: dict[str, str]
    model_dir: Path
    shm_dir: Path
    disk_dir: Path
    node_name: str
    started: Engines | None = None

    def engines(self, log_dir: Path) -> list[EngineProcess]:
        """The recompute, producer and consumer engines, not yet started."""
        base = {
            "model_dir": str(self.model_dir),
            "block_size": BLOCK_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
        }
        return [
            EngineProcess("vllm-recompute", {**base, "connector": None}, log_dir),
            EngineProcess("vllm-producer", {**base, "connector": self.connector()}, log_dir),
            EngineProcess("vllm-consumer", {**base, "connector": self.connector()}, log_dir),
        ]

    def api(self, base: str, who: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        return httpx.Client(base_url=base, headers=headers, timeout=30)

    def connector(self, who: str = "engine_a") -> dict:
        return {
            "control_url": self.cp_url,
            "token": self.tokens[who],
            "scope_id": self.scope_a,
            "holder_url": self.node_url,
            "model": MODEL,
        }

    def block_files(self, block_key: str) -> list[Path]:
        pattern = f"{self.compat}.{self.scope_a}.{block_key}.kvb"
        return [
            path
            for root in (self.shm_dir, self.disk_dir)
            for path in (root / self.node_name).glob(pattern)
        ]


@pytest.fixture(scope="package")
def vllm_cluster(django_db_setup, django_db_blocker, role_env, log_dir, tmp_path_factory):
    from django.core.management import call_command

    from index.services import do_create_principal, do_create_scope, do_register_descriptor
    from kvsp.compat import compat_id_hex
    from placement.services import do_register_instance
    from workers.engines.modeldir import create_reference_model, reference_descriptor

    run = os.urandom(3).hex()
    shm_dir = Path(tempfile.mkdtemp(prefix=f"kvsp-vllm-{run}-", dir="/dev/shm"))
    disk_dir = tmp_path_factory.mktemp("disk")
    model_dir = create_reference_model(
        tmp_path_factory.mktemp("model"), max_positions=MAX_MODEL_LEN, **MODEL_SHAPE
    )
    descriptor = reference_descriptor(model_dir, block_tokens=BLOCK_TOKENS, model=MODEL)
    node_name = f"vllm-node-{run}"
    node_port = free_port()
    node_url = f"http://127.0.0.1:{node_port}/kvsp/"
    servers: list[Server] = []
    engines: list[EngineProcess] = []
    scope_key_a = os.urandom(32)
    try:
        with django_db_blocker.unblock():
            compat = compat_id_hex(descriptor)
            do_register_descriptor(descriptor, compat)
            scope_a = do_create_scope(f"vllm-a-{run}", scope_key=scope_key_a)
            scope_b = do_create_scope(f"vllm-b-{run}")
            a, b = bytes(scope_a.scope_id), bytes(scope_b.scope_id)
            do_register_instance(node_name, node_url)
            tokens = {
                "controller": do_create_principal(f"pc-{run}", controller=True).token,
                "node": do_create_principal(
                    f"node-{run}", scope_ids=[a, b], holder_urls=[node_url], instance=node_name
                ).token,
                "engine_a": do_create_principal(f"vllm-engine-a-{run}", scope_ids=[a]).token,
                "tenant_b": do_create_principal(f"tenant-b-{run}", scope_ids=[b]).token,
            }
        cp = Server(f"vllm-cp-{run}", role_env(KVSP_TOKEN=tokens["controller"]), log_dir)
        node_env = role_env(
            KVSP_ROLE="node",
            KVSP_INSTANCE=node_name,
            KVSP_PUBLIC_URL=node_url,
            KVSP_CONTROL_URL=f"{cp.url}/kvsp/",
            KVSP_TOKEN=tokens["node"],
            KVSP_SHM_DIR=str(shm_dir),
            KVSP_DISK_DIR=str(disk_dir),
            KVSP_REPLICA_TTL_MS="600000",
        )
        node = Server(f"vllm-node-{run}", node_env, log_dir, port=node_port)
        cluster = VllmCluster(
            cp_url=f"{cp.url}/kvsp/",
            node_url=node_url,
            node=node,
            compat=compat,
            scope_a=scope_a.scope_id_hex,
            scope_b=scope_b.scope_id_hex,
            scope_key_a=scope_key_a,
            tokens=tokens,
            model_dir=model_dir,
            shm_dir=shm_dir,
            disk_dir=disk_dir,
            node_name=node_name,
        )
        # The engines need the roles only for their first request: they import vLLM (the
        # longest part of starting) while the servers start.
        engines = cluster.engines(log_dir)
        for engine in engines:
            engine.start()
        servers = [cp, node]
        for server in servers:
            server.start()
        for engine in engines:
            engine.wait_ready()
        cluster.started = Engines(*engines)
        yield cluster
    finally:
        for engine in engines:
            engine.stop()
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(scope="package")
def engines(vllm_cluster) -> Engines:
    return vllm_cluster.started
