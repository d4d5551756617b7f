"""KVSPConnector in vLLM's CPU build: prefixes load through KVSP and answer as computing them
does; every failure to load means computing, never a wrong token or a stuck request."""

from __future__ import annotations

import hashlib
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsp.blockkeys import block_keys_hex
from kvsp.container import decode, store_headers
from kvsp.tensors import container_tensors
from tests.node.support import container
from tests.vllm.conftest import BLOCK_TOKENS, MODEL

# The fixtures commit what every process needs outside any test transaction; marking the tests
# is what makes pytest-django set up the test database at all.
pytestmark = pytest.mark.django_db

# float32 on both sides: the logprob of the first generated token may differ in the last bits
# only (the loaded cache is the octets the producer computed, over other matmul shapes).
LOGPROB_TOLERANCE = 1e-5
# Between engines: the reference engine (transformers, eager attention) and vLLM's CPU kernels
# compute the same float32 arithmetic in other orders; measured here: K and V within 4.8e-7,
# logprobs within 4.8e-7 (docs/vllm.md, "Between engines").
CROSS_TOLERANCE = 1e-5
BLOCK_GETS = (
    "kvsp_http_requests_total",
    (("endpoint", "block"), ("method", "GET"), ("status", "200")),
)
LOOKUP_MATCHED = ("kvsp_lookup_matched_blocks_total", (("source", "lookup"),))


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(count)]


