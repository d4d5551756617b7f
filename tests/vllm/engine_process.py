"""A vLLM engine in a process of its own, driven over stdin and stdout (run by ``.venv-vllm``).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m tests.vllm.engine_process CONFIG_JSON

CONFIG_JSON: ``{"model_dir", "block_size", "max_model_len", "connector": extra config or
null}``. The engine runs in this one process (that variable, and executor "uni"), greedy,
float32, without vLLM's own prefix cache, so every answer comes from KVSP or from computing.
One JSON line on stdout when ready, then one per command read from stdin:

- ``{"op": "generate", "prompt": [ids], "max_tokens": n}`` -> ``{"tokens", "logprobs",
  "cached_tokens", "counts", "elapsed_s"}``: the greedy tokens, the logprob of each, the prompt
  tokens vLLM did not compute, the connector's counts after the request and its wall time;
- ``{"op": "drain"}`` -> ``{"counts"}`` once every store submitted so far is done;
- ``{"op": "compat"}`` -> ``{"compat_id", "descriptor"}``, as the connector computes them;
- ``{"op": "probe_layout"}`` -> per dtype, ``{"isa", "k", "v"}``: the CPU kernels vLLM picks
  and whether ``CpuLayout`` reads back what vLLM's own cache writer stored.

Replies are the stdout lines that start with ``kvsp-engine: ``; the process exits at the end
of its input, once the stores submitted are done.

This file imports vLLM and is never collected by the main test suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
from vllm import LLM, SamplingParams
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvsp.compat import compat_id_hex
from kvsp_vllm.connector import engine_descriptor
from kvsp_vllm.layouts import CpuLayout, Geometry
from kvsp_vllm.settings import ConnectorSettings

REPLY = "kvsp-engine: "


def reply(obj: dict) -> None:
    # vLLM logs to stdout too; the prefix marks the lines meant for the test.
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


PROBE_GEOMETRY = Geometry(block_tokens=32, kv_heads=2, head_dim=64)
PROBE_BLOCKS = 6


def probe_layout(dtype: torch.dtype) -> dict:
    """The instruction set vLLM picks for ``dtype``, and whether K and V read back through
    ``CpuLayout`` exactly as vLLM's own ``cpu_attn_reshape_and_cache`` stored them at random
    slots."""
    n, h, d = PROBE_GEOMETRY.block_shape
    isa = _get_attn_isa(dtype, n, d, "auto")
    layout = CpuLayout(PROBE_GEOMETRY)
    cache = torch.zeros(layout.cache_shape(PROBE_BLOCKS), dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(2 * n, h, d, generator=generator).to(dtype)
    v = torch.randn(2 * n, h, d, generator=generator).to(dtype)
    # Tokens 0..n-1 into block 4 and n..2n-1 into block 1, each block's offsets shuffled.
    slots = torch.cat(
        [
            4 * n + torch.randperm(n, generator=generator),
            1 * n + torch.randperm(n, generator=generator),
        ]
    )
    key_cache, value_cache = cache.view(PROBE_BLOCKS, h, 2 * n, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    results = {"isa": isa, "k": True, "v": True}
    for block in (4, 1):
        read_k, read_v = layout.read(cache, block)
        mine = (slots // n) == block
        order = slots[mine] % n
        results["k"] &= bool(read_k[order].equal(k[mine]))
        results["v"] &= bool(read_v[order].equal(v[mine]))
    return results


def counts() -> dict | None:
    if not has_kv_transfer_group():
        return None
    return dataclasses.asdict(get_kv_transfer_group().counts)


def main() -> None:
    config = json.loads(sys.argv[1])
    options = {}
    if config.get("connector") is not None:
        options["kv_transfer_config"] = {
            "kv_connector": "KVSPConnector",
            "kv_connector_module_path": "kvsp_vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": config["connector"],
        }
    llm = LLM(
        model=config["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=config["block_size"],
        max_model_len=config["max_model_len"],
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        seed=0,
        **options,
    )
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"], logprobs=0)
            started = time.perf_counter()
            (output,) = llm.generate(
                [{"prompt_token_ids": command["prompt"]}], params, use_tqdm=False
            )
            elapsed_s = time.perf_counter() - started
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            reply(
                {
                    "tokens": tokens,
                    "logprobs": [
                        step[token].logprob
                        for step, token in zip(completion.logprobs, tokens, strict=True)
                    ],
                    "cached_tokens": output.num_cached_tokens,
                    "counts": counts(),
                    "elapsed_s": elapsed_s,
                }
            )
        elif command["op"] == "drain":
            if has_kv_transfer_group():
                get_kv_transfer_group().drain_stores()
            reply({"counts": counts()})
        elif command["op"] == "probe_layout":
            dtypes = {
                "float32": torch.float32,
                "float16": torch.float16,
                "bfloat16": torch.bfloat16,
            }
            reply({name: probe_layout(dtype) for name, dtype in dtypes.items()})
        elif command["op"] == "compat":
            settings = ConnectorSettings.from_extra_config(config["connector"])
            descriptor = engine_descriptor(llm.llm_engine.vllm_config, settings)
            reply({"compat_id": compat_id_hex(descriptor), "descriptor": descriptor})
        else:
            reply({"error": f"unknown op {command['op']!r}"})
    if has_kv_transfer_group():
        get_kv_transfer_group().drain_stores()
    sys.stdout.flush()
    # Everything asked for is done and answered; vLLM's exit handlers would wait half a
    # minute for threads this process no longer needs.
    os._exit(0)


if __name__ == "__main__":
    main()
