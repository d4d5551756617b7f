"""The container vectors in kvsp/vectors/container-vectors.json (spec 4.3), kept as data."""

from __future__ import annotations

import json

import pytest
import torch

from kvsp import container as kvb
from kvsp import tensors
from kvsp.problems import ProtocolError
from kvsp.reprdigest import repr_digest_of, verify_repr_digest
from tests.core import make_container_vectors

VECTORS = json.loads(make_container_vectors.OUTPUT.read_text(encoding="utf-8"))


def test_the_file_is_what_the_generator_writes():
    assert make_container_vectors.OUTPUT.read_text(encoding="utf-8") == (
        make_container_vectors.render()
    )


def test_there_are_valid_and_invalid_vectors():
    assert len(VECTORS["valid"]) >= 4 and len(VECTORS["invalid"]) >= 8


@pytest.mark.parametrize("vector", VECTORS["valid"], ids=lambda v: v["name"])
def test_valid_vector(vector):
    data = bytes.fromhex(vector["container"])
    decoded = kvb.decode(data)
    for field in ("version", "codec", "first_layer", "layer_count", "token_count", "header_size"):
        assert getattr(decoded, field) == vector[field], field
    for layer in vector["layers"]:
        k, v = decoded.layer(layer["layer"])
        assert (k.hex(), v.hex()) == (layer["k"], layer["v"])
    assert [d.hex() for d in decoded.layer_digests()] == vector["layer_digests"]
    assert decoded.verify_layer_digests(vector["layer_digests"]) == decoded.layer_digests()
    assert decoded.digest() == vector["digest"]
    kvb.verify_replica_digest(vector["layer_digests"], vector["digest"])
    assert repr_digest_of(data) == vector["repr_digest"]
    verify_repr_digest(vector["repr_digest"], data)

    layers = [(bytes.fromhex(layer["k"]), bytes.fromhex(layer["v"])) for layer in vector["layers"]]
    assert kvb.encode(vector["codec"], vector["first_layer"], vector["token_count"], layers) == data

    reader = kvb.ContainerStreamReader(
        max_size=len(data), expected_layer_digests=vector["layer_digests"]
    )
    streamed = []
    for octet in range(len(data)):
        streamed += reader.feed(data[octet : octet + 1])
    assert [layer.index for layer in streamed] == [layer["layer"] for layer in vector["layers"]]

    for piece in vector.get("slices", []):
        first, last = piece["layers"]
        assert b"".join(kvb.slice_layers(decoded, first, last)).hex() == piece["container"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS["valid"] if "raw" in v], ids=lambda v: v["name"]
)
def test_raw_vector_elements(vector):
    raw = vector["raw"]
    decoded = kvb.decode(bytes.fromhex(vector["container"]))
    read = tensors.container_tensors(decoded, raw["kv_dtype"], raw["kv_heads"], raw["head_dim"])
    dtype = tensors.torch_dtype(raw["kv_dtype"])
    for (k, v), layer in zip(read, raw["layers"], strict=True):
        assert torch.equal(k, torch.tensor(layer["k"], dtype=torch.float32).to(dtype))
        assert torch.equal(v, torch.tensor(layer["v"], dtype=torch.float32).to(dtype))
    rebuilt = tensors.encode_tensors(read, first_layer=decoded.first_layer)
    assert rebuilt.tobytes().hex() == vector["container"]


@pytest.mark.parametrize("vector", VECTORS["invalid"], ids=lambda v: v["name"])
def test_invalid_vector(vector):
    with pytest.raises(ProtocolError) as caught:
        kvb.decode(bytes.fromhex(vector["container"]))
    assert caught.value.problem == vector["problem"]
