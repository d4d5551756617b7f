"""Scopes and Block Keys (spec 4.2)."""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.blockkeys import (
    ZERO_KEY,
    BlockKeyChain,
    _hmac_states,
    _mac_chain,
    block_keys,
    block_keys_hex,
    pack_tokens,
    scope_id,
    scope_id_hex,
)
from kvsp.problems import ProtocolError

SCOPE_KEY = bytes(range(32))
COMPAT_ID = hashlib.sha256(b"compat").digest()

# RFC 4231 section 4: HMAC-SHA-256 test cases 1 to 7 (key, data, output; case 5 truncates to
# 128 bits).
RFC_4231 = [
    (
        b"\x0b" * 20,
        b"Hi There",
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
    ),
    (
        b"Jefe",
        b"what do ya want for nothing?",
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
    ),
    (
        b"\xaa" * 20,
        b"\xdd" * 50,
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
    ),
    (
        bytes(range(1, 26)),
        b"\xcd" * 50,
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
    ),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),
    (
        b"\xaa" * 131,
        b"Test Using Larger Than Block-Size Key - Hash Key First",
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
    ),
    (
        b"\xaa" * 131,
        b"This is a test using a larger than block-size key and a larger than block-size data. "
        b"The key needs to be hashed before being used by the HMAC algorithm.",
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
    ),
]


@pytest.mark.parametrize(
    ("key", "data", "expected"), RFC_4231, ids=[f"case{i}" for i in range(1, 8)]
)
def test_rfc4231_through_the_block_key_primitive(key, data, expected):
    # The same prepared states and the same chain loop that compute Block Keys, with an empty
    # prefix and an empty previous key, so the one message is exactly the RFC's data.
    inner, outer = _hmac_states(key)
    (mac,) = _mac_chain(inner, outer, b"", data, len(data))
    assert mac.hex()[: len(expected)] == expected


@pytest.mark.parametrize(("key", "data", "expected"), RFC_4231[:2])
def test_rfc4231_with_the_message_split_between_prefix_previous_and_block(key, data, expected):
    inner, outer = _hmac_states(key, data[:3])
    (mac,) = _mac_chain(inner, outer, data[3:5], data[5:], len(data) - 5)
    assert mac.hex() == expected


def longhand_block_keys(scope_key, compat_id, tokens, block_tokens):
    """Spec 4.2 written out with the standard library's HMAC, one message at a time."""
    keys, previous = [], bytes(32)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens]
        message = b"KVSP-BLOCK-1" + b"\x00" + compat_id + previous
        message += b"".join(token.to_bytes(4, "big") for token in block)
        previous = hmac.new(scope_key, message, hashlib.sha256).digest()
        keys.append(previous)
    return keys


def test_scope_id():
    expected = hashlib.sha256(b"KVSP-SCOPE-1\x00" + SCOPE_KEY).digest()[:16]
    assert scope_id(SCOPE_KEY) == expected
    assert scope_id(bytearray(SCOPE_KEY)) == expected
    assert scope_id(memoryview(SCOPE_KEY)) == expected
    assert scope_id_hex(SCOPE_KEY) == expected.hex()
    assert len(scope_id(bytes(200))) == 16


@pytest.mark.parametrize("length", [0, 1, 16, 31])
def test_short_scope_key_is_rejected(length):
    with pytest.raises(ProtocolError) as caught:
        scope_id(bytes(length))
    assert caught.value.problem == "kvsp-invalid-record"
    assert f"scope key is {length} octets" in caught.value.detail
    assert "at least 32" in caught.value.detail
    with pytest.raises(ProtocolError, match="at least 32"):
        block_keys(bytes(length), COMPAT_ID, list(range(16)), 16)
    with pytest.raises(ProtocolError, match="at least 32"):
        BlockKeyChain(bytes(length), COMPAT_ID, 16)


@pytest.mark.parametrize("key", ["00" * 32, None, list(range(32))])
def test_scope_key_must_be_octets(key):
    with pytest.raises(ProtocolError, match="scope key must be octets"):
        scope_id(key)


def test_block_keys_match_the_spec_written_out():
    tokens = [(i * 2654435761) % 2**32 for i in range(16 * 5 + 7)]
    for scope_key in (SCOPE_KEY, bytes(range(64)), bytes(range(100))):
        expected = longhand_block_keys(scope_key, COMPAT_ID, tokens, 16)
        assert block_keys(scope_key, COMPAT_ID, tokens, 16) == expected
        assert block_keys_hex(scope_key, COMPAT_ID, tokens, 16) == [k.hex() for k in expected]


