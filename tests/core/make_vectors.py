"""Write kvsp/vectors/kvsp-test-vectors.json, the test vectors published for other implementers.

    .venv/bin/python tests/core/make_vectors.py

Sections written here: ``compat_ids`` (spec 4.1: descriptor, its JCS text, compat_id),
``scope_ids`` (4.2: scope key, scope_id) and ``block_keys`` (4.2: scope key, compat_id, block
size, tokens, the keys of the complete blocks). Any other top-level section of the file (the
container vectors of 4.3 live in ``containers``) is kept as it is.

Published vectors are a promise to other implementations: regenerating must not change a value
unless the spec changed. Review the diff of the file before committing it, and never regenerate
just to make a failing test pass; tests/core/test_vectors.py checks the file against the
implementation and against an independent rendering of the spec's formulas.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvsp.blockkeys import block_keys, scope_id  # noqa: E402
from kvsp.compat import canonical_form, compat_id  # noqa: E402

VECTORS = ROOT / "kvsp" / "vectors" / "kvsp-test-vectors.json"

DESCRIPTION = (
    "KVSP test vectors. compat_ids: compat_id = SHA-256('KVSP-COMPAT-1' || 0x00 || "
    "JCS(descriptor)), with the JCS text given as 'canonical' (spec 4.1). scope_ids: "
    "scope_id = SHA-256('KVSP-SCOPE-1' || 0x00 || scope_key)[0:16] (spec 4.2). block_keys: "
    "K[i] = HMAC-SHA-256(scope_key, 'KVSP-BLOCK-1' || 0x00 || compat_id || K[i-1] || uint32be "
    "tokens of block i), K[-1] = 32 zero octets, keys only for complete blocks (spec 4.2). "
    "Octets are lowercase hex."
)


def digest_of(text: str) -> str:
    return "sha-256:" + hashlib.sha256(text.encode()).hexdigest()


DESCRIPTORS = [
    (
        "llama-like, rope with theta",
        {
            "model": "example/llama-3-8b-instruct",
            "model_digest": digest_of("kvsp vector: llama-3-8b weights"),
            "tokenizer_digest": digest_of("kvsp vector: llama-3 tokenizer.json"),
            "layers": 32,
            "kv_heads": 8,
            "head_dim": 128,
            "kv_dtype": "bfloat16",
            "positional": "rope;theta=500000",
            "block_tokens": 16,
            "layout": "kvsp-layout-1",
        },
    ),
    (
        "two adapters, rope with every parameter",
        {
            "model": "example/llama-3.1-8b",
            "model_digest": digest_of("kvsp vector: llama-3.1-8b weights"),
            "tokenizer_digest": digest_of("kvsp vector: llama-3.1 tokenizer.json"),
            "adapters": [
                digest_of("kvsp vector: adapter applied first"),
                digest_of("kvsp vector: adapter applied second"),
            ],
            "layers": 32,
            "kv_heads": 8,
            "head_dim": 128,
            "kv_dtype": "float16",
            "positional": "rope;theta=500000,scaling=llama3,factor=8",
            "block_tokens": 32,
            "layout": "kvsp-layout-1",
        },
    ),
    (
        "non-ASCII model name (JCS hashes UTF-8), alibi",
        {
            "model": "exemple/modèle-€-\U0001f600",
            "model_digest": digest_of("kvsp vector: bloom-like weights"),
            "tokenizer_digest": digest_of("kvsp vector: bloom-like tokenizer.json"),
            "layers": 24,
            "kv_heads": 16,
            "head_dim": 64,
            "kv_dtype": "float32",
            "positional": "alibi",
            "block_tokens": 64,
            "layout": "kvsp-layout-1",
        },
    ),
    (
        "fractional rope theta, fp8 cache, one-token blocks",
        {
            "model": "example/tiny",
            "model_digest": digest_of("kvsp vector: tiny weights"),
            "tokenizer_digest": digest_of("kvsp vector: tiny tokenizer.model"),
            "layers": 1,
            "kv_heads": 1,
            "head_dim": 1,
            "kv_dtype": "float8_e4m3fn",
            "positional": "rope;theta=10000.5,scaling=linear,factor=2.5",
            "block_tokens": 1,
            "layout": "kvsp-layout-1",
        },
    ),
    (
        "learned positions, large geometry",
        {
            "model": "example/gpt-2-xl",
            "model_digest": digest_of("kvsp vector: gpt-2-xl weights"),
            "tokenizer_digest": digest_of("kvsp vector: gpt-2 tokenizer.json"),
            "layers": 4294967295,
            "kv_heads": 9007199254740991,
            "head_dim": 4096,
            "kv_dtype": "float8_e5m2",
            "positional": "learned",
            "block_tokens": 4294967295,
            "layout": "kvsp-layout-1",
        },
    ),
]

SCOPE_KEYS = [
    ("32 zero octets", bytes(32)),
    ("32 octets 00..1f", bytes(range(32))),
    ("33 octets", bytes(range(0x40, 0x61))),
    ("64 octets: exactly one SHA-256 block, used as the HMAC key unhashed", bytes(range(64))),
    ("100 octets: longer than a SHA-256 block, hashed first as the HMAC key", bytes(range(100))),
]


def block_key_cases(compat_ids: list[bytes]) -> list[tuple[str, bytes, bytes, int, list[int]]]:
    rng = random.Random(4242)
    return [
        (
            "B=16, 40 tokens: two keys and an 8-token tail without one",
            bytes(range(32)),
            compat_ids[0],
            16,
            list(range(40)),
        ),
        (
            "B=4, tokens at and near 2**32-1, tail of 3",
            bytes(range(32)),
            compat_ids[0],
            4,
            [4294967295, 4294967294, 0, 1, 2147483648, 2147483647, 65535, 65536]
            + [4294967295, 4294967295, 4294967295, 4294967295, 16777216, 256, 4294967293],
        ),
        (
            "B=1: every token is a block",
            bytes(range(32)),
            compat_ids[3],
            1,
            [128000, 9906, 11, 1917, 0],
        ),
        (
            "B=16, 100-octet scope key, 70 pseudo-random tokens",
            bytes(range(100)),
            compat_ids[1],
            16,
            [rng.randrange(2**32) for _ in range(70)],
        ),
        (
            "B=32, 64-octet scope key, two blocks differing only in the last token",
            bytes(range(64)),
            compat_ids[1],
            32,
            [1000 + i for i in range(63)] + [7],
        ),
        (
            "fewer tokens than one block: no keys",
            bytes(32),
            compat_ids[0],
            16,
            list(range(15)),
        ),
        ("no tokens: no keys", bytes(32), compat_ids[0], 16, []),
    ]


def build() -> dict:
    compat_ids = []
    compat_section = []
    for name, descriptor in DESCRIPTORS:
        identifier = compat_id(descriptor)
        compat_ids.append(identifier)
        compat_section.append(
            {
                "name": name,
                "descriptor": descriptor,
                "canonical": canonical_form(descriptor).decode("utf-8"),
                "compat_id": identifier.hex(),
            }
        )
    scope_section = [
        {"name": name, "scope_key": key.hex(), "scope_id": scope_id(key).hex()}
        for name, key in SCOPE_KEYS
    ]
    block_section = [
        {
            "name": name,
            "scope_key": key.hex(),
            "compat_id": compat.hex(),
            "block_tokens": size,
            "tokens": tokens,
            "block_keys": [k.hex() for k in block_keys(key, compat, tokens, size)],
        }
        for name, key, compat, size, tokens in block_key_cases(compat_ids)
    ]
    return {
        "description": DESCRIPTION,
        "compat_ids": compat_section,
        "scope_ids": scope_section,
        "block_keys": block_section,
    }


def main() -> None:
    vectors = json.loads(VECTORS.read_text("utf-8")) if VECTORS.exists() else {}
    vectors.update(build())
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    VECTORS.write_text(json.dumps(vectors, indent=2, ensure_ascii=False) + "\n", "utf-8")
    print(f"wrote {VECTORS.relative_to(ROOT)}: review the diff before committing it")


if __name__ == "__main__":
    main()
