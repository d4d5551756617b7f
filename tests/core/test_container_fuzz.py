"""Garbage in, ProtocolError out: the container decoders under hypothesis (spec 4.3).

Arbitrary octets and mutated valid containers must only ever produce the protocol's own error,
the whole-buffer decoder and the stream reader must agree on every input, and no header value
may make either allocate more than its input or its limit.
"""

from __future__ import annotations

import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp import container as kvb
from kvsp.problems import ProtocolError

MAX_SIZE = 1 << 16
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome_of_decode(data: bytes):
    try:
        decoded = kvb.decode(data, max_size=MAX_SIZE)
    except ProtocolError as error:
        return error.problem
    layers = [
        (layer.index, bytes(layer.k), bytes(layer.v), kvb.layer_digest(layer.k, layer.v))
        for layer in decoded.layers()
    ]
    assert decoded.first_layer + decoded.layer_count - 1 <= 2**32 - 1
    assert decoded.size == len(data) <= MAX_SIZE
    return layers


def outcome_of_stream(data: bytes, cuts: list[int]):
    reader = kvb.ContainerStreamReader(max_size=MAX_SIZE)
    handed_out = []
    position = 0
    try:
        for cut in cuts:
            handed_out += reader.feed(data[position : position + cut])
            position += cut
        handed_out += reader.feed(data[position:])
        reader.finish()
    except ProtocolError as error:
        return error.problem
    return [(layer.index, bytes(layer.k), bytes(layer.v), layer.digest) for layer in handed_out]


def check(data: bytes, cuts: list[int]) -> None:
    by_decode = outcome_of_decode(data)
    by_stream = outcome_of_stream(data, cuts)
    if isinstance(by_decode, str) or isinstance(by_stream, str):
        # Both reject it. The problem can differ only where the stream reader, which cannot see
        # the end of the input, finds the sections running past its limit.
        assert isinstance(by_decode, str) and isinstance(by_stream, str)
        assert by_decode in {"kvsp-invalid-container", "kvsp-payload-too-large"}
        assert by_stream in {"kvsp-invalid-container", "kvsp-payload-too-large"}
    else:
        assert by_decode == by_stream


@st.composite
def valid_containers(draw):
    count = draw(st.integers(1, 5))
    layers = [(draw(st.binary(max_size=24)), draw(st.binary(max_size=24))) for _ in range(count)]
    first = draw(st.integers(0, 2**32 - count))
    return kvb.encode(
        draw(st.integers(0, 2**16 - 1)), first, draw(st.integers(0, 2**32 - 1)), layers
    )


cut_lists = st.lists(st.integers(0, 64), max_size=12)


@FUZZ
@given(data=st.binary(max_size=200), cuts=cut_lists)
def test_arbitrary_octets(data, cuts):
    check(data, cuts)


@FUZZ
@given(
    tail=st.binary(max_size=120), fields=st.tuples(*[st.integers(0, 2**32 - 1)] * 3), cuts=cut_lists
)
def test_arbitrary_octets_behind_a_valid_magic_and_version(tail, fields, cuts):
    first_layer, layer_count, token_count = fields
    head = struct.pack(">4sBBHIII", b"KVB1", 1, 0, 1, first_layer, layer_count % 8, token_count)
    check(head + tail, cuts)


@FUZZ
@given(
    data=valid_containers(),
    flips=st.lists(st.integers(0, 10_000), min_size=1, max_size=4),
    cuts=cut_lists,
)
def test_bit_flips(data, flips, cuts):
    mutated = bytearray(data)
    for flip in flips:
        mutated[(flip // 8) % len(mutated)] ^= 1 << (flip % 8)
    check(bytes(mutated), cuts)


@FUZZ
@given(
    data=valid_containers(),
    keep=st.integers(0, 10_000),
    extra=st.binary(max_size=8),
    cuts=cut_lists,
)
def test_truncations_and_extensions(data, keep, extra, cuts):
    check(data[: keep % (len(data) + 1)], cuts)
    check(data + extra, cuts)


@FUZZ
@given(
    data=valid_containers(),
    entry=st.integers(0, 100),
    length=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
    cuts=cut_lists,
)
def test_length_table_edits(data, entry, length, cuts):
    layer_count = struct.unpack_from(">I", data, 12)[0]
    offset = 20 + 8 * (entry % (2 * layer_count))
    mutated = bytearray(data)
    struct.pack_into(">Q", mutated, offset, length)
    check(bytes(mutated), cuts)


@FUZZ
@given(data=valid_containers(), layer_count=st.integers(0, 2**32 - 1), cuts=cut_lists)
def test_layer_count_edits(data, layer_count, cuts):
    mutated = bytearray(data)
    struct.pack_into(">I", mutated, 12, layer_count)
    check(bytes(mutated), cuts)


def peak_allocation(call) -> int:
    tracemalloc.start()
    try:
        try:
            call()
        except ProtocolError:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# Room for the interpreter's own bookkeeping while the decoder runs (exception objects,
# struct caches, tracebacks); far below any size a header can claim.
SLACK = 64 << 10


@settings(max_examples=60, deadline=None)
@given(
    layer_count=st.integers(1, 2**32 - 1),
    lengths=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=8),
)
def test_huge_claims_cause_no_huge_allocation(layer_count, lengths):
    head = struct.pack(">4sBBHIII", b"KVB1", 1, 0, 1, 0, layer_count, 1)
    table = struct.pack(f">{len(lengths)}Q", *lengths)
    data = head + table

    assert peak_allocation(lambda: kvb.decode(data)) < SLACK + 2 * len(data)

    limit = 1 << 20

    def stream():
        kvb.ContainerStreamReader(max_size=limit).feed(data)

    # The reader may size its buffer from the header, but never beyond its limit.
    assert peak_allocation(stream) < limit + SLACK


def test_a_claim_within_the_limit_allocates_the_claimed_size_once():
    # The counterpart of the bound above: the buffer really is sized from the header, once.
    claimed = 512 << 10
    data = struct.pack(">4sBBHIIIQQ", b"KVB1", 1, 0, 1, 0, 1, 1, claimed // 2, claimed // 2)
    reader = kvb.ContainerStreamReader(max_size=1 << 20)
    peak = peak_allocation(lambda: reader.feed(data))
    assert claimed <= peak < claimed + SLACK
    assert reader.size == len(data) + claimed