def scrape(client, base: str) -> dict:
    found = {}
    text = client.get(base.removesuffix("kvsp/") + "metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def counted(client, base: str, key: tuple) -> float:
    return scrape(client, base).get(key, 0.0)


def assert_same_answer(answer: dict, recomputed: dict) -> None:
    assert answer["tokens"] == recomputed["tokens"]
    assert abs(answer["logprobs"][0] - recomputed["logprobs"][0]) <= LOGPROB_TOLERANCE


@pytest.fixture
def control(vllm_cluster):
    with vllm_cluster.api(vllm_cluster.cp_url, "engine_a") as client:
        yield client


def keys_a(vllm_cluster, prompt: list[int]) -> list[str]:
    return block_keys_hex(
        vllm_cluster.scope_key_a, bytes.fromhex(vllm_cluster.compat), prompt, BLOCK_TOKENS
    )


def test_the_cpu_layout_converted_to_is_the_one_vllm_writes(engines):
    probed = engines.recompute.ask(op="probe_layout")
    assert set(probed) == {"float32", "float16", "bfloat16"}
    # float32 always runs the "vec" kernels; bfloat16 runs AMX's on CPUs that have it, whose
    # pages the connector refuses to convert (kvsp_vllm.connector._check_cpu_isa).
    assert probed["float32"]["isa"] == "vec"
    for dtype, found in probed.items():
        if found["isa"] == "vec":
            assert found["k"] and found["v"], dtype


def test_a_fresh_engine_loads_a_shared_prefix_through_kvsp(vllm_cluster, engines, control):
    prefix = tokens(1, 4 * BLOCK_TOKENS)
    first, second = prefix + tokens(2, 20), prefix + tokens(3, 20)
    engines.producer.generate(first)
    produced = engines.producer.drain()
    assert produced["stored"] == 4 and produced["store_failed"] == 0

    # The node stored and published every block of the prefix: the IS lists it as the holder.
    for key in keys_a(vllm_cluster, prefix):
        listed = control.get(f"replicas/{vllm_cluster.compat}/{vllm_cluster.scope_a}/{key}")
        assert listed.status_code == 200, listed.text
        holders = {record["holder"] for record in listed.json()["replicas"]}
        assert holders == {vllm_cluster.node_url}

    gets = counted(control, vllm_cluster.node_url, BLOCK_GETS)
    matched = counted(control, vllm_cluster.cp_url, LOOKUP_MATCHED)
    answer = engines.consumer.generate(second)
    assert answer["cached_tokens"] == 4 * BLOCK_TOKENS
    assert answer["counts"]["loaded"] == 4 and answer["counts"]["load_failed"] == 0
    assert counted(control, vllm_cluster.node_url, BLOCK_GETS) == gets + 4
    assert counted(control, vllm_cluster.cp_url, LOOKUP_MATCHED) == matched + 4

    assert_same_answer(answer, engines.recompute.generate(second))


def test_a_corrupted_block_is_detected_and_recomputed(vllm_cluster, engines, control):
    prompt = tokens(4, 3 * BLOCK_TOKENS + 10)
    engines.producer.generate(prompt)
    assert engines.producer.drain()["store_failed"] == 0
    # One flipped octet in the last layer of the middle block: its first layers arrive and
    # match, the last one does not.
    (path,) = vllm_cluster.block_files(keys_a(vllm_cluster, prompt)[1])
    with path.open("r+b") as stream:
        stream.seek(-1, 2)
        last = stream.read(1)
        stream.seek(-1, 2)
        stream.write(bytes([last[0] ^ 0x01]))

    before = engines.consumer.drain()
    answer = engines.consumer.generate(prompt)
    after = answer["counts"]
    # Block 0 loaded; block 1 failed its layer digest, so it and block 2 were computed.
    assert after["loaded"] - before["loaded"] == 1
    assert after["load_failed"] - before["load_failed"] == 2
    assert_same_answer(answer, engines.recompute.generate(prompt))


def test_another_scopes_blocks_are_never_loaded(vllm_cluster, engines, control):
    """Blocks of scope B stored under the very Block Keys scope A would use are not found by
    scope A's lookup: the connector loads nothing and computes the prompt."""
    prompt = tokens(5, 2 * BLOCK_TOKENS + 5)
    keys = keys_a(vllm_cluster, prompt)
    with vllm_cluster.api(vllm_cluster.node_url, "tenant_b") as tenant_b:
        for index, key in enumerate(keys):
            noise = container(index, layers=4, tokens=BLOCK_TOKENS, head_dim=32)
            stored = tenant_b.put(
                f"blocks/{vllm_cluster.compat}/{vllm_cluster.scope_b}/{key}",
                content=noise,
                headers=store_headers(hashlib.sha256(noise).digest()),
            )
            assert stored.status_code == 201, stored.text

    gets = counted(control, vllm_cluster.node_url, BLOCK_GETS)
    before = engines.consumer.drain()
    answer = engines.consumer.generate(prompt)
    assert answer["cached_tokens"] == 0
    assert answer["counts"]["loaded"] == before["loaded"]
    assert counted(control, vllm_cluster.node_url, BLOCK_GETS) == gets
    assert_same_answer(answer, engines.recompute.generate(prompt))


def test_the_reference_engine_and_vllm_use_each_others_blocks(vllm_cluster, engines, control):
    """One model directory, one block size: one Compatibility ID. The engines compute K and V
    with other kernels, so their blocks agree to CROSS_TOLERANCE, not bit for bit; each engine
    loading the other's blocks answers as computing does, to that tolerance."""
    import torch

    from workers.engines.reference import ReferenceEngine

    reference = ReferenceEngine(
        vllm_cluster.model_dir, block_tokens=BLOCK_TOKENS, device="cpu", model=MODEL
    )
    assert reference.compat_id == vllm_cluster.compat
    assert engines.consumer.ask(op="compat")["compat_id"] == vllm_cluster.compat

    # vLLM's blocks in the reference engine: the first test's prefix, stored by the producer.
    prefix = tokens(1, 4 * BLOCK_TOKENS)
    tail = tokens(2, 20)
    blocks = []
    for key in keys_a(vllm_cluster, prefix):
        with vllm_cluster.api(vllm_cluster.node_url, "engine_a") as node:
            answer = node.get(f"blocks/{vllm_cluster.compat}/{vllm_cluster.scope_a}/{key}")
        assert answer.status_code == 200
        blocks.append(answer.content)
    computed = reference.prefill(prefix + tail)
    own = reference.export_blocks(computed, 0, 4)
    kv_difference = max(
        (mine - theirs).abs().max().item()
        for encoded, octets in zip(own, blocks, strict=True)
        for mine_kv, their_kv in zip(
            block_layers(encoded.tobytes()), block_layers(octets), strict=True
        )
        for mine, theirs in zip(mine_kv, their_kv, strict=True)
    )
    assert 0 < kv_difference <= CROSS_TOLERANCE
    loaded = reference.import_blocks(blocks, compat_id=vllm_cluster.compat)
    reference.extend(loaded, tail)
    expected = torch.log_softmax(computed.logits, -1)
    logprob_difference = (torch.log_softmax(loaded.logits, -1) - expected).abs().max().item()
    assert logprob_difference <= CROSS_TOLERANCE
    assert loaded.logits.argmax() == computed.logits.argmax()

    # The reference engine's blocks in vLLM, stored at the node under scope A's keys.
    prompt = tokens(8, 3 * BLOCK_TOKENS + 9)
    exported = reference.export_blocks(reference.prefill(prompt), 0, 3)
    for key, encoded in zip(keys_a(vllm_cluster, prompt), exported, strict=True):
        octets = encoded.tobytes()
        stored = control.put(
            f"{vllm_cluster.node_url}blocks/{vllm_cluster.compat}/{vllm_cluster.scope_a}/{key}",
            content=octets,
            headers=store_headers(hashlib.sha256(octets).digest()),
        )
        assert stored.status_code == 201, stored.text
    before = engines.consumer.drain()
    answer = engines.consumer.generate(prompt)
    assert answer["counts"]["loaded"] - before["loaded"] == 3
    recomputed = engines.recompute.generate(prompt)
    assert answer["tokens"] == recomputed["tokens"]
    assert abs(answer["logprobs"][0] - recomputed["logprobs"][0]) <= CROSS_TOLERANCE


def block_layers(octets: bytes) -> list:
    """K and V of every layer of a block of the test model (2 KV heads of dimension 32)."""
    return container_tensors(decode(octets), "float32", 2, 32)


def test_the_node_down_means_recomputation(vllm_cluster, engines, control):
    prompt = tokens(6, 2 * BLOCK_TOKENS + 7)
    engines.producer.generate(prompt)
    assert engines.producer.drain()["store_failed"] == 0
    vllm_cluster.node.stop()
    try:
        before = engines.consumer.drain()
        answer = engines.consumer.generate(prompt)
        # The IS still lists the node's replicas; fetching them fails and vLLM computes.
        assert answer["counts"]["load_failed"] - before["load_failed"] == 2
        assert_same_answer(answer, engines.recompute.generate(prompt))
        # Storing the blocks it computed fails too, quietly.
        longer = prompt + tokens(7, BLOCK_TOKENS)
        answer = engines.consumer.generate(longer)
        assert engines.consumer.drain()["store_failed"] > before["store_failed"]
        assert_same_answer(answer, engines.recompute.generate(longer))
    finally:
        vllm_cluster.node.start()
