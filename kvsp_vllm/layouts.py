"""Exact conversion between ``kvsp-layout-1`` and the paged KV caches of vLLM's backends.

A block of ``kvsp-layout-1`` is, per layer, K and V tensors shaped [tokens, kv_heads, head_dim]
(the order of a codec raw section, spec 4.3). vLLM keeps one cache tensor per layer and
addresses a token by its block and its offset in the block (``slot = block * block_size +
offset``); block 0 is vLLM's null block and never holds a prompt's tokens. Elements are moved,
never converted, so a block read out and written back is the same octets.

- CPU attention (``CPU_ATTN``): ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Within one
  (block, head) page the first half is K stored transposed, ``[head_dim, block_size]``, and the
  second half V token-major, ``[block_size, head_dim]``: what vLLM's own
  ``cpu_attn_reshape_and_cache`` writes for the "vec" instruction set.
- FlashAttention (``FLASH_ATTN``): ``[2, num_blocks, block_size, kv_heads, head_dim]``, K at 0
  and V at 1, token-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Geometry:
    """What a block of one layer holds: tokens, KV heads and the head dimension."""

    block_tokens: int
    kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_tokens, self.kv_heads, self.head_dim)


class PagedLayout:
    """One backend's cache layout: read a block out as ``kvsp-layout-1`` tensors, write one in."""

    name = "abstract"

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def check(self, cache: torch.Tensor) -> None:
        """ValueError unless ``cache`` has this layout's shape for some number of blocks."""
        shape = tuple(cache.shape)
        if len(shape) != len(self.cache_shape(1)) or shape != self.cache_shape(self._blocks(cache)):
            raise ValueError(
                f"a {self.name} cache of {self.geometry} is shaped like "
                f"{list(self.cache_shape(1))} with any number of blocks, not {list(shape)}"
            )

    def _blocks(self, cache: torch.Tensor) -> int:
        raise NotImplementedError

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block``, contiguous [tokens, kv_heads, head_dim] copies."""
        raise NotImplementedError

    def write(self, cache: torch.Tensor, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V ([tokens, kv_heads, head_dim]) as ``block`` of the cache."""
        raise NotImplementedError

    def _checked(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> None:
        for name, tensor in (("K", k), ("V", v)):
            if tuple(tensor.shape) != self.geometry.block_shape:
                raise ValueError(
                    f"{name} is {list(tensor.shape)}, a block is {list(self.geometry.block_shape)}"
                )
            if tensor.dtype != cache.dtype:
                raise ValueError(f"{name} is {tensor.dtype}, the cache is {cache.dtype}")


class CpuLayout(PagedLayout):
    """vLLM's CPU attention backend ("vec" instruction set)."""

    name = "CPU_ATTN"

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, g.kv_heads, g.block_tokens, 2 * g.head_dim)

    def _blocks(self, cache: torch.Tensor) -> int:
        return cache.shape[0]

    def _halves(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        page = cache[block].view(g.kv_heads, 2 * g.block_tokens * g.head_dim)
        half = g.block_tokens * g.head_dim
        # K as [heads, head_dim, tokens] (transposed), V as [heads, tokens, head_dim].
        k = page[:, :half].view(g.kv_heads, g.head_dim, g.block_tokens)
        v = page[:, half:].view(g.kv_heads, g.block_tokens, g.head_dim)
        return k, v

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._halves(cache, block)
        return k.permute(2, 0, 1).contiguous(), v.permute(1, 0, 2).contiguous()

    def write(self, cache: torch.Tensor, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._checked(k, v, cache)
        k_page, v_page = self._halves(cache, block)
        k_page.copy_(k.permute(1, 2, 0))
        v_page.copy_(v.permute(1, 0, 2))


class FlashAttentionLayout(PagedLayout):
    """vLLM's FlashAttention backend on CUDA (untested on a GPU here: see docs/vllm.md)."""

    name = "FLASH_ATTN"

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (2, num_blocks, g.block_tokens, g.kv_heads, g.head_dim)

    def _blocks(self, cache: torch.Tensor) -> int:
        return cache.shape[1]

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Copies: the block may be reused before a store sends them.
        return cache[0, block].clone(), cache[1, block].clone()

    def write(self, cache: torch.Tensor, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._checked(k, v, cache)
        cache[0, block].copy_(k.to(cache.device, non_blocking=True))
        cache[1, block].copy_(v.to(cache.device, non_blocking=True))


LAYOUTS: dict[str, type[PagedLayout]] = {
    layout.name: layout for layout in (CpuLayout, FlashAttentionLayout)
}


def layout_for(backend: str, geometry: Geometry) -> PagedLayout:
    """The layout of the attention backend named ``backend`` (vLLM's name for it)."""
    try:
        return LAYOUTS[backend](geometry)
    except KeyError:
        handled = ", ".join(sorted(LAYOUTS))
        raise ValueError(
            f"the KVSP connector handles the cache layouts of {handled}, not of {backend}"
        ) from None
