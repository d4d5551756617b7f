"""What vLLM's CPU backend writes into its cache, read back through ``CpuLayout`` (run by
``.venv-vllm``): ``python -m tests.vllm.layout_probe`` prints one JSON object, per dtype the
instruction set vLLM picks and whether K and V read back exactly as vLLM's own
``cpu_attn_reshape_and_cache`` stored them at random slots. Never collected by the main suite.
"""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvsp_vllm.layouts import CpuLayout, Geometry

GEOMETRY = Geometry(block_tokens=32, kv_heads=2, head_dim=64)
BLOCKS = 6


def probe(dtype: torch.dtype) -> dict:
    n, h, d = GEOMETRY.block_shape
    isa = _get_attn_isa(dtype, n, d, "auto")
    layout = CpuLayout(GEOMETRY)
    cache = torch.zeros(layout.cache_shape(BLOCKS), dtype=dtype)
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
    key_cache, value_cache = cache.view(BLOCKS, h, 2 * n, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    results = {"isa": isa, "k": True, "v": True}
    for block in (4, 1):
        read_k, read_v = layout.read(cache, block)
        mine = (slots // n) == block
        order = slots[mine] % n
        results["k"] &= bool(read_k[order].equal(k[mine]))
        results["v"] &= bool(read_v[order].equal(v[mine]))
    return results


def main() -> None:
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    print(json.dumps({name: probe(dtype) for name, dtype in dtypes.items()}))


if __name__ == "__main__":
    main()