def test_first_key_written_out_octet_by_octet():
    tokens = [1, 2, 0xFFFFFFFF, 0]
    message = (
        b"KVSP-BLOCK-1\x00"
        + COMPAT_ID
        + ZERO_KEY
        + bytes.fromhex("0000000100000002ffffffff00000000")
    )
    assert block_keys(SCOPE_KEY, COMPAT_ID, tokens, 4) == [
        hmac.digest(SCOPE_KEY, message, "sha256")
    ]


def test_only_complete_blocks_have_keys():
    tokens = list(range(50))
    keys = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 16)
    assert len(keys) == 3
    assert keys == block_keys(SCOPE_KEY, COMPAT_ID, tokens[:48], 16)
    assert block_keys(SCOPE_KEY, COMPAT_ID, tokens[:15], 16) == []
    assert block_keys(SCOPE_KEY, COMPAT_ID, [], 16) == []


def test_a_key_covers_its_whole_prefix():
    tokens = list(range(16 * 6))
    keys = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 16)
    changed = block_keys(SCOPE_KEY, COMPAT_ID, [tokens[0] + 1, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(keys, changed, strict=True))
    # A change in block 3 leaves blocks 0 to 2 alone and changes every later key.
    later = tokens.copy()
    later[3 * 16 + 5] ^= 1
    changed = block_keys(SCOPE_KEY, COMPAT_ID, later, 16)
    assert changed[:3] == keys[:3]
    assert all(a != b for a, b in zip(keys[3:], changed[3:], strict=True))
    # The same block after a different prefix has a different key.
    assert block_keys(SCOPE_KEY, COMPAT_ID, tokens[16:32], 16)[0] != keys[1]


def test_scope_compat_and_block_size_change_every_key():
    tokens = list(range(64))
    keys = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 16)
    assert set(keys).isdisjoint(block_keys(bytes(32), COMPAT_ID, tokens, 16))
    assert set(keys).isdisjoint(block_keys(SCOPE_KEY, bytes(32), tokens, 16))
    assert set(keys).isdisjoint(block_keys(SCOPE_KEY, COMPAT_ID, tokens, 8))


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [
        ([1, 2, -1], "tokens[2] is -1"),
        ([2**32], "tokens[0] is 4294967296"),
        ([0, 2**64], "tokens[1] is 18446744073709551616"),
        ([5, True], "tokens[1] is True"),
        ([False], "tokens[0] is False"),
        ([1, 2.0], "tokens[1] is 2.0"),
        ([1, "2"], "tokens[1] is '2'"),
        ([1, None], "tokens[1] is None"),
        ([1, [2]], "tokens[1] is [2]"),
        ([10**60], "tokens[0] is 1000000000000000000000000000000000000..."),
    ],
)
def test_out_of_range_and_non_integer_tokens_are_rejected(tokens, shown):
    with pytest.raises(ProtocolError) as caught:
        block_keys(SCOPE_KEY, COMPAT_ID, tokens, 16)
    assert caught.value.problem == "kvsp-invalid-record"
    assert caught.value.detail == f"{shown}: token ids are integers in 0..4294967295"


@pytest.mark.parametrize("tokens", [b"\x01\x02", "12", bytearray(4)])
def test_tokens_must_not_be_text_or_octets(tokens):
    with pytest.raises(ProtocolError, match="tokens must be a sequence of integers"):
        block_keys(SCOPE_KEY, COMPAT_ID, tokens, 1)


def test_token_limits_are_inclusive():
    tokens = [0, 2**32 - 1]
    assert pack_tokens(tokens) == b"\x00\x00\x00\x00\xff\xff\xff\xff"
    assert block_keys(SCOPE_KEY, COMPAT_ID, tokens, 2) == longhand_block_keys(
        SCOPE_KEY, COMPAT_ID, tokens, 2
    )


def test_tokens_from_any_integer_sequence():
    tokens = list(range(100, 164))
    expected = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 16)
    assert block_keys(SCOPE_KEY, COMPAT_ID, tuple(tokens), 16) == expected
    assert block_keys(SCOPE_KEY, COMPAT_ID, range(100, 164), 16) == expected
    assert block_keys(SCOPE_KEY, COMPAT_ID, array("q", tokens), 16) == expected
    assert block_keys(SCOPE_KEY, COMPAT_ID, iter(tokens), 16) == expected
    with pytest.raises(ProtocolError, match=r"tokens\[0\] is -1"):
        block_keys(SCOPE_KEY, COMPAT_ID, array("q", [-1]), 16)


