"""Sections of codec "raw" as torch tensors: layout "kvsp-layout-1" (spec section 4.3).

For codec 0x0001 a K or V section holds token_count x kv_heads x head_dim elements of the
descriptor's kv_dtype, row-major with the token index slowest and the dimension index fastest,
each element in little-endian octet order. That is the memory of a contiguous tensor shaped
[tokens, kv_heads, head_dim] on a little-endian host, so on such hosts a section and a CPU
tensor share memory and nothing is copied; big-endian hosts swap octets, and a CUDA tensor
crosses to the host once, through pinned memory.

torch is imported on first use, so importing this module (or any other in ``kvsp``) does not
load it. numpy has no bfloat16 or float8 types, so tensors are exposed as octets through a
``torch.uint8`` view, never through a numpy dtype.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsp.container import Buffer, Container, EncodedContainer, encode_with_digests
from kvsp.problems import ProtocolError
from kvsp.registries import ELEMENT_TYPES, RAW_CODEC, lookup_element_type

if TYPE_CHECKING:
    import torch


_LITTLE_ENDIAN = sys.byteorder == "little"


def _torch():
    import torch

    return torch


@functools.cache
def _torch_dtypes() -> dict:
    # Registered element type names are torch's dtype attribute names.
    torch = _torch()
    return {name: getattr(torch, name) for name in ELEMENT_TYPES}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a registered kv_dtype; ProtocolError for an unregistered name."""
    return _torch_dtypes()[lookup_element_type(kv_dtype).name]


def kv_dtype_of(dtype: torch.dtype) -> str:
    """The registered kv_dtype name of a torch dtype; ValueError for any other dtype."""
    for name, candidate in _torch_dtypes().items():
        if candidate == dtype:
            return name
    raise ValueError(f"{dtype} is not a registered KVSP element type")


def section_size(kv_dtype: str, token_count: int, kv_heads: int, head_dim: int) -> int:
    """Octets of one K or V section of codec raw."""
    return token_count * kv_heads * head_dim * lookup_element_type(kv_dtype).octets


