"""Codec raw, layout kvsp-layout-1 (spec 4.3), bridged to torch tensors."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch

from kvsp import container as kvb
from kvsp import tensors
from kvsp.problems import ProtocolError

KV_DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def random_bits(kv_dtype: str, shape, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game, NaNs and infinities included."""
    generator = torch.Generator().manual_seed(seed)
    octets_shape = (*shape[:-1], shape[-1] * SIZES[kv_dtype])
    octets = torch.randint(0, 256, octets_shape, dtype=torch.uint8, generator=generator)
    return octets.view(TORCH_DTYPES[kv_dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_round_trip_is_bit_exact(kv_dtype):
    tensor = random_bits(kv_dtype, (5, 3, 8))
    section = tensors.section_from_tensor(tensor)
    assert len(section) == 5 * 3 * 8 * SIZES[kv_dtype]
    back = tensors.tensor_from_section(bytes(section), kv_dtype, 3, 8)
    assert back.shape == (5, 3, 8)
    assert same_bits(back, tensor)


def test_dtype_mappings():
    for kv_dtype, dtype in TORCH_DTYPES.items():
        assert tensors.torch_dtype(kv_dtype) is dtype
        assert tensors.kv_dtype_of(dtype) == kv_dtype
    with pytest.raises(ValueError):
        tensors.kv_dtype_of(torch.int8)
    with pytest.raises(ProtocolError) as caught:
        tensors.torch_dtype("float64")
    assert caught.value.problem == "kvsp-invalid-record"


@pytest.mark.parametrize(
    ("kv_dtype", "value", "octets"),
    [
        ("float16", 1.0, b"\x00\x3c"),
        ("float16", -2.0, b"\x00\xc0"),
        ("float16", 65504.0, b"\xff\x7b"),
        ("bfloat16", 1.0, b"\x80\x3f"),
        ("bfloat16", -3.0, b"\x40\xc0"),
        ("float32", 1.0, b"\x00\x00\x80\x3f"),
        ("float8_e4m3fn", 1.0, b"\x38"),
        ("float8_e5m2", 1.0, b"\x3c"),
        ("float8_e5m2", -0.5, b"\xb8"),
    ],
)
def test_elements_are_little_endian(kv_dtype, value, octets):
    tensor = torch.tensor([value], dtype=torch.float32).to(TORCH_DTYPES[kv_dtype]).view(1, 1, 1)
    assert bytes(tensors.section_from_tensor(tensor)) == octets
    assert tensors.tensor_from_section(octets, kv_dtype, 1, 1).item() == value


def test_layout_is_token_slowest_dimension_fastest():
    tokens, kv_heads, head_dim = 3, 2, 4
    tensor = torch.arange(tokens * kv_heads * head_dim, dtype=torch.float32)
    tensor = tensor.view(tokens, kv_heads, head_dim)
    section = bytes(tensors.section_from_tensor(tensor))
    values = struct.unpack(f"<{tokens * kv_heads * head_dim}f", section)
    expected = [
        float(tensor[t, h, d])
        for t in range(tokens)
        for h in range(kv_heads)
        for d in range(head_dim)
    ]
    assert list(values) == expected
    # Element (t, h, d) sits at ((t * kv_heads + h) * head_dim + d) * size.
    t, h, d = 2, 1, 3
    at = ((t * kv_heads + h) * head_dim + d) * 4
    assert struct.unpack_from("<f", section, at)[0] == tensor[t, h, d].item()


def test_tensor_from_a_cpu_section_shares_memory():
    tensor = torch.arange(24, dtype=torch.float16).view(2, 3, 4)
    buffer = bytearray(tensors.section_from_tensor(tensor))
    shared = tensors.tensor_from_section(buffer, "float16", 3, 4)
    view = memoryview(buffer)
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert shared.data_ptr() == address
    buffer[0:2] = struct.pack("<e", 7.0)
    assert shared[0, 0, 0].item() == 7.0


def test_section_from_a_contiguous_cpu_tensor_shares_memory():
    tensor = torch.zeros(2, 2, 2, dtype=torch.bfloat16)
    section = tensors.section_from_tensor(tensor)
    assert torch.frombuffer(section, dtype=torch.uint8).data_ptr() == tensor.data_ptr()
    tensor[1, 1, 1] = 1.0
    assert bytes(section[-2:]) == b"\x80\x3f"


def test_a_non_contiguous_tensor_is_copied_into_layout_order():
    base = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    strided = base.transpose(1, 2)  # [2, 3, 4], not contiguous
    section = tensors.section_from_tensor(strided)
    assert bytes(section) == bytes(tensors.section_from_tensor(strided.contiguous()))
    assert same_bits(tensors.tensor_from_section(section, "float32", 3, 4), strided)


def test_a_misaligned_section_is_read_correctly():
    tensor = random_bits("float32", (2, 2, 2), seed=3)
    section = bytes(tensors.section_from_tensor(tensor))
    backing = b"\x00" + section
    read = tensors.tensor_from_section(memoryview(backing)[1:], "float32", 2, 2)
    assert read.data_ptr() % 4 == 0
    assert same_bits(read, tensor)


def test_big_endian_hosts_swap_octets(monkeypatch):
    tensor = random_bits("bfloat16", (3, 2, 2), seed=5)
    little = bytes(tensors.section_from_tensor(tensor))
    monkeypatch.setattr(tensors, "_LITTLE_ENDIAN", False)
    # On this little-endian host the forced swap yields the big-endian octets of each element.
    swapped = bytes(tensors.section_from_tensor(tensor))
    assert swapped == b"".join(little[i : i + 2][::-1] for i in range(0, len(little), 2))
    assert same_bits(tensors.tensor_from_section(swapped, "bfloat16", 2, 2), tensor)
    one_octet = random_bits("float8_e5m2", (3, 2, 2), seed=6)
    assert bytes(tensors.section_from_tensor(one_octet)) == bytes(
        one_octet.view(torch.uint8).reshape(-1).tolist()
    )


@pytest.mark.parametrize("length", [1, 7, 15, 17])
def test_a_section_that_does_not_fit_the_geometry_is_rejected(length):
    with pytest.raises(ProtocolError) as caught:
        tensors.tensor_from_section(bytes(length), "float16", 2, 4)
    assert caught.value.problem == "kvsp-invalid-container"


def test_token_count_must_match():
    section = bytes(2 * 2 * 4 * 2)
    assert tensors.tensor_from_section(section, "float16", 2, 4, token_count=2).shape[0] == 2
    with pytest.raises(ProtocolError) as caught:
        tensors.tensor_from_section(section, "float16", 2, 4, token_count=3)
    assert caught.value.problem == "kvsp-invalid-container"


def test_section_from_tensor_rejects_other_shapes_and_dtypes():
    with pytest.raises(ValueError):
        tensors.section_from_tensor(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        tensors.section_from_tensor(torch.zeros(1, 2, 3, dtype=torch.int32))


def test_no_tokens():
    empty = torch.zeros(0, 2, 4, dtype=torch.float16)
    assert len(tensors.section_from_tensor(empty)) == 0
    back = tensors.tensor_from_section(b"", "float16", 2, 4)
    assert back.shape == (0, 2, 4) and back.dtype == torch.float16


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_container_of_tensors_round_trip(kv_dtype):
    layers = [
        (
            random_bits(kv_dtype, (4, 2, 8), seed=2 * i),
            random_bits(kv_dtype, (4, 2, 8), seed=2 * i + 1),
        )
        for i in range(3)
    ]
    encoded = tensors.encode_tensors(layers, first_layer=5)
    decoded = kvb.decode(encoded.tobytes())
    assert (decoded.codec, decoded.first_layer, decoded.token_count) == (kvb.RAW_CODEC, 5, 4)
    assert decoded.layer_digests() == encoded.layer_digests
    tensors.check_geometry(decoded, kv_dtype, 2, 8)
    back = tensors.container_tensors(decoded, kv_dtype, 2, 8)
    for (k, v), (k_back, v_back) in zip(layers, back, strict=True):
        assert same_bits(k, k_back) and same_bits(v, v_back)
    k6, v6 = tensors.layer_tensors(decoded, 6, kv_dtype, 2, 8, device="cpu")
    assert same_bits(k6, layers[1][0]) and same_bits(v6, layers[1][1])


def test_encoded_parts_are_views_of_the_tensors():
    k, v = torch.ones(2, 1, 4), torch.zeros(2, 1, 4)
    encoded = tensors.encode_tensors([(k, v)])
    assert torch.frombuffer(encoded.parts[1], dtype=torch.uint8).data_ptr() == k.data_ptr()


def test_encode_tensors_needs_one_shape_and_dtype():
    k = torch.zeros(2, 1, 4, dtype=torch.float16)
    with pytest.raises(ValueError):
        tensors.encode_tensors([(k, torch.zeros(3, 1, 4, dtype=torch.float16))])
    with pytest.raises(ValueError):
        tensors.encode_tensors([(k, k), (k, k.float())])
    with pytest.raises(ValueError):
        tensors.encode_tensors([])


def test_check_geometry_rejects_mismatched_containers():
    # Uneven sections never decode (4.3); even ones may still be of another geometry.
    data = kvb.encode(kvb.RAW_CODEC, 3, 2, [(bytes(16), bytes(16)), (bytes(16), bytes(16))])
    decoded = kvb.decode(data)
    tensors.check_geometry(decoded, "float16", 1, 4)
    with pytest.raises(ProtocolError) as caught:
        tensors.check_geometry(decoded, "float16", 1, 2)
    assert caught.value.problem == "kvsp-invalid-container"
    assert "layer 3" in caught.value.detail
    with pytest.raises(ProtocolError) as caught:
        tensors.container_tensors(decoded, "bfloat16", 2, 4)
    assert caught.value.problem == "kvsp-invalid-container"
    with pytest.raises(ProtocolError) as caught:
        tensors.layer_tensors(decoded, 3, "float16", 2, 4)
    assert caught.value.problem == "kvsp-invalid-container"


def test_other_codecs_are_not_tensors():
    decoded = kvb.decode(kvb.encode(2, 0, 2, [(bytes(16), bytes(16))]))
    for call in (
        lambda: tensors.check_geometry(decoded, "float16", 1, 4),
        lambda: tensors.layer_tensors(decoded, 0, "float16", 1, 4),
    ):
        with pytest.raises(ProtocolError) as caught:
            call()
        assert caught.value.problem == "kvsp-unsupported-codec"


def test_importing_the_tensor_bridge_does_not_import_torch():
    code = "import sys, kvsp.tensors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
