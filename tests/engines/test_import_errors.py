"""Containers that do not fit the engine's descriptor are refused with a ProtocolError before
any of their data enters a cache (spec 4.1, 4.3)."""

from __future__ import annotations

import pytest
import torch

from kvsp.container import encode, encode_with_digests
from kvsp.problems import ProtocolError
from kvsp.tensors import encode_tensors
from workers.engines.modeldir import create_reference_model
from workers.engines.reference import ReferenceEngine

B = 16
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return ReferenceEngine(
        create_reference_model(tmp_path_factory.mktemp("model")), block_tokens=B, device="cpu"
    )


@pytest.fixture(scope="module")
def blocks(engine):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 320, (3 * B,), generator=generator).tolist()
    return engine.export_blocks(engine.prefill(tokens), 0, 3)


def block_of(tokens=B, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32, layers=LAYERS):
    generator = torch.Generator().manual_seed(0)
    return encode_tensors(
        [
            (
                torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype),
                torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype),
            )
            for _ in range(layers)
        ]
    )


def refused(engine, containers, problem: str, match: str, **options) -> None:
    with pytest.raises(ProtocolError, match=match) as raised:
        engine.import_blocks(containers, **options)
    assert raised.value.problem == problem


def test_a_block_of_the_right_shape_is_accepted(engine):
    sequence = engine.import_blocks([block_of(), block_of()])
    assert sequence.length == 2 * B


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ({"kv_heads": 4}, "sections of 4096 and 4096 octets"),
        ({"head_dim": 8}, "sections of 1024 and 1024 octets"),
        ({"dtype": torch.float16}, "sections of 1024 and 1024 octets"),
        ({"dtype": torch.bfloat16}, "sections of 1024 and 1024 octets"),
        ({"tokens": B - 1}, "holds 15 tokens; a block holds 16"),
        ({"tokens": 2 * B}, "holds 32 tokens; a block holds 16"),
        ({"layers": 3}, "holds layers 0-2; an import needs all 4 layers"),
    ],
)
def test_a_block_of_another_geometry_is_refused(engine, blocks, shape, match):
    problem = "kvsp-invalid-container"
    refused(engine, [blocks[0], block_of(**shape)], problem, match)


def test_more_layers_than_the_model_has_are_refused(engine):
    refused(engine, [block_of(layers=5)], "kvsp-invalid-container", "exceeds the limit of 4")


def test_a_layer_range_not_starting_at_zero_is_refused(engine, blocks):
    whole = blocks[0]
    upper = encode_with_digests(
        1, 1, B, list(zip(whole.parts[3::2], whole.parts[4::2], strict=True))
    )
    refused(engine, [upper], "kvsp-invalid-container", "holds layers 1-3")


def test_a_codec_other_than_raw_is_refused(engine, blocks):
    whole = blocks[0]
    other = encode(2, 0, B, list(zip(whole.parts[1::2], whole.parts[2::2], strict=True)))
    refused(engine, [other], "kvsp-unsupported-codec", "codec 2")


def test_truncated_octets_are_refused(engine, blocks):
    octets = blocks[0].tobytes()
    refused(engine, [octets[:-1]], "kvsp-invalid-container", "truncated")
    refused(engine, [octets + b"\0"], "kvsp-invalid-container", "trailing")


def test_blocks_must_be_consecutive_from_block_zero(engine, blocks):
    problem = "kvsp-malformed-request"
    refused(engine, {0: blocks[0], 2: blocks[2]}, problem, "block 1 is missing")
    refused(engine, {1: blocks[1], 2: blocks[2]}, problem, "block 0 is missing")
    assert engine.import_blocks({1: blocks[1], 0: blocks[0]}).length == 2 * B


def test_a_digest_that_differs_is_refused(engine, blocks):
    digests = [blocks[1].digest, blocks[1].digest]
    refused(engine, blocks[:2], "kvsp-digest-mismatch", "replica digest", digests=digests)


def test_blocks_of_another_compat_id_are_refused(engine, blocks):
    refused(engine, blocks, "kvsp-compat-mismatch", "compat", compat_id="ab" * 32)


def test_tokens_that_do_not_fill_the_blocks_are_refused(engine, blocks):
    refused(engine, blocks[:2], "kvsp-malformed-request", "31 tokens", tokens=[5] * (2 * B - 1))


def test_a_model_of_another_geometry_cannot_import_these_blocks(blocks, tmp_path):
    wider = ReferenceEngine(
        create_reference_model(tmp_path, kv_heads=4), block_tokens=B, device="cpu"
    )
    refused(wider, blocks, "kvsp-invalid-container", "4 kv_heads")


def test_tensors_of_another_dtype_or_shape_are_refused(engine):
    layerwise = engine.begin_import(1)
    good = torch.zeros(B, KV_HEADS, HEAD_DIM)
    with pytest.raises(ProtocolError, match="float16"):
        layerwise.add_layer(0, 0, good.half(), good.half())
    with pytest.raises(ProtocolError, match=r"\[16, 2, 8\]"):
        layerwise.add_layer(0, 0, good[..., :8], good[..., :8])
    with pytest.raises(ProtocolError, match="layer 4 is not a layer of this model"):
        layerwise.add_layer(0, 4, good, good)
