"""Time to first token on vLLM's CPU build for a prompt with a 2,048-token shared prefix: the
prefix loaded through KVSP against the prefix recomputed.

A control plane and a node on loopback (Postgres, no Celery), and three vLLM engines (vLLM's CPU
build from ``.venv-vllm``, each in a process of its own, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
float32, blocks of 32 tokens, vLLM's own prefix cache off) on a Llama-architecture model built
locally from seeded random weights, head_dim 64: ``small`` (the default) has 8 layers, hidden
size 512 and 4 KV heads (512 KiB a block), ``wide`` 12 layers, hidden size 768 and 4 KV heads
(768 KiB a block):

- a producer with ``KVSPConnector`` computes the prefix followed by one tail and stores the 64
  blocks at the node, which publishes them;
- a fresh consumer with ``KVSPConnector`` serves the prefix followed by another tail: it looks
  the prompt up, loads the 64 blocks from the node (each layer verified) and computes the tail;
- an engine without a connector computes the same prompt whole.

Each round uses a new prefix; the figure is the median over the rounds of the wall time of a
one-token request (its time to first token). The limit is the recomputed time measured in the
same run: loading through KVSP must be quicker than computing. Both answers must be the same
token. Also printed: the time the connector's own client takes to look the 64 blocks up and
fetch and verify them (as many at once as the connector does), outside vLLM.

    .venv/bin/python bench/bench_vllm.py [--rounds N] [--model small|wide]

Needs Postgres on 127.0.0.1 and ``make vllm-env``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from bench.support import BenchCluster  # noqa: E402
from kvsp.blockkeys import block_keys_hex  # noqa: E402
from kvsp.compat import compat_id_hex  # noqa: E402
from kvsp_vllm.client import FETCHES_AT_ONCE, KvspClient  # noqa: E402
from tests.support.processes import Server  # noqa: E402
from tests.vllm.engines import EngineProcess  # noqa: E402
from workers.engines.modeldir import create_reference_model, reference_descriptor  # noqa: E402

DB = "kvsp_bench_vllm"
MODEL = "kvsp-bench-vllm-llama"
MODEL_SHAPES = {
    "small": {"layers": 8, "hidden_size": 512, "heads": 8, "kv_heads": 4},
    "wide": {"layers": 12, "hidden_size": 768, "heads": 12, "kv_heads": 4},
}
BLOCK_TOKENS = 32
PREFIX_TOKENS = 2048
TAIL_TOKENS = 37
MAX_MODEL_LEN = 4096


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(count)]


def fetch(client: KvspClient, record) -> None:
    client.fetch_block(
        record, max_size=1 << 22, deadline=time.monotonic() + 30, on_layer=lambda layer: None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="small")
    options = parser.parse_args()
    shape = MODEL_SHAPES[options.model]
    block_octets = (
        2 * shape["layers"] * BLOCK_TOKENS * shape["kv_heads"] * 64 * 4  # head_dim 64, float32
    )

    cluster = BenchCluster("vllm", DB, ("n1",))
    model_dir = create_reference_model(cluster.work / "model", max_positions=MAX_MODEL_LEN, **shape)
    descriptor = reference_descriptor(model_dir, block_tokens=BLOCK_TOKENS, model=MODEL)
    compat = compat_id_hex(descriptor)
    logs = cluster.work / "logs"
    logs.mkdir()
    cp = Server("bench-vllm-cp", cluster.control_env, logs, port=cluster.cp_port)
    node = Server("bench-vllm-n1", cluster.node_env("n1"), logs, port=cluster.ports["n1"])
    connector = {
        "control_url": cluster.cp_url,
        "token": cluster.tokens["n1"],
        "scope_id": cluster.scope,
        "holder_url": cluster.urls["n1"],
        "model": MODEL,
    }
    base = {"model_dir": str(model_dir), "block_size": BLOCK_TOKENS, "max_model_len": MAX_MODEL_LEN}
    engines = {
        "recompute": EngineProcess("bench-vllm-recompute", {**base, "connector": None}, logs),
        "producer": EngineProcess("bench-vllm-producer", {**base, "connector": connector}, logs),
        "consumer": EngineProcess("bench-vllm-consumer", {**base, "connector": connector}, logs),
    }

    def work(cluster: BenchCluster) -> None:
        headers = {"Authorization": f"Bearer {cluster.controller}"}
        registered = httpx.put(f"{cluster.cp_url}compat/{compat}", json=descriptor, headers=headers)
        assert registered.status_code in (200, 201), registered.text
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            engine.wait_ready()
        for engine in engines.values():  # the first request of an engine pays for warming up
            engine.generate(tokens(999, 40), max_tokens=1)
        client = KvspClient(cluster.cp_url, cluster.tokens["n1"])
        scope_key = client.scope_key(cluster.scope)
        loaded, computed, fetched = [], [], []
        for round_ in range(options.rounds):
            prefix = tokens(round_, PREFIX_TOKENS)
            engines["producer"].generate(prefix + tokens(1000 + round_, TAIL_TOKENS), max_tokens=1)
            assert engines["producer"].drain()["store_failed"] == 0
            prompt = prefix + tokens(2000 + round_, TAIL_TOKENS)
            via_kvsp = engines["consumer"].generate(prompt, max_tokens=1)
            assert via_kvsp["cached_tokens"] == PREFIX_TOKENS, via_kvsp
            recomputed = engines["recompute"].generate(prompt, max_tokens=1)
            assert via_kvsp["tokens"] == recomputed["tokens"]
            loaded.append(via_kvsp["elapsed_s"])
            computed.append(recomputed["elapsed_s"])

            keys = block_keys_hex(scope_key, bytes.fromhex(compat), prefix, BLOCK_TOKENS)
            started = time.perf_counter()
            records = [block.replicas[0] for block in client.lookup(cluster.scope, compat, keys)]
            with ThreadPoolExecutor(FETCHES_AT_ONCE) as pool:
                list(pool.map(fetch, [client] * len(records), records))
            fetched.append(time.perf_counter() - started)
        client.close()

        via, whole = statistics.median(loaded), statistics.median(computed)
        blocks = PREFIX_TOKENS // BLOCK_TOKENS
        print(
            f"vLLM CPU, model {options.model} {shape}, {PREFIX_TOKENS}-token shared prefix "
            f"({blocks} blocks of {block_octets >> 10} KiB) + {TAIL_TOKENS}-token tail, "
            f"median of {options.rounds} rounds"
        )
        print(f"  TTFT, prefix loaded through KVSP: {via * 1e3:8.1f} ms")
        print(f"  TTFT, prefix recomputed:          {whole * 1e3:8.1f} ms")
        print(
            f"  lookup + fetch + verify of the {blocks} blocks by the connector's client alone: "
            f"{statistics.median(fetched) * 1e3:.1f} ms"
        )
        ratio = via / whole
        print(f"  ratio KVSP / recomputed: {ratio:.3f} (limit 1.0, measured in this run)")
        if ratio >= 1.0:
            sys.exit("loading the prefix through KVSP was not quicker than computing it")

    try:
        cluster.run([cp, node], work)
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    main()
