"""Conversion between kvsp-layout-1 and the paged caches of vLLM's backends, on CPU tensors of
each backend's shape (the CUDA path cannot run here; its layout is the same arithmetic)."""

from __future__ import annotations

import pytest
import torch

from kvsp.container import decode
from kvsp.tensors import encode_tensors, layer_tensors
from kvsp_vllm.layouts import CpuLayout, FlashAttentionLayout, Geometry, layout_for

GEOMETRY = Geometry(block_tokens=32, kv_heads=2, head_dim=32)
BLOCKS = 5


def block(seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(GEOMETRY.block_shape, generator=generator).to(dtype)
    v = torch.randn(GEOMETRY.block_shape, generator=generator).to(dtype)
    return k, v


@pytest.mark.parametrize("layout_class", [CpuLayout, FlashAttentionLayout])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_block_written_reads_back_the_same_octets_and_touches_nothing_else(layout_class, dtype):
    layout = layout_class(GEOMETRY)
    cache = torch.randn(layout.cache_shape(BLOCKS)).to(dtype)
    untouched = cache.clone()
    k, v = block(1, dtype)
    layout.write(cache, 3, k, v)
    read_k, read_v = layout.read(cache, 3)
    assert read_k.view(torch.uint8).equal(k.view(torch.uint8))
    assert read_v.view(torch.uint8).equal(v.view(torch.uint8))
    assert read_k.is_contiguous() and read_v.is_contiguous()
    for other in (0, 1, 2, 4):
        assert layout.read(cache, other)[0].equal(layout.read(untouched, other)[0])
        assert layout.read(cache, other)[1].equal(layout.read(untouched, other)[1])


def test_the_cpu_page_holds_k_transposed_and_v_token_major():
    """What vLLM's cpu_attn_reshape_and_cache writes for the "vec" ISA (checked against vLLM
    itself in test_connector): in a (block, head) page, K as [head_dim, tokens], then
    V as [tokens, head_dim]."""
    layout = CpuLayout(GEOMETRY)
    cache = torch.zeros(layout.cache_shape(BLOCKS))
    k, v = block(2)
    layout.write(cache, 2, k, v)
    n, h, d = GEOMETRY.block_shape
    for head in range(h):
        page = cache[2, head].reshape(-1)
        assert page[: n * d].view(d, n).equal(k[:, head, :].T)
        assert page[n * d :].view(n, d).equal(v[:, head, :])
    # vLLM's own view: [blocks, heads, 2 * tokens, head_dim] cut in halves at dim 2, so the
    # value of token t of block b (slot b * block_size + t) is value_cache[b, :, t].
    _, value_cache = cache.view(BLOCKS, h, 2 * n, d).chunk(2, dim=2)
    assert value_cache[2, :, 7].equal(v[7])


def test_the_flash_attention_cache_holds_k_then_v_token_major():
    layout = FlashAttentionLayout(GEOMETRY)
    cache = torch.zeros(layout.cache_shape(BLOCKS))
    k, v = block(3)
    layout.write(cache, 4, k, v)
    assert cache[0, 4].equal(k) and cache[1, 4].equal(v)
    # A read is a copy: the block may be reused while a store still sends it.
    read_k, _ = layout.read(cache, 4)
    cache[0, 4].zero_()
    assert read_k.equal(k)


def test_a_block_round_trips_through_a_container():
    """Out of one backend's cache into a codec raw container and into the other's: the
    sections are the octets of kvsp-layout-1 whatever the backend."""
    cpu, flash = CpuLayout(GEOMETRY), FlashAttentionLayout(GEOMETRY)
    cpu_caches = [torch.randn(cpu.cache_shape(BLOCKS)) for _ in range(3)]
    flash_caches = [torch.zeros(flash.cache_shape(BLOCKS)) for _ in range(3)]
    encoded = encode_tensors([cpu.read(cache, 1) for cache in cpu_caches]).tobytes()
    container = decode(encoded)
    for layer, cache in enumerate(flash_caches):
        k, v = layer_tensors(container, layer, "float32", GEOMETRY.kv_heads, GEOMETRY.head_dim)
        flash.write(cache, 2, k, v)
    for cpu_cache, flash_cache in zip(cpu_caches, flash_caches, strict=True):
        cpu_k, cpu_v = cpu.read(cpu_cache, 1)
        flash_k, flash_v = flash.read(flash_cache, 2)
        assert cpu_k.equal(flash_k) and cpu_v.equal(flash_v)


def test_wrong_shapes_and_backends_are_refused_with_a_reason():
    layout = CpuLayout(GEOMETRY)
    with pytest.raises(ValueError, match="a CPU_ATTN cache of"):
        layout.check(torch.zeros(BLOCKS, 2, 32, 32))
    layout.check(torch.zeros(layout.cache_shape(BLOCKS)))
    k, v = block(4)
    with pytest.raises(ValueError, match=r"K is \[16, 2, 32\]"):
        layout.write(torch.zeros(layout.cache_shape(BLOCKS)), 1, k[:16], v)
    with pytest.raises(ValueError, match="V is torch.float16, the cache is torch.float32"):
        layout.write(torch.zeros(layout.cache_shape(BLOCKS)), 1, k, v.half())
    with pytest.raises(ValueError, match="handles the cache layouts of CPU_ATTN, FLASH_ATTN"):
        layout_for("FLASHINFER", GEOMETRY)
    assert isinstance(layout_for("FLASH_ATTN", GEOMETRY), FlashAttentionLayout)
