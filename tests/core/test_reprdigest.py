"""Repr-Digest (RFC 9530) on block representations (spec 6.7)."""

from __future__ import annotations

import base64
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import container as kvb
from kvsp.problems import ProtocolError
from kvsp.reprdigest import (
    ReprDigestHasher,
    parse_repr_digest,
    repr_digest_header,
    repr_digest_of,
    verify_repr_digest,
)

# RFC 9530 section 3 and appendix B: the representation {"hello": "world"} and its digests.
HELLO = b'{"hello": "world"}'
HELLO_SHA256 = "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"
HELLO_SHA512 = (
    "sha-512=:WZDPaVn/7XgHaAy8pmojAkGWoRx2UFChF41A2svX+TaPm+AbwAgBWnrIiYllu7BNNyealdVLvRwEmTHWXvJw"
    "ew==:"
)
# RFC 9530 appendix B.1 and others: the empty representation.
EMPTY_SHA256 = "sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:"


def test_rfc_9530_examples():
    assert repr_digest_of(HELLO) == HELLO_SHA256
    assert repr_digest_header(hashlib.sha256(HELLO).digest()) == HELLO_SHA256
    assert repr_digest_of(b"") == EMPTY_SHA256
    parsed = parse_repr_digest(HELLO_SHA256 + ", " + HELLO_SHA512)
    assert parsed == {
        "sha-256": hashlib.sha256(HELLO).digest(),
        "sha-512": hashlib.sha512(HELLO).digest(),
    }
    verify_repr_digest(HELLO_SHA256, HELLO)
    verify_repr_digest(HELLO_SHA512 + ", " + HELLO_SHA256, HELLO)
    verify_repr_digest(EMPTY_SHA256, b"")


def test_the_field_is_the_structured_dictionary_form():
    digest = bytes(range(32))
    value = repr_digest_header(digest)
    assert value == "sha-256=:" + base64.standard_b64encode(digest).decode() + ":"
    with pytest.raises(ValueError):
        repr_digest_header(digest[:20])


def test_parts_and_chunks_hash_like_the_whole():
    layers = [(b"k" * 1000, b"v" * 500), (b"K" * 10, b"V")]
    parts = kvb.encode_parts(1, 0, 1, layers)
    whole = b"".join(parts)
    assert repr_digest_of(parts) == repr_digest_of(whole) == repr_digest_of(memoryview(whole))
    hasher = ReprDigestHasher()
    for start in range(0, len(whole), 333):
        hasher.update(whole[start : start + 333])
    assert hasher.size == len(whole)
    assert hasher.header() == repr_digest_of(whole)
    hasher.verify(repr_digest_of(whole))
    verify_repr_digest(repr_digest_of(whole), hasher)
    verify_repr_digest(repr_digest_of(whole), parts)


def test_verify_with_a_digest_computed_elsewhere():
    verify_repr_digest(HELLO_SHA256, sha256=hashlib.sha256(HELLO).digest())
    with pytest.raises(ProtocolError) as caught:
        verify_repr_digest(HELLO_SHA256, sha256=hashlib.sha256(b"other").digest())
    assert caught.value.problem == "kvsp-digest-mismatch"
    with pytest.raises(TypeError):
        verify_repr_digest(HELLO_SHA256)
    with pytest.raises(TypeError):
        verify_repr_digest(HELLO_SHA256, HELLO, sha256=hashlib.sha256(HELLO).digest())
    with pytest.raises(ValueError):
        verify_repr_digest(HELLO_SHA256, sha256=b"short")


def test_a_32_octet_body_is_content_not_a_digest():
    body = hashlib.sha256(b"x").digest()
    verify_repr_digest(repr_digest_of(body), body)
    with pytest.raises(ProtocolError):
        verify_repr_digest(repr_digest_header(body), body)


def test_mismatch():
    with pytest.raises(ProtocolError) as caught:
        verify_repr_digest(HELLO_SHA256, HELLO + b" ")
    assert caught.value.problem == "kvsp-digest-mismatch"
    assert caught.value.status == 422
    hasher = ReprDigestHasher()
    hasher.update(HELLO[:-1])
    with pytest.raises(ProtocolError):
        hasher.verify(HELLO_SHA256)


def test_unknown_algorithms_and_parameters_are_ignored():
    value = "unixsum=30637, md5=:abc=:, sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:;x=1"
    parsed = parse_repr_digest(value)
    assert parsed["sha-256"] == hashlib.sha256(HELLO).digest()
    assert "unixsum" not in parsed
    verify_repr_digest(value, HELLO)
    verify_repr_digest(value.encode("ascii"), HELLO)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "sha-256",
        "sha-256=X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=",
        'sha-256="X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE="',
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=",
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBP:",
        "sha-256=:AAAA:",
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:,",
        "SHA-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=: garbage",
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:, sha-256=?1",
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE\u00e9:",
        "sha-512=:WZDPaVn/7XgHaAy8pmojAkGWoRx2UFChF41A2svX+TaPm+AbwAgBWnrIiYllu7BNNyealdVLvRwEmTHWXvJwew==:",
    ],
)
def test_malformed_fields_and_missing_sha256(value):
    with pytest.raises(ProtocolError) as caught:
        verify_repr_digest(value, HELLO)
    assert caught.value.problem == "kvsp-malformed-request"
    with pytest.raises(ProtocolError) as caught:
        verify_repr_digest(value, HELLO, problem="kvsp-upstream-error")
    assert caught.value.problem == "kvsp-upstream-error"


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.text(max_size=80), st.binary(max_size=80)))
def test_arbitrary_field_values_only_raise_protocol_errors(value):
    try:
        parsed = parse_repr_digest(value)
    except ProtocolError as error:
        assert error.problem == "kvsp-malformed-request"
        return
    assert all(isinstance(digest, bytes) for digest in parsed.values())
    assert len(parsed.get("sha-256", bytes(32))) == 32
