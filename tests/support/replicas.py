"""Replica Records as holders publish them, for the tests and the benchmarks (no Django here:
a benchmark builds its records before any role process starts)."""

from __future__ import annotations

import hashlib

HOLDER_A = "http://holder-a.test/kvsp/"
HOLDER_B = "http://holder-b.test/kvsp/"


def replica_json(
    scope_id: str,
    compat_id: str,
    block_key: str,
    holder: str = HOLDER_A,
    *,
    layers: int = 4,
    size: int = 4096,
    ttl_ms: int = 60_000,
    residency: list | None = None,
    seed: bytes = b"",
) -> dict:
    """A valid Replica Record whose digest is the SHA-256 of its layer digests."""
    layer_digests = [
        hashlib.sha256(seed + block_key.encode() + bytes([layer])).digest()
        for layer in range(layers)
    ]
    return {
        "block_key": block_key,
        "compat_id": compat_id,
        "scope_id": scope_id,
        "holder": holder,
        "codec": 1,
        "size": size,
        "digest": "sha-256:" + hashlib.sha256(b"".join(layer_digests)).hexdigest(),
        "layer_digests": [d.hex() for d in layer_digests],
        "residency": residency or [{"tier": "host", "layers": [0, layers - 1]}],
        "ttl_ms": ttl_ms,
    }
