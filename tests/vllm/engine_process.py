"""A vLLM engine in a process of its own, driven over stdin and stdout (run by ``.venv-vllm``).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m tests.vllm.engine_process CONFIG_JSON

CONFIG_JSON: ``{"model_dir", "block_size", "max_model_len", "connector": extra config or
null}``. The engine runs in this one process (that variable, and executor "uni"), greedy,
float32, without vLLM's own prefix cache, so every answer comes from KVSP or from computing.
One JSON line on stdout when ready, then one per command read from stdin:

- ``{"op": "generate", "prompt": [ids], "max_tokens": n}`` -> ``{"tokens", "logprobs",
  "cached_tokens", "counts"}``: the greedy tokens, the logprob of each, the prompt tokens vLLM
  did not compute, and the connector's counts after the request;
- ``{"op": "drain"}`` -> ``{"counts"}`` once every store submitted so far is done;
- ``{"op": "compat"}`` -> ``{"compat_id", "descriptor"}``, as the connector computes them.

Replies are the stdout lines that start with ``kvsp-engine: ``; the process exits at the end
of its input, once the stores submitted are done.

This file imports vLLM and is never collected by the main test suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

from kvsp.compat import compat_id_hex
from kvsp_vllm.connector import engine_descriptor
from kvsp_vllm.settings import ConnectorSettings

REPLY = "kvsp-engine: "


def reply(obj: dict) -> None:
    # vLLM logs to stdout too; the prefix marks the lines meant for the test.
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


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
            (output,) = llm.generate(
                [{"prompt_token_ids": command["prompt"]}], params, use_tqdm=False
            )
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
                }
            )
        elif command["op"] == "drain":
            if has_kv_transfer_group():
                get_kv_transfer_group().drain_stores()
            reply({"counts": counts()})
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