def _swap_octets(octets: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Reverse the octets of every element of a flat uint8 tensor (a copy)."""
    return octets.reshape(-1, itemsize).flip(1).reshape(-1)


def octets_to_device(octets: Buffer, device: str | torch.device) -> torch.Tensor:
    """A copy of ``octets`` on ``device`` as one flat uint8 tensor: on CUDA through a pinned
    staging buffer and one non-blocking copy (ordered on the current stream), on the CPU a
    copy that owns its memory."""
    torch = _torch()
    view = memoryview(octets)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8, device=device)
    device = torch.device(device)
    if device.type == "cuda":
        source = torch.frombuffer(view, dtype=torch.uint8)
        # The caching host allocator keeps the staging block alive until the copy has run.
        staging = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
        staging.copy_(source)
        return staging.to(device, non_blocking=True)
    # One memcpy into memory the tensor owns. torch's own copy of a block's size goes through
    # its pool of intra-op threads: 150-750 us a 96 KiB block against 7-17 us, and far more
    # while the engine's forward pass holds those threads.
    return torch.frombuffer(bytearray(view), dtype=torch.uint8)


def tensor_from_octets(
    octets: torch.Tensor, kv_dtype: str, kv_heads: int, head_dim: int
) -> torch.Tensor:
    """A section held as a flat uint8 tensor (on any device, its first octet aligned to the
    element size), as a tensor shaped [tokens, kv_heads, head_dim] over the same memory on a
    little-endian host (a copy otherwise)."""
    itemsize = ELEMENT_TYPES[kv_dtype].octets
    if not _LITTLE_ENDIAN and itemsize > 1:
        octets = _swap_octets(octets, itemsize)
    tokens = octets.numel() // (kv_heads * head_dim * itemsize)
    return octets.view(torch_dtype(kv_dtype)).view(tokens, kv_heads, head_dim)


def section_from_tensor(tensor: torch.Tensor) -> memoryview:
    """The section of a tensor shaped [tokens, kv_heads, head_dim], as a memoryview.

    A contiguous CPU tensor on a little-endian host is exposed without a copy: the memoryview
    shares its memory, so the tensor must stay unchanged until the section is sent. Other
    tensors are copied once: a CUDA tensor into pinned host memory, a non-contiguous one into
    contiguous memory.
    """
    torch = _torch()
    kv_dtype = kv_dtype_of(tensor.dtype)
    if tensor.dim() != 3:
        raise ValueError(
            f"a section is a tensor shaped [tokens, kv_heads, head_dim], not {list(tensor.shape)}"
        )
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        # One synchronous device-to-host copy into page-locked memory, which the DMA engine
        # writes directly instead of through a driver bounce buffer.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        tensor = host
    elif tensor.device.type != "cpu":
        tensor = tensor.cpu()
    octets = tensor.contiguous().view(torch.uint8).reshape(-1)
    itemsize = ELEMENT_TYPES[kv_dtype].octets
    if not _LITTLE_ENDIAN and itemsize > 1:
        octets = _swap_octets(octets, itemsize)
    # numpy only provides the buffer protocol here; the array is uint8 whatever the kv_dtype.
    return memoryview(octets.numpy())


def tensor_from_section(
    section: Buffer,
    kv_dtype: str,
    kv_heads: int,
    head_dim: int,
    device: str | torch.device | None = None,
    *,
    token_count: int | None = None,
) -> torch.Tensor:
    """A tensor shaped [tokens, kv_heads, head_dim] over a section of codec raw.

    On a little-endian host the CPU tensor shares the section's memory (writing through a
    tensor made from a read-only buffer such as bytes is undefined, and torch warns once).
    With a CUDA ``device`` the section goes through a pinned staging buffer and a
    non-blocking copy, ordered on the current stream. Raises ProtocolError
    ``kvsp-invalid-container`` when the section's length does not match the geometry (and
    ``token_count``, when given).
    """
    torch = _torch()
    dtype = torch_dtype(kv_dtype)
    if kv_heads < 1 or head_dim < 1:
        raise ValueError("kv_heads and head_dim must be positive")
    view = memoryview(section)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    itemsize = ELEMENT_TYPES[kv_dtype].octets
    token_size = kv_heads * head_dim * itemsize
    tokens, remainder = divmod(len(view), token_size)
    if remainder or (token_count is not None and tokens != token_count):
        wanted = "a multiple of" if token_count is None else f"{token_count} tokens of"
        raise ProtocolError(
            "kvsp-invalid-container",
            f"a section of {len(view)} octets is not {wanted} {token_size} octets per token "
            f"({kv_heads} kv_heads x {head_dim} head_dim x {kv_dtype})",
        )
    if tokens == 0:
        tensor = torch.empty((0, kv_heads, head_dim), dtype=dtype)
    else:
        octets = torch.frombuffer(view, dtype=torch.uint8)
        if not _LITTLE_ENDIAN and itemsize > 1:
            octets = _swap_octets(octets, itemsize)
        elif octets.data_ptr() % itemsize:
            # A section at an address that is not a multiple of the element size cannot be
            # viewed as elements safely; an aligned copy can.
            octets = octets.clone()
        tensor = octets.view(dtype).view(tokens, kv_heads, head_dim)
    if device is None:
        return tensor
    device = torch.device(device)
    if device.type == "cuda":
        # The caching host allocator keeps the staging block alive until the copy has run.
        staging = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
        staging.copy_(tensor)
        return staging.to(device, non_blocking=True)
    return tensor.to(device)


def check_geometry(container: Container, kv_dtype: str, kv_heads: int, head_dim: int) -> None:
    """Check that a container is codec raw and every section fits the geometry.

    Raises ProtocolError ``kvsp-unsupported-codec`` or ``kvsp-invalid-container``.
    """
    if container.codec != RAW_CODEC:
        raise ProtocolError(
            "kvsp-unsupported-codec",
            f"codec {container.codec} is not raw ({RAW_CODEC}); sections are not tensors",
        )
    wanted = section_size(kv_dtype, container.token_count, kv_heads, head_dim)
    for layer in range(container.first_layer, container.last_layer + 1):
        k_length, v_length = container.section_lengths(layer)
        if k_length != wanted or v_length != wanted:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"layer {layer} has sections of {k_length} and {v_length} octets; "
                f"{container.token_count} tokens x {kv_heads} kv_heads x {head_dim} head_dim "
                f"of {kv_dtype} need {wanted}",
            )


def encode_tensors(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    first_layer: int = 0,
    threads: int | None = None,
) -> EncodedContainer:
    """A codec raw container of consecutive layers' K and V tensors, with its layer digests.

    Every tensor is shaped [tokens, kv_heads, head_dim] with one shape and dtype for all.
    Contiguous CPU tensors are not copied: the parts are views of them.
    """
    if not layers:
        raise ValueError("a container holds at least one layer")
    shape, dtype = layers[0][0].shape, layers[0][0].dtype
    for index, (k, v) in enumerate(layers):
        for name, tensor in (("K", k), ("V", v)):
            if tensor.shape != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name} of layer {first_layer + index} is {list(tensor.shape)} "
                    f"{tensor.dtype}, the first K is {list(shape)} {dtype}"
                )
    sections = [(section_from_tensor(k), section_from_tensor(v)) for k, v in layers]
    return encode_with_digests(RAW_CODEC, first_layer, shape[0], sections, threads=threads)


def layer_tensors(
    container: Container,
    layer: int,
    kv_dtype: str,
    kv_heads: int,
    head_dim: int,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one absolute layer of a codec raw container, as tensors."""
    if container.codec != RAW_CODEC:
        raise ProtocolError(
            "kvsp-unsupported-codec",
            f"codec {container.codec} is not raw ({RAW_CODEC}); sections are not tensors",
        )
    k, v = container.layer(layer)
    return (
        tensor_from_section(
            k, kv_dtype, kv_heads, head_dim, device, token_count=container.token_count
        ),
        tensor_from_section(
            v, kv_dtype, kv_heads, head_dim, device, token_count=container.token_count
        ),
    )


def container_tensors(
    container: Container,
    kv_dtype: str,
    kv_heads: int,
    head_dim: int,
    device: str | torch.device | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of every layer, in ascending order; the geometry is checked before any copy."""
    check_geometry(container, kv_dtype, kv_heads, head_dim)
    return [
        layer_tensors(container, layer, kv_dtype, kv_heads, head_dim, device)
        for layer in range(container.first_layer, container.last_layer + 1)
    ]
