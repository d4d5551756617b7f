"""The KVSP connector for vLLM's v1 engine (DESIGN.md section 9).

Plain Python like ``kvsp/``: it runs inside vLLM's processes, computes identifiers and checks
containers with ``kvsp/``, and speaks to the control plane and to holders over HTTP with its own
client. Only ``kvsp_vllm.connector`` imports vLLM; the other modules import torch and httpx.
"""
