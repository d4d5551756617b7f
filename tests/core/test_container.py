"""KV Block Container (spec 4.3): layout, validation, digests, slicing and streaming."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import container as kvb
from kvsp.problems import ProtocolError


def longhand(codec, first_layer, token_count, layers, **fields):
    """A container written field by field, independently of the encoder."""
    out = bytearray(fields.get("magic", b"KVB1"))
    out += struct.pack(">B", fields.get("version", 1))
    out += struct.pack(">B", fields.get("flags", 0))
    out += struct.pack(">H", codec)
    out += struct.pack(">I", first_layer)
    out += struct.pack(">I", fields.get("layer_count", len(layers)))
    out += struct.pack(">I", token_count)
    for k_length, v_length in fields.get("lengths", [(len(k), len(v)) for k, v in layers]):
        out += struct.pack(">Q", k_length) + struct.pack(">Q", v_length)
    for k, v in layers:
        out += k + v
    return bytes(out)


# Sections of any lengths, K and V apart, are the tests' way to see that every layer's own offsets
# are used: this codec's sections are opaque octets, while codec raw's must have one length
# (4.3, kvsp-layout-1; see the raw tests below).
OPAQUE = 0x8001


def sample_layers(count=3, size=11):
    return [(os.urandom(size + i), os.urandom(size + 2 * i)) for i in range(count)]


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def problem_of(call) -> str:
    with pytest.raises(ProtocolError) as caught:
        call()
    return caught.value.problem


# -- layout and round trips --------------------------------------------------------------------


def test_encode_writes_the_layout_of_section_4_3():
    layers = [(b"\x01\x02\x03", b"\x04\x05"), (b"", b"\x06")]
    data = kvb.encode(0x0102, 0x0A0B0C0D, 0x11223344, layers)
    assert data == longhand(0x0102, 0x0A0B0C0D, 0x11223344, layers)
    assert data[0:4] == b"KVB1" == (0x4B564231).to_bytes(4, "big")
    assert data[4] == 1 and data[5] == 0
    assert data[6:8] == b"\x01\x02"
    assert data[8:12] == b"\x0a\x0b\x0c\x0d"
    assert data[12:16] == b"\x00\x00\x00\x02"
    assert data[16:20] == b"\x11\x22\x33\x44"
    assert data[20:36] == (3).to_bytes(8, "big") + (2).to_bytes(8, "big")
    assert data[36:52] == (0).to_bytes(8, "big") + (1).to_bytes(8, "big")
    assert data[52:] == b"\x01\x02\x03\x04\x05\x06"


def test_decode_round_trip():
    layers = sample_layers()
    data = kvb.encode(OPAQUE, 4, 9, layers)
    decoded = kvb.decode(data)
    assert (decoded.version, decoded.codec, decoded.first_layer) == (1, OPAQUE, 4)
    assert (decoded.layer_count, decoded.last_layer, decoded.token_count) == (3, 6, 9)
    assert decoded.header_size == kvb.header_size(3) == 20 + 3 * 16
    assert decoded.size == len(data)
    for index, (k, v) in enumerate(layers):
        got_k, got_v = decoded.layer(4 + index)
        assert bytes(got_k) == k and bytes(got_v) == v
        assert decoded.section_lengths(4 + index) == (len(k), len(v))
    assert [layer.index for layer in decoded.layers()] == [4, 5, 6]


def test_decode_returns_views_of_the_input_not_copies():
    data = bytearray(kvb.encode(OPAQUE, 0, 1, sample_layers()))
    decoded = kvb.decode(data)
    k, v = decoded.layer(1)
    assert isinstance(k, memoryview) and k.obj is data and v.obj is data
    data[-1] ^= 0xFF
    assert decoded.layer(2)[1][-1] == data[-1]


def test_decode_accepts_a_view_into_a_larger_buffer():
    body = kvb.encode(OPAQUE, 0, 1, sample_layers())
    backing = b"xx" + body + b"yy"
    decoded = kvb.decode(memoryview(backing)[2:-2])
    assert decoded.layer(0)[0].obj is backing
    assert bytes(decoded.buffer) == body


def test_encode_parts_are_the_callers_buffers():
    layers = [(bytearray(b"kkkk"), memoryview(b"vv")), (b"k2", array("H", [1, 2]))]
    parts = kvb.encode_parts(OPAQUE, 0, 1, layers)
    assert len(parts) == 1 + 2 * len(layers)
    assert parts[1].obj is layers[0][0]
    assert parts[3].obj is layers[1][0]
    assert parts[0] == kvb.encode_header(OPAQUE, 0, 1, [(4, 2), (2, 4)])
    joined = kvb.encode(OPAQUE, 0, 1, layers)
    assert joined == b"".join(parts)
    assert bytes(kvb.decode(joined).layer(1)[1]) == array("H", [1, 2]).tobytes()


@pytest.mark.parametrize("threads", [None, 1, 2, 4])
def test_encode_with_digests_hashes_each_layer(threads):
    # Large enough that threads > 1 takes the thread pool.
    layers = [(os.urandom(300_000), os.urandom(300_000)) for _ in range(4)]
    encoded = kvb.encode_with_digests(OPAQUE, 2, 5, layers, threads=threads)
    assert encoded.layer_digests == [sha256(k + v) for k, v in layers]
    assert encoded.size == len(encoded.tobytes()) == kvb.header_size(4) + 4 * 600_000
    assert encoded.tobytes() == kvb.encode(OPAQUE, 2, 5, layers)
    assert (
        encoded.digest == "sha-256:" + hashlib.sha256(b"".join(encoded.layer_digests)).hexdigest()
    )
    assert encoded.parts[1].obj is layers[0][0]


@pytest.mark.parametrize(
    "arguments",
    [
        (0x10000, 0, 0, [(b"", b"")]),
        (-1, 0, 0, [(b"", b"")]),
        (1, 0, 2**32, [(b"", b"")]),
        (1, -1, 0, [(b"", b"")]),
        (1, 2**32 - 1, 0, [(b"", b""), (b"", b"")]),
        (1, 0, 0, []),
    ],
)
def test_encode_rejects_values_that_do_not_fit(arguments):
    with pytest.raises(ValueError):
        kvb.encode(*arguments)


def test_last_possible_layer_index_encodes():
    data = kvb.encode(OPAQUE, 2**32 - 1, 0, [(b"k", b"v")])
    assert kvb.decode(data).last_layer == 2**32 - 1


# -- digests -----------------------------------------------------------------------------------


def test_layer_digest_is_sha256_of_k_then_v():
    k, v = os.urandom(1000), os.urandom(777)
    assert kvb.layer_digest(k, v) == sha256(k + v)
    assert kvb.layer_digest(memoryview(k), bytearray(v)) == sha256(k + v)
    assert kvb.layer_digest(k, v) != kvb.layer_digest(v, k)


def test_replica_digest_is_sha256_of_the_concatenated_layer_digests():
    digests = [sha256(bytes([i])) for i in range(5)]
    expected = "sha-256:" + hashlib.sha256(b"".join(digests)).hexdigest()
    assert kvb.replica_digest(digests) == expected
    assert kvb.replica_digest(iter(digests)) == expected
    assert kvb.replica_digest([digest.hex() for digest in digests]) == expected


def test_container_digests():
    layers = sample_layers(4)
    decoded = kvb.decode(kvb.encode(OPAQUE, 0, 3, layers))
    assert decoded.layer_digests() == [sha256(k + v) for k, v in layers]
    assert decoded.layer_digests(threads=2) == decoded.layer_digests()
    assert decoded.digest() == kvb.replica_digest([sha256(k + v) for k, v in layers])
    summary = decoded.inspect()
    assert summary["layer_digests"] == [sha256(k + v).hex() for k, v in layers]
    assert summary["digest"] == decoded.digest()
    assert (summary["version"], summary["codec"], summary["layer_count"]) == (1, OPAQUE, 4)


def test_format_and_parse_digest():
    raw = sha256(b"x")
    assert kvb.format_digest(raw) == "sha-256:" + raw.hex()
    assert kvb.parse_digest(kvb.format_digest(raw)) == raw
    with pytest.raises(ValueError):
        kvb.format_digest(raw[:31])


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"sha-256:" + b"0" * 64,
        "sha-256:" + "0" * 63,
        "sha-256:" + "A" * 64,
        "sha256:" + "0" * 64,
        "sha-512:" + "0" * 64,
        "0" * 64,
    ],
)
def test_parse_digest_rejects_other_forms(value):
    assert problem_of(lambda: kvb.parse_digest(value)) == "kvsp-invalid-record"


def test_verify_layer_digests():
    layers = sample_layers(4)
    decoded = kvb.decode(kvb.encode(OPAQUE, 2, 3, layers))
    digests = [sha256(k + v) for k, v in layers]
    assert decoded.verify_layer_digests(digests) == digests
    assert decoded.verify_layer_digests([d.hex() for d in digests]) == digests
    record = [sha256(b"layer 0"), sha256(b"layer 1"), *digests, sha256(b"layer 6")]
    assert decoded.verify_layer_digests(record, expected_first_layer=0) == digests

    wrong = list(digests)
    wrong[2] = sha256(b"other")
    with pytest.raises(ProtocolError) as caught:
        decoded.verify_layer_digests(wrong)
    assert caught.value.problem == "kvsp-digest-mismatch"
    assert "layer 4" in caught.value.detail


@pytest.mark.parametrize(
    ("expected_count", "expected_first_layer"),
    [(3, None), (5, None), (5, 0), (4, 3), (7, 3)],
)
def test_verify_layer_digests_needs_a_list_that_covers_the_container(
    expected_count, expected_first_layer
):
    decoded = kvb.decode(kvb.encode(OPAQUE, 2, 3, sample_layers(4)))
    expected = [sha256(bytes([i])) for i in range(expected_count)]
    call = lambda: decoded.verify_layer_digests(  # noqa: E731
        expected, expected_first_layer=expected_first_layer
    )
    assert problem_of(call) == "kvsp-digest-mismatch"


def test_verify_replica_digest():
    digests = [sha256(bytes([i])) for i in range(3)]
    kvb.verify_replica_digest(digests, kvb.replica_digest(digests))
    kvb.verify_replica_digest([d.hex() for d in digests], kvb.replica_digest(digests))
    other = kvb.replica_digest(digests[:2])
    assert problem_of(lambda: kvb.verify_replica_digest(digests, other)) == "kvsp-digest-mismatch"
    assert problem_of(lambda: kvb.verify_replica_digest(digests, "x")) == "kvsp-invalid-record"


def test_a_layer_digest_of_the_wrong_length_is_rejected():
    call = lambda: kvb.replica_digest([b"short"])  # noqa: E731
    assert problem_of(call) == "kvsp-invalid-record"


# -- validation --------------------------------------------------------------------------------

GOOD = [(b"\x01\x02", b"\x03\x04\x05"), (b"\x06", b"")]
INVALID = "kvsp-invalid-container"


@pytest.mark.parametrize(
    ("data", "stream_problem"),
    [
        pytest.param(b"", INVALID, id="empty"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, magic=b"KVB2"), INVALID, id="bad magic"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, magic=b"kvb1"), INVALID, id="lowercase magic"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, version=0), INVALID, id="version 0"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, version=2), INVALID, id="version 2"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, flags=1), INVALID, id="flags 1"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD, flags=0x80), INVALID, id="flags 0x80"),
        pytest.param(longhand(OPAQUE, 0, 1, []), INVALID, id="no layers"),
        pytest.param(longhand(OPAQUE, 2**32 - 1, 1, GOOD), INVALID, id="layer index overflow"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD)[:19], INVALID, id="fixed header cut"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD)[:40], INVALID, id="length table cut"),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, layer_count=9),
            INVALID,
            id="more layers than the table holds",
        ),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD)[:-1], INVALID, id="truncated data"),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD)[: kvb.header_size(2) + 1], INVALID, id="truncated inside K"
        ),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD) + b"\x00", INVALID, id="trailing octet"),
        pytest.param(longhand(OPAQUE, 0, 1, GOOD) * 2, INVALID, id="trailing container"),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, lengths=[(2**64 - 1, 3), (1, 0)]),
            "kvsp-payload-too-large",
            id="K length 2**64-1",
        ),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, lengths=[(2, 2**64 - 1), (1, 0)]),
            "kvsp-payload-too-large",
            id="V length 2**64-1",
        ),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, lengths=[(2**63, 2**63), (1, 0)]),
            "kvsp-payload-too-large",
            id="lengths sum past 2**64",
        ),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, lengths=[(1, 3), (1, 0)]), INVALID, id="lengths too short"
        ),
        pytest.param(
            longhand(OPAQUE, 0, 1, GOOD, lengths=[(3, 3), (1, 0)]), INVALID, id="lengths too long"
        ),
    ],
)
def test_invalid_containers_raise_invalid_container(data, stream_problem):
    assert problem_of(lambda: kvb.decode(data)) == "kvsp-invalid-container"
    reader = kvb.ContainerStreamReader(max_size=1 << 20)

    def stream():
        reader.feed(data)
        reader.finish()

    # A stream reader knows only its limit, not the container's length: a length table that
    # runs past it is too large rather than truncated.
    assert problem_of(stream) == stream_problem


def test_layer_count_beyond_max_layers_is_rejected_before_the_table_is_read():
    # Claims 2**32 - 1 layers; only the fixed header is present.
    data = longhand(OPAQUE, 0, 1, [], layer_count=2**32 - 1)
    with pytest.raises(ProtocolError) as caught:
        kvb.decode(data, max_layers=128)
    assert caught.value.problem == "kvsp-invalid-container"
    assert "128" in caught.value.detail
    assert problem_of(lambda: kvb.decode(data)) == "kvsp-invalid-container"
    good = longhand(OPAQUE, 0, 1, GOOD)
    assert kvb.decode(good, max_layers=2).layer_count == 2
    assert problem_of(lambda: kvb.decode(good, max_layers=1)) == "kvsp-invalid-container"


def test_max_size():
    data = longhand(OPAQUE, 0, 1, GOOD)
    assert kvb.decode(data, max_size=len(data)).size == len(data)
    with pytest.raises(ProtocolError) as caught:
        kvb.decode(data, max_size=len(data) - 1)
    assert caught.value.problem == "kvsp-payload-too-large"
    assert caught.value.status == 413


def test_decode_rejects_non_buffers_as_a_caller_error():
    with pytest.raises(TypeError):
        kvb.decode("KVB1")


def test_layer_outside_the_container_is_unavailable():
    decoded = kvb.decode(kvb.encode(OPAQUE, 5, 1, GOOD))
    for layer in (4, 7, -1):
        with pytest.raises(ProtocolError) as caught:
            decoded.layer(layer)
        assert caught.value.problem == "kvsp-layers-unavailable"
        assert caught.value.status == 404


# -- codec raw: what layout kvsp-layout-1 allows (4.3) ------------------------------------------


@pytest.mark.parametrize(("tokens", "length"), [(1, 11), (4, 24), (3, 3), (0, 0)])
def test_raw_containers_of_one_section_length_decode(tokens, length):
    layers = [(os.urandom(length), os.urandom(length)) for _ in range(3)]
    data = kvb.encode(kvb.RAW_CODEC, 2, tokens, layers)
    assert kvb.decode(data).section_lengths(4) == (length, length)
    reader = kvb.ContainerStreamReader(max_size=len(data))
    assert len(reader.feed(data)) == 3 and reader.finish().token_count == tokens


@pytest.mark.parametrize(
    ("tokens", "lengths", "detail"),
    [
        pytest.param(
            2,
            [(8, 8), (8, 6)],
            "layer 6 has a K section of 8 octets and a V section of 6",
            id="K and V of a layer differ",
        ),
        pytest.param(
            2,
            [(8, 8), (6, 6)],
            "layer 6 has sections of 6 octets, layer 5 of 8",
            id="layers differ",
        ),
        pytest.param(4, [(6, 6), (6, 6)], "do not hold 4 tokens", id="not a multiple of tokens"),
        pytest.param(0, [(2, 2)], "a container of 0 tokens has empty sections", id="no tokens"),
        pytest.param(3, [(0, 0), (0, 0)], "do not hold 3 tokens", id="tokens in empty sections"),
    ],
)
def test_raw_containers_that_no_layout_1_can_have_are_refused(tokens, lengths, detail):
    layers = [(os.urandom(k), os.urandom(v)) for k, v in lengths]
    data = kvb.encode(kvb.RAW_CODEC, 5, tokens, layers)
    with pytest.raises(ProtocolError) as caught:
        kvb.decode(data)
    assert caught.value.problem == INVALID and detail in caught.value.detail
    # A stream reader refuses it as soon as the length table is in, before the data's buffer
    # is allocated.
    reader = kvb.ContainerStreamReader(max_size=len(data))
    with pytest.raises(ProtocolError) as streamed:
        reader.feed(data[: kvb.header_size(len(layers))])
    assert (streamed.value.problem, streamed.value.detail) == (INVALID, caught.value.detail)
    # The same sections are fine in a codec whose sections are opaque.
    assert kvb.decode(kvb.encode(OPAQUE, 5, tokens, layers)).layer_count == len(layers)


# -- slicing -----------------------------------------------------------------------------------


def test_slice_is_a_fresh_header_and_one_view_of_the_data():
    layers = sample_layers(6)
    data = kvb.encode(OPAQUE, 10, 7, layers)
    decoded = kvb.decode(data)
    header, view = kvb.slice_layers(decoded, 12, 14)
    assert isinstance(header, bytes) and len(header) == kvb.header_size(3)
    assert isinstance(view, memoryview) and view.obj is data
    assert view.nbytes == sum(len(k) + len(v) for k, v in layers[2:5])

    sliced = kvb.decode(header + bytes(view))
    assert (sliced.first_layer, sliced.last_layer, sliced.token_count) == (12, 14, 7)
    for layer in range(12, 15):
        assert [bytes(s) for s in sliced.layer(layer)] == [bytes(s) for s in decoded.layer(layer)]
    assert sliced.layer_digests() == decoded.layer_digests()[2:5]
    assert header + bytes(view) == kvb.encode(OPAQUE, 12, 7, layers[2:5])


def test_slice_of_every_layer_reproduces_the_container():
    data = kvb.encode(3, 0, 2, sample_layers(3))
    header, view = kvb.slice_layers(kvb.decode(data), 0, 2)
    assert header + bytes(view) == data


def test_single_layer_slice():
    layers = sample_layers(3)
    decoded = kvb.decode(kvb.encode(OPAQUE, 0, 2, layers))
    parts = kvb.slice_layers(decoded, 1, 1)
    assert b"".join(parts) == kvb.encode(OPAQUE, 1, 2, layers[1:2])


@pytest.mark.parametrize(("first", "last"), [(4, 6), (5, 8), (8, 9), (0, 100), (-1, 5)])
def test_slice_outside_the_container_is_unavailable(first, last):
    decoded = kvb.decode(kvb.encode(OPAQUE, 5, 1, sample_layers(3)))
    with pytest.raises(ProtocolError) as caught:
        kvb.slice_layers(decoded, first, last)
    assert caught.value.problem == "kvsp-layers-unavailable"
    assert caught.value.status == 404


def test_slice_of_an_empty_range_is_a_malformed_request():
    decoded = kvb.decode(kvb.encode(OPAQUE, 5, 1, sample_layers(3)))
    assert problem_of(lambda: kvb.slice_layers(decoded, 7, 6)) == "kvsp-malformed-request"


# -- streaming ---------------------------------------------------------------------------------


def layer_ends(data: bytes) -> list[int]:
    """The offset at which each layer of a valid container is complete."""
    decoded = kvb.decode(data)
    return [
        decoded.data_range(layer, layer)[1]
        for layer in range(decoded.first_layer, decoded.last_layer + 1)
    ]


@st.composite
def containers(draw):
    count = draw(st.integers(1, 6))
    first = draw(st.integers(0, 100))
    if draw(st.booleans()):
        # Codec raw: one section length, a whole multiple of the token count.
        tokens = draw(st.integers(0, 9))
        length = tokens * draw(st.integers(1, 4))
        section = st.binary(min_size=length, max_size=length)
        layers = [(draw(section), draw(section)) for _ in range(count)]
        return kvb.encode(kvb.RAW_CODEC, first, tokens, layers)
    layers = [(draw(st.binary(max_size=40)), draw(st.binary(max_size=40))) for _ in range(count)]
    codec = draw(st.sampled_from([0, 2, 3, OPAQUE]))
    return kvb.encode(codec, first, draw(st.integers(0, 9)), layers)


def chunkings(data_length: int):
    return st.lists(st.integers(1, max(1, data_length)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(data=containers(), sizes=st.data())
def test_stream_reader_hands_out_each_layer_as_soon_as_it_is_complete(data, sizes):
    decoded = kvb.decode(data)
    ends = layer_ends(data)
    cuts = sizes.draw(chunkings(len(data)))
    reader = kvb.ContainerStreamReader(max_size=len(data))
    handed_out = []
    position = 0
    cut = 0
    while position < len(data):
        step = cuts[cut % len(cuts)]
        cut += 1
        chunk = data[position : position + step]
        position += len(chunk)
        completed = reader.feed(chunk)
        handed_out += completed
        assert len(handed_out) == sum(1 for end in ends if end <= position)
    assert [layer.index for layer in handed_out] == list(
        range(decoded.first_layer, decoded.last_layer + 1)
    )
    for layer in handed_out:
        k, v = decoded.layer(layer.index)
        assert bytes(layer.k) == bytes(k) and bytes(layer.v) == bytes(v)
        assert layer.digest == sha256(bytes(k) + bytes(v))
    finished = reader.finish()
    assert bytes(finished.buffer) == data
    assert finished.layer_digests() == decoded.layer_digests()
    assert (finished.codec, finished.token_count) == (decoded.codec, decoded.token_count)


def test_stream_reader_writes_into_one_buffer_of_the_total_size():
    layers = sample_layers(4, 1000)
    data = kvb.encode(OPAQUE, 0, 1, layers)
    reader = kvb.ContainerStreamReader(max_size=len(data))
    handed_out = []
    for start in range(0, len(data), 97):
        handed_out += reader.feed(data[start : start + 97])
    backing = {id(layer.k.obj) for layer in handed_out} | {id(layer.v.obj) for layer in handed_out}
    assert len(backing) == 1
    buffer = handed_out[0].k.obj
    assert isinstance(buffer, bytearray) and len(buffer) == len(data) == reader.size
    assert reader.finish().buffer.obj is buffer


def test_stream_reader_receives_into_its_own_buffer():
    layers = sample_layers(3, 500)
    data = kvb.encode(OPAQUE, 3, 2, layers)
    reader = kvb.ContainerStreamReader(max_size=len(data))
    position = 0
    handed_out = []
    while not reader.done:
        target = reader.get_buffer()
        n = min(len(target), 123)  # what one recv_into would have read
        target[:n] = data[position : position + n]
        position += n
        handed_out += reader.buffer_updated(n)
    assert position == len(data)
    assert len(reader.get_buffer()) == 0
    assert [layer.index for layer in handed_out] == [3, 4, 5]
    assert bytes(reader.finish().buffer) == data
    with pytest.raises(ValueError):
        reader.buffer_updated(1)


def test_stream_reader_checks_expected_digests_as_layers_complete():
    layers = sample_layers(3, 200)
    data = kvb.encode(OPAQUE, 1, 2, layers)
    record = [sha256(b"layer 0")] + [sha256(k + v).hex() for k, v in layers]
    reader = kvb.ContainerStreamReader(
        max_size=len(data), expected_layer_digests=record, expected_first_layer=0
    )
    assert [layer.index for layer in reader.feed(data)] == [1, 2, 3]
    reader.finish()

    tampered = bytearray(data)
    tampered[kvb.decode(data).data_range(2, 2)[0]] ^= 1
    reader = kvb.ContainerStreamReader(
        max_size=len(data), expected_layer_digests=record, expected_first_layer=0
    )
    end_of_layer_1 = kvb.decode(data).data_range(1, 1)[1]
    assert [layer.index for layer in reader.feed(tampered[:end_of_layer_1])] == [1]
    with pytest.raises(ProtocolError) as caught:
        reader.feed(tampered[end_of_layer_1:])
    assert caught.value.problem == "kvsp-digest-mismatch"
    assert "layer 2" in caught.value.detail
    # The error sticks: the reader does not carry on past a bad layer.
    with pytest.raises(ProtocolError):
        reader.finish()
    with pytest.raises(ProtocolError):
        reader.feed(b"")


def test_stream_reader_rejects_an_expected_list_that_does_not_cover_the_container():
    data = kvb.encode(OPAQUE, 1, 2, sample_layers(3))
    reader = kvb.ContainerStreamReader(
        max_size=len(data), expected_layer_digests=[sha256(b"a")] * 2
    )
    assert problem_of(lambda: reader.feed(data)) == "kvsp-digest-mismatch"


def test_stream_reader_without_digests():
    data = kvb.encode(OPAQUE, 1, 2, sample_layers(3))
    reader = kvb.ContainerStreamReader(max_size=len(data), compute_digests=False)
    assert [layer.digest for layer in reader.feed(data)] == [None, None, None]
    assert reader.finish().layer_digests() == kvb.decode(data).layer_digests()


def test_stream_reader_rejects_trailing_octets():
    data = kvb.encode(OPAQUE, 0, 2, sample_layers(2))
    reader = kvb.ContainerStreamReader(max_size=1 << 20)
    reader.feed(data)
    assert reader.finish().size == len(data)
    assert problem_of(lambda: reader.feed(b"\x00")) == "kvsp-invalid-container"


@pytest.mark.parametrize("cut", [0, 5, 20, 40, -1])
def test_stream_reader_finish_reports_truncation(cut):
    data = kvb.encode(OPAQUE, 0, 2, sample_layers(2))
    reader = kvb.ContainerStreamReader(max_size=1 << 20)
    reader.feed(data[:cut])
    assert problem_of(reader.finish) == "kvsp-invalid-container"


def test_stream_reader_limits():
    data = kvb.encode(OPAQUE, 0, 2, sample_layers(2))
    reader = kvb.ContainerStreamReader(max_size=len(data) - 1)
    assert problem_of(lambda: reader.feed(data)) == "kvsp-payload-too-large"
    header_only = kvb.ContainerStreamReader(max_size=kvb.header_size(2) - 1)
    assert problem_of(lambda: header_only.feed(data)) == "kvsp-payload-too-large"
    few_layers = kvb.ContainerStreamReader(max_size=len(data), max_layers=1)
    assert problem_of(lambda: few_layers.feed(data)) == "kvsp-invalid-container"
    with pytest.raises(ValueError):
        kvb.ContainerStreamReader(max_size=19)


def test_empty_sections_complete_with_the_header():
    data = kvb.encode(kvb.RAW_CODEC, 0, 0, [(b"", b"")] * 3)
    reader = kvb.ContainerStreamReader(max_size=len(data))
    assert reader.feed(data[:-1]) == []
    completed = reader.feed(data[-1:])
    assert [layer.digest for layer in completed] == [sha256(b"")] * 3
    assert reader.done


def test_importing_the_container_codec_does_not_import_torch():
    code = "import sys, kvsp.container, kvsp.reprdigest; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stream_reader_rejects_malformed_expected_digests_at_once():
    with pytest.raises(ProtocolError) as caught:
        kvb.ContainerStreamReader(max_size=1 << 10, expected_layer_digests=["00" * 31])
    assert caught.value.problem == "kvsp-invalid-record"
