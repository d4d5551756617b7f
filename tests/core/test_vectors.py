"""The published test vectors (kvsp/vectors/kvsp-test-vectors.json) against the implementation.

Each vector is also recomputed longhand from the formulas of spec 4.1 and 4.2, with hashlib and
an HMAC written out from RFC 2104, so the file is not merely consistent with the code that wrote
it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvsp.blockkeys import BlockKeyChain, block_keys, scope_id
from kvsp.compat import canonical_form, compat_id, validate_descriptor
from tests.core import make_vectors

VECTORS_PATH = Path(__file__).resolve().parents[2] / "kvsp" / "vectors" / "kvsp-test-vectors.json"
VECTORS = json.loads(VECTORS_PATH.read_text("utf-8"))


def longhand_hmac_sha256(key: bytes, message: bytes) -> bytes:
    """RFC 2104: H((K' ^ opad) || H((K' ^ ipad) || message)), K' the key padded to 64 octets."""
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key + bytes(64 - len(key))
    inner = hashlib.sha256(bytes(k ^ 0x36 for k in key) + message).digest()
    return hashlib.sha256(bytes(k ^ 0x5C for k in key) + inner).digest()


def longhand_jcs(descriptor: dict) -> bytes:
    # Enough of RFC 8785 for a descriptor: ASCII member names (UTF-16 order is code point order),
    # integers, and strings without control characters, written as UTF-8 without whitespace.
    return json.dumps(descriptor, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def names(section: str) -> list[str]:
    return [vector["name"] for vector in VECTORS[section]]


def test_sections_and_coverage():
    assert {"compat_ids", "scope_ids", "block_keys"} <= set(VECTORS)
    for section in ("compat_ids", "scope_ids", "block_keys"):
        assert len(set(names(section))) == len(VECTORS[section]) >= 5
    descriptors = [vector["descriptor"] for vector in VECTORS["compat_ids"]]
    assert any("adapters" in d for d in descriptors)
    assert any(";" in d["positional"] and "scaling=" in d["positional"] for d in descriptors)
    assert any(not d["model"].isascii() for d in descriptors)
    assert any(len(bytes.fromhex(v["scope_key"])) > 64 for v in VECTORS["scope_ids"])
    cases = VECTORS["block_keys"]
    assert any(len(c["tokens"]) % c["block_tokens"] for c in cases if c["block_keys"])
    assert any(max(c["tokens"], default=0) == 2**32 - 1 for c in cases)
    assert any(c["tokens"] and not c["block_keys"] for c in cases)


@pytest.mark.parametrize("vector", VECTORS["compat_ids"], ids=names("compat_ids"))
def test_compat_id_vector(vector):
    descriptor = vector["descriptor"]
    canonical = vector["canonical"].encode("utf-8")
    assert validate_descriptor(descriptor) == descriptor
    assert canonical_form(descriptor) == canonical == longhand_jcs(descriptor)
    expected = bytes.fromhex(vector["compat_id"])
    assert compat_id(descriptor) == expected
    assert hashlib.sha256(b"KVSP-COMPAT-1" + b"\x00" + canonical).digest() == expected


@pytest.mark.parametrize("vector", VECTORS["scope_ids"], ids=names("scope_ids"))
def test_scope_id_vector(vector):
    key = bytes.fromhex(vector["scope_key"])
    expected = bytes.fromhex(vector["scope_id"])
    assert len(expected) == 16
    assert scope_id(key) == expected
    assert hashlib.sha256(b"KVSP-SCOPE-1" + b"\x00" + key).digest()[:16] == expected


@pytest.mark.parametrize("vector", VECTORS["block_keys"], ids=names("block_keys"))
def test_block_keys_vector(vector):
    key = bytes.fromhex(vector["scope_key"])
    compat = bytes.fromhex(vector["compat_id"])
    size = vector["block_tokens"]
    tokens = vector["tokens"]
    expected = [bytes.fromhex(k) for k in vector["block_keys"]]
    assert len(expected) == len(tokens) // size

    previous, longhand = bytes(32), []
    for i in range(len(tokens) // size):
        block = b"".join(t.to_bytes(4, "big") for t in tokens[i * size : (i + 1) * size])
        previous = longhand_hmac_sha256(key, b"KVSP-BLOCK-1\x00" + compat + previous + block)
        longhand.append(previous)
    assert longhand == expected

    assert block_keys(key, compat, tokens, size) == expected
    chain = BlockKeyChain(key, compat, size)
    assert [k for token in tokens for k in chain.extend([token])] == expected


def test_longhand_hmac_agrees_with_rfc4231_case_2():
    mac = longhand_hmac_sha256(b"Jefe", b"what do ya want for nothing?")
    assert mac.hex() == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"


def test_file_matches_its_generator():
    # A difference means the file was edited by hand or the generator changed without the file
    # being regenerated and reviewed.
    built = make_vectors.build()
    assert {key: VECTORS[key] for key in built} == built