@pytest.mark.parametrize("block_tokens", [0, -16, 2**32, True, 16.0, "16", None])
def test_block_tokens_must_be_a_positive_integer(block_tokens):
    with pytest.raises(ProtocolError, match="block_tokens must be an integer in 1..4294967295"):
        block_keys(SCOPE_KEY, COMPAT_ID, [1], block_tokens)


@pytest.mark.parametrize("compat", [bytes(31), bytes(33), COMPAT_ID.hex(), None])
def test_compat_id_must_be_32_octets(compat):
    with pytest.raises(ProtocolError, match="compat_id must be"):
        block_keys(SCOPE_KEY, compat, [1], 1)


# -- the incremental chain -----------------------------------------------------------------------


def test_chain_keeps_the_tail():
    chain = BlockKeyChain(SCOPE_KEY, COMPAT_ID, 4)
    assert chain.previous == ZERO_KEY and chain.count == 0 and chain.tail == ()
    assert chain.extend([1, 2, 3]) == []
    assert chain.tail == (1, 2, 3)
    first = chain.extend([4, 5])
    assert first == block_keys(SCOPE_KEY, COMPAT_ID, [1, 2, 3, 4], 4)
    assert chain.tail == (5,) and chain.count == 1 and chain.previous == first[0]
    more = chain.extend([6, 7, 8, 9, 10, 11, 12, 2**32 - 1])
    assert first + more == block_keys(SCOPE_KEY, COMPAT_ID, [*range(1, 13), 2**32 - 1], 4)
    assert chain.tail == (2**32 - 1,) and chain.count == 3


def test_chain_continues_from_a_known_key():
    tokens = list(range(40))
    keys = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 8)
    chain = BlockKeyChain(SCOPE_KEY, COMPAT_ID, 8, previous=keys[1], count=2)
    assert chain.extend(tokens[16:]) == keys[2:]
    assert chain.count == 5


def test_chain_after_keys_continues_them():
    tokens = list(range(40))
    keys = block_keys(SCOPE_KEY, COMPAT_ID, tokens, 8)
    chain = BlockKeyChain.after(SCOPE_KEY, COMPAT_ID, 8, keys[:2])
    assert chain.extend(tokens[16:]) == keys[2:]
    assert BlockKeyChain.after(SCOPE_KEY, COMPAT_ID, 8, []).extend(tokens) == keys


def test_chain_rejects_a_bad_extension_and_keeps_its_state():
    chain = BlockKeyChain(SCOPE_KEY, COMPAT_ID, 4)
    chain.extend([1, 2])
    with pytest.raises(ProtocolError, match=r"tokens\[1\] is -5"):
        chain.extend([3, -5])
    assert chain.tail == (1, 2) and chain.count == 0
    assert chain.extend([3, 4]) == block_keys(SCOPE_KEY, COMPAT_ID, [1, 2, 3, 4], 4)


@pytest.mark.parametrize(
    ("previous", "count", "reason"),
    [
        (None, 3, "needs its last key as previous"),
        (b"\x01" * 32, 0, "starts from K[-1], 32 zero octets"),
        (b"\x01" * 31, 1, "previous must be 32 octets"),
        (b"\x01" * 32, -1, "count must be a non-negative integer"),
        (b"\x01" * 32, True, "count must be a non-negative integer"),
    ],
)
def test_chain_start_must_be_consistent(previous, count, reason):
    with pytest.raises(ProtocolError, match=re.escape(reason)):
        BlockKeyChain(SCOPE_KEY, COMPAT_ID, 4, previous=previous, count=count)


def test_chain_may_start_from_explicit_zero_key():
    chain = BlockKeyChain(SCOPE_KEY, COMPAT_ID, 2, previous=ZERO_KEY, count=0)
    assert chain.extend([7, 8]) == block_keys(SCOPE_KEY, COMPAT_ID, [7, 8], 2)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    block_tokens=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_every_split_of_the_stream_gives_the_one_shot_keys(tokens, block_tokens, cuts):
    expected = block_keys(SCOPE_KEY, COMPAT_ID, tokens, block_tokens)
    assert expected == longhand_block_keys(SCOPE_KEY, COMPAT_ID, tokens, block_tokens)
    bounds = [0, *sorted(min(cut, len(tokens)) for cut in cuts), len(tokens)]
    chain = BlockKeyChain(SCOPE_KEY, COMPAT_ID, block_tokens)
    keys = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        keys += chain.extend(tokens[start:end])
    assert keys == expected
    assert chain.count == len(expected)
    assert chain.tail == tuple(tokens[len(expected) * block_tokens :])


def test_pack_tokens_is_network_byte_order():
    tokens = [0x01020304, 0xA0B0C0D0, 7]
    assert pack_tokens(tokens) == struct.pack(">3I", *tokens)
