"""Layer-wise loading overlaps computation (spec 4.3): a forward pass over new tokens runs
layer l as soon as layer l of every imported block has arrived, and gets exactly the result of
importing the blocks all at once."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvsp.container import ContainerStreamReader, decode, encode
from kvsp.problems import ProtocolError
from tests.engines.conftest import B

BLOCKS = 3
LAYERS = 4


@pytest.fixture(scope="module")
def exported(engine_a):
    """A prompt of three blocks and a tail, the blocks as octets, and the logits that follow
    the tail on the instance that computed the blocks."""
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 320, (BLOCKS * B + 6,), generator=generator).tolist()
    sequence = engine_a.prefill(prompt[: BLOCKS * B])
    containers = engine_a.export_blocks(sequence, 0, BLOCKS)
    logits = engine_a.extend(sequence, prompt[BLOCKS * B :])
    return prompt, [encoded.tobytes() for encoded in containers], containers, logits


def layer_chunks(octets: bytes) -> list[bytes]:
    """The container cut at its layer boundaries: header and layer 0, then one layer each."""
    container = decode(octets)
    ends = [container.data_range(layer, layer)[1] for layer in range(LAYERS)]
    starts = [0, *ends[:-1]]
    return [octets[start:end] for start, end in zip(starts, ends, strict=True)]


class Producer(threading.Thread):
    """Runs ``work`` on its own thread and keeps what it raised, for the test to check."""

    def __init__(self, work):
        super().__init__(daemon=True)
        self.work = work
        self.error: BaseException | None = None

    def run(self):
        try:
            self.work()
        except BaseException as error:
            self.error = error


def test_layer_zero_runs_before_the_last_layer_arrives(engine_b, exported):
    prompt, octets, containers, logits_a = exported
    layerwise = engine_b.begin_import(BLOCKS, tokens=prompt[: BLOCKS * B], timeout=60)
    readers = [
        ContainerStreamReader(
            max_size=len(data), max_layers=LAYERS, expected_layer_digests=encoded.layer_digests
        )
        for data, encoded in zip(octets, containers, strict=True)
    ]
    chunks = [layer_chunks(data) for data in octets]

    def stream():
        for layer in range(LAYERS):
            if layer == LAYERS - 1:
                # Hold the last layer back until the forward pass asks for it: by then it has
                # run every earlier layer on the blocks received so far.
                assert layerwise.wait_requested(layer, timeout=60)
            for block in range(BLOCKS):
                time.sleep(0.01)
                layerwise.add_received(
                    block, readers[block], readers[block].feed(chunks[block][layer])
                )

    producer = Producer(stream)
    producer.start()
    logits_b = engine_b.extend(layerwise.sequence, prompt[BLOCKS * B :])
    producer.join(60)
    assert producer.error is None
    assert all(reader.done for reader in readers)

    started, ready = layerwise.sequence.layer_started, layerwise.ready_at
    assert started[0] < ready[LAYERS - 1]
    for layer in range(LAYERS):
        assert ready[layer] <= started[layer]
    assert layerwise.requested_at[0] < ready[LAYERS - 1]
    assert layerwise.sequence.pending is None

    all_at_once = engine_b.import_blocks([bytearray(data) for data in octets])
    assert torch.equal(logits_b, engine_b.extend(all_at_once, prompt[BLOCKS * B :]))
    assert torch.equal(logits_b, logits_a)


def test_layers_may_arrive_in_any_order_from_several_threads(engine_b, exported):
    prompt, octets, _, logits_a = exported
    layerwise = engine_b.begin_import(BLOCKS, timeout=60)
    per_block = [decode(bytearray(data)) for data in octets]
    tensors = [
        [
            (
                torch.frombuffer(bytearray(container.layer(layer)[0]), dtype=torch.float32).view(
                    B, 2, 16
                ),
                torch.frombuffer(bytearray(container.layer(layer)[1]), dtype=torch.float32).view(
                    B, 2, 16
                ),
            )
            for layer in range(LAYERS)
        ]
        for container in per_block
    ]

    def sender(block: int):
        order = list(range(LAYERS))
        random.Random(block).shuffle(order)

        def send():
            for layer in order:
                time.sleep(0.005)
                layerwise.add_layer(block, layer, *tensors[block][layer])

        return send

    producers = [Producer(sender(block)) for block in range(BLOCKS)]
    for producer in producers:
        producer.start()
    logits_b = engine_b.extend(layerwise.sequence, prompt[BLOCKS * B :])
    for producer in producers:
        producer.join(60)
        assert producer.error is None
    assert layerwise.done
    assert torch.equal(logits_b, logits_a)


def test_export_of_an_import_in_flight_waits_for_its_layers(engine_b, exported):
    _, octets, containers, _ = exported
    layerwise = engine_b.begin_import(BLOCKS, timeout=60)

    def send():
        for block, data in enumerate(octets):
            time.sleep(0.01)
            layerwise.add_container(block, decode(bytearray(data)))

    producer = Producer(send)
    producer.start()
    again = engine_b.export_blocks(layerwise.sequence, 0, BLOCKS)
    producer.join(60)
    assert producer.error is None
    assert [encoded.digest for encoded in again] == [encoded.digest for encoded in containers]


def test_a_failed_import_fails_the_forward_pass_and_leaves_the_sequence(engine_b, exported):
    prompt, octets, _, _ = exported
    layerwise = engine_b.begin_import(BLOCKS, timeout=60)
    for block, data in enumerate(octets):
        container = decode(bytearray(data))
        layerwise.add_layer(block, 0, *container.layer(0))

    def fail():
        assert layerwise.wait_requested(1, timeout=60)
        layerwise.fail(ProtocolError("kvsp-digest-mismatch", "layer 1 of block 2 is corrupt"))

    producer = Producer(fail)
    producer.start()
    with pytest.raises(ProtocolError, match="layer 1 of block 2 is corrupt"):
        engine_b.extend(layerwise.sequence, prompt[BLOCKS * B :])
    producer.join(60)
    assert producer.error is None
    sequence = layerwise.sequence
    assert sequence.length == BLOCKS * B and sequence.logits is None
    with pytest.raises(ProtocolError, match="corrupt"):
        engine_b.decode(sequence, 7)
    with pytest.raises(ProtocolError, match="corrupt"):
        layerwise.add_layer(0, 2, *decode(bytearray(octets[0])).layer(2))


def test_an_import_that_stalls_times_out(engine_b, exported):
    prompt, _, _, _ = exported
    layerwise = engine_b.begin_import(BLOCKS, timeout=0.2)
    with pytest.raises(TimeoutError, match="layer 0"):
        engine_b.extend(layerwise.sequence, prompt[BLOCKS * B :])
    assert layerwise.sequence.length == BLOCKS * B


def test_layers_that_do_not_fit_the_import_are_refused(engine_b, exported):
    _, octets, _, _ = exported
    layerwise = engine_b.begin_import(BLOCKS, timeout=60)
    one_block = decode(bytearray(octets[0]))
    # A container of 8 tokens: a block of a model with B = 8.
    eight = encode(
        1, 0, 8, [(k[: len(k) // 2], v[: len(v) // 2]) for _, k, v, _ in one_block.layers()]
    )
    reader = ContainerStreamReader(max_size=len(eight))
    with pytest.raises(ProtocolError, match="holds 8 tokens"):
        layerwise.add_received(0, reader, reader.feed(eight))
    with pytest.raises(ProtocolError, match="block 3 is not one of the blocks 0-2"):
        layerwise.add_layer(3, 0, *one_block.layer(0))
    layerwise.add_layer(0, 0, *one_block.layer(0))
    with pytest.raises(ProtocolError, match="arrived twice"):
        layerwise.add_layer(0, 0, *one_block.layer(0))
    for block in (1, 2):
        layerwise.add_layer(block, 0, *one_block.layer(0))
    # Layer 0 is complete now, and once handed over it is no longer held by the import.
    with pytest.raises(ProtocolError, match="layer 0 of block 1 arrived twice"):
        layerwise.add_layer(1, 0, *one_block.layer(0))
    layerwise.take_layer(0)
    with pytest.raises(ProtocolError, match="layer 0 of block 2 arrived twice"):
        layerwise.add_layer(2, 0, *one_block.layer(0))
