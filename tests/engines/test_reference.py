"""The reference engine on real tensors: a cache exported as KV Block Containers (spec 4.3) and
imported by another instance decodes exactly as the cache it came from, and a session resumed
from a checkpoint (6.8) continues token for token (DESIGN.md section 8)."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from kvsp.blockkeys import BlockKeyChain, block_keys_hex, scope_id_hex
from kvsp.container import decode
from kvsp.problems import ProtocolError
from kvsp.records import SessionCheckpoint
from kvsp.registries import RAW_CODEC
from tests.engines.conftest import B
from workers.engines.reference import ReferenceEngine
from workers.engines.samplers import TokenSampler

# A cache recomputed from scratch runs the same arithmetic on matrices of other shapes, so its
# float32 logits may differ in the last bits; 1e-5 is far above the largest difference seen
# (below 1e-6) and far below the gaps between competing logits.
TOLERANCE = 1e-5
SCOPE_KEY = bytes(range(32))


def prompt_tokens(count: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (count,), generator=generator).tolist()


def received(exported) -> list:
    """The containers as another instance gets them: octets on the wire, decoded, each layer
    checked against the digests the producer published (6.7)."""
    containers = []
    for encoded in exported:
        container = decode(bytearray(encoded.tobytes()), max_layers=4)
        container.verify_layer_digests(encoded.layer_digests)
        assert container.digest() == encoded.digest
        containers.append(container)
    return containers


def greedy_continuation(engine, sequence, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [], []
    for _ in range(steps):
        token = int(torch.argmax(sequence.logits))
        tokens.append(token)
        logits.append(engine.decode(sequence, token))
    return tokens, logits


def test_engine_states_the_descriptor_of_its_model(engine_a, model_dir):
    descriptor = engine_a.descriptor
    assert engine_a.compat_id == ReferenceEngine(model_dir, block_tokens=B).compat_id
    assert (engine_a.layers, engine_a.kv_heads, engine_a.head_dim) == (4, 2, 16)
    assert (engine_a.kv_dtype, engine_a.block_tokens) == ("float32", B)
    assert descriptor["positional"] == "rope;theta=10000"
    assert ReferenceEngine(model_dir, block_tokens=32).compat_id != engine_a.compat_id


def test_text_round_trips_through_the_tokenizer(engine_a):
    text = "The cache of every layer, ünïcode too."
    assert engine_a.detokenize(engine_a.tokenize(text)) == text
    assert engine_a.eos_token_id == 1


@pytest.mark.parametrize(("blocks", "tail"), [(2, 1), (2, 11), (3, 5)])
def test_imported_blocks_decode_bit_for_bit(engine_a, engine_b, blocks, tail):
    prompt = prompt_tokens(blocks * B + tail, seed=blocks + tail)
    prefix, rest = prompt[: blocks * B], prompt[blocks * B :]

    on_a = engine_a.prefill(prefix)
    exported = engine_a.export_blocks(on_a, 0, blocks)
    logits_a = engine_a.extend(on_a, rest)

    on_b = engine_b.import_blocks(
        received(exported),
        tokens=prefix,
        digests=[encoded.digest for encoded in exported],
        compat_id=engine_a.compat_id,
    )
    assert on_b.length == blocks * B and on_b.tokens == prefix
    logits_b = engine_b.extend(on_b, rest)

    assert torch.equal(logits_a, logits_b)
    for layer in range(4):
        assert torch.equal(on_a.cache[layer][0], on_b.cache[layer][0])
        assert torch.equal(on_a.cache[layer][1], on_b.cache[layer][1])

    recomputed = engine_a.prefill(prompt)
    assert (recomputed.logits - logits_a).abs().max().item() <= TOLERANCE

    tokens_a, steps_a = greedy_continuation(engine_a, on_a, 16)
    tokens_b, steps_b = greedy_continuation(engine_b, on_b, 16)
    tokens_c, steps_c = greedy_continuation(engine_a, recomputed, 16)
    assert tokens_a == tokens_b == tokens_c
    assert all(torch.equal(a, b) for a, b in zip(steps_a, steps_b, strict=True))
    assert all(
        (a - c).abs().max().item() <= TOLERANCE for a, c in zip(steps_a, steps_c, strict=True)
    )
    assert on_a.tokens == on_b.tokens == recomputed.tokens == prompt + tokens_a


def test_prefill_matches_the_model_forward(engine_a):
    """Running the layers one by one computes what transformers' forward computes: the same
    logits and the same cache, keys after RoPE at absolute positions."""
    prompt = prompt_tokens(3 * B + 4, seed=9)
    sequence = engine_a.prefill(prompt)
    with torch.inference_mode():
        output = engine_a._model(torch.tensor([prompt]), use_cache=True)
    assert (output.logits[0, -1] - sequence.logits).abs().max().item() <= TOLERANCE
    for layer in range(4):
        keys, values = sequence.cache[layer]
        assert keys.shape == (1, 2, len(prompt), 16) and keys.is_contiguous()
        assert torch.allclose(keys, output.cache.layers[layer].keys, rtol=0, atol=TOLERANCE)
        assert torch.allclose(values, output.cache.layers[layer].values, rtol=0, atol=TOLERANCE)


def test_a_block_holds_its_own_positions_in_layout_1(engine_a):
    prompt = prompt_tokens(2 * B + 3, seed=4)
    sequence = engine_a.prefill(prompt)
    exported = engine_a.export_blocks(sequence, 1, 1)
    assert len(exported) == 1
    container = decode(bytearray(exported[0].tobytes()))
    assert (container.codec, container.first_layer, container.layer_count) == (RAW_CODEC, 0, 4)
    assert container.token_count == B
    for layer in range(4):
        k_section, v_section = container.layer(layer)
        assert len(k_section) == len(v_section) == B * 2 * 16 * 4
        k = torch.frombuffer(bytearray(k_section), dtype=torch.float32).view(B, 2, 16)
        v = torch.frombuffer(bytearray(v_section), dtype=torch.float32).view(B, 2, 16)
        keys, values = sequence.cache[layer]
        assert torch.equal(k, keys[0, :, B : 2 * B].permute(1, 0, 2))
        assert torch.equal(v, values[0, :, B : 2 * B].permute(1, 0, 2))


def test_only_complete_blocks_are_exported(engine_a):
    sequence = engine_a.prefill(prompt_tokens(2 * B - 1))
    assert sequence.complete_blocks == 1
    assert len(engine_a.export_blocks(sequence, 0, 1)) == 1
    with pytest.raises(ValueError, match="not all complete"):
        engine_a.export_blocks(sequence, 0, 2)


def test_import_without_tokens_counts_positions(engine_a, engine_b):
    prompt = prompt_tokens(2 * B + 2, seed=3)
    on_a = engine_a.prefill(prompt[: 2 * B])
    on_b = engine_b.import_blocks(engine_a.export_blocks(on_a, 0, 2))
    assert on_b.tokens is None and on_b.length == 2 * B
    assert torch.equal(
        engine_b.extend(on_b, prompt[2 * B :]), engine_a.extend(on_a, prompt[2 * B :])
    )
    assert on_b.tokens is None and on_b.length == len(prompt)


def test_a_failed_step_leaves_the_sequence_as_it_was(engine_a):
    sequence = engine_a.prefill(prompt_tokens(B + 3))
    cache, logits = list(sequence.cache), sequence.logits
    with pytest.raises(ProtocolError, match="outside this model's vocabulary"):
        engine_a.extend(sequence, [5, 320])
    assert sequence.length == B + 3 and len(sequence.tokens) == B + 3
    assert sequence.cache == cache and sequence.logits is logits


@pytest.mark.parametrize(
    ("method", "params"),
    [("greedy", {}), ("top-p", {"p": 0.9, "temperature": 0.7}), ("min-p", {"p": 0.2})],
)
@pytest.mark.parametrize("offset", [8, 20])
def test_resumed_session_continues_token_for_token(engine_a, engine_b, method, params, offset):
    """Instance A serves a session and checkpoints it; B resumes from the checkpoint as 6.8
    describes: loads the prompt blocks and the generated blocks A published, recomputes what
    no block covers, restores the sampler, and produces the tokens A produced."""
    prompt = prompt_tokens(2 * B + 5, seed=11)
    compat = bytes.fromhex(engine_a.compat_id)
    sampler = TokenSampler(method, params, seed=7)
    sequence = engine_a.prefill(prompt)
    generated: list[int] = []
    checkpoint = None
    for index in range(28):
        if index == offset:
            checkpoint = SessionCheckpoint(
                session=str(uuid.UUID(int=offset)),
                epoch=1,
                compat_id=engine_a.compat_id,
                scope_id=scope_id_hex(SCOPE_KEY),
                prompt_blocks=tuple(block_keys_hex(SCOPE_KEY, compat, prompt, B)),
                prompt_tail=tuple(prompt[2 * B :]),
                generated=tuple(generated),
                output_offset=index,
                sampler=sampler.to_record(),
            )
        token = sampler.sample(sequence.logits)
        generated.append(token)
        engine_a.decode(sequence, token)
    # A publishes every complete block it holds, prompt and generated, under its Block Key.
    keys = block_keys_hex(SCOPE_KEY, compat, prompt + generated, B)
    holder = dict(
        zip(
            keys, (c.tobytes() for c in engine_a.export_blocks(sequence, 0, len(keys))), strict=True
        )
    )

    resume = SessionCheckpoint.from_json(json.loads(json.dumps(checkpoint.to_json())))
    after_blocks = list(resume.prompt_tail) + list(resume.covered_generated)
    chain = BlockKeyChain(
        SCOPE_KEY,
        compat,
        B,
        previous=bytes.fromhex(resume.prompt_blocks[-1]),
        count=len(resume.prompt_blocks),
    )
    generated_blocks = [key.hex() for key in chain.extend(after_blocks)]
    loaded = [key for key in list(resume.prompt_blocks) + generated_blocks if key in holder]
    assert len(loaded) == (len(prompt) + offset) // B
    on_b = engine_b.import_blocks([bytearray(holder[key]) for key in loaded])
    engine_b.extend(on_b, after_blocks[len(loaded) * B - len(resume.prompt_blocks) * B :])
    assert on_b.length == len(prompt) + offset

    restored = TokenSampler.from_record(resume.sampler)
    assert restored.step == offset
    continued = []
    for _ in range(len(generated) - offset):
        token = restored.sample(on_b.logits)
        continued.append(token)
        engine_b.decode(on_b, token)
    assert continued == generated[offset:]


def test_a_bfloat16_engine_moves_its_cache_bit_for_bit(model_dir, engine_a):
    first = ReferenceEngine(model_dir, block_tokens=B, device="cpu", dtype=torch.bfloat16)
    second = ReferenceEngine(model_dir, block_tokens=B, device="cpu", dtype=torch.bfloat16)
    assert first.kv_dtype == "bfloat16" and first.compat_id != engine_a.compat_id
    prompt = prompt_tokens(2 * B + 4, seed=21)
    on_first = first.prefill(prompt[: 2 * B])
    exported = first.export_blocks(on_first, 0, 2)
    assert exported[0].size == received(exported)[0].header_size + 4 * 2 * B * 2 * 16 * 2
    with pytest.raises(ProtocolError) as raised:
        engine_a.import_blocks(exported)
    assert raised.value.problem == "kvsp-invalid-container"
    on_second = second.import_blocks(received(exported), compat_id=first.compat_id)
    assert torch.equal(
        first.extend(on_first, prompt[2 * B :]), second.extend(on_second, prompt[2 * B :])
    )


def test_warming_up_runs_every_kind_of_forward_pass_and_changes_nothing(model_dir, engine_a):
    """The warm-up a node runs before it says that it serves (``KVSP_ENGINE_WARM_UP``): real
    forward passes, counted, that leave the engine computing exactly what a cold one does."""
    warmed = ReferenceEngine(model_dir, block_tokens=B, device="cpu")
    assert warmed.forward_passes == 0
    # A prefill, an extend after an imported block, a decoding step.
    assert warmed.warm_up() == 3
    assert warmed.forward_passes == 3

    prompt = prompt_tokens(2 * B + 5, seed=21)
    on_warmed, on_cold = warmed.prefill(prompt), engine_a.prefill(prompt)
    assert warmed.forward_passes == 4
    assert torch.equal(on_warmed.logits, on_cold.logits)
    tokens_warmed, _ = greedy_continuation(warmed, on_warmed, 4)
    tokens_cold, _ = greedy_continuation(engine_a, on_cold, 4)
    assert tokens_warmed == tokens_cold and warmed.forward_passes == 8
