"""Writes kvsp/vectors/container-vectors.json: KV Block Containers (spec 4.3) for implementers.

The containers are written field by field with struct and hashed with hashlib, not with
kvsp.container, so the vectors check that module rather than repeat it. Run from the
repository root:

    .venv/bin/python tests/core/make_container_vectors.py
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[2] / "kvsp" / "vectors" / "container-vectors.json"


def container(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: list[tuple[bytes, bytes]],
    *,
    magic: bytes = b"KVB1",
    version: int = 1,
    flags: int = 0,
    layer_count: int | None = None,
    lengths: list[tuple[int, int]] | None = None,
) -> bytes:
    """A container written out longhand; the keywords let invalid ones be written too."""
    out = bytearray(magic)
    out += struct.pack(">B", version)
    out += struct.pack(">B", flags)
    out += struct.pack(">H", codec)
    out += struct.pack(">I", first_layer)
    out += struct.pack(">I", len(layers) if layer_count is None else layer_count)
    out += struct.pack(">I", token_count)
    for k_length, v_length in lengths or [(len(k), len(v)) for k, v in layers]:
        out += struct.pack(">Q", k_length)
        out += struct.pack(">Q", v_length)
    for k, v in layers:
        out += k
        out += v
    return bytes(out)


def float16_section(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}e", *values)


def bfloat16_section(values: list[float]) -> bytes:
    # bfloat16 is the upper half of a float32; these values are exact in both.
    return b"".join(struct.pack("<f", value)[2:] for value in values)


def nest(values: list[float], kv_heads: int, head_dim: int) -> list:
    """Flat values in layout order as [token][head][dimension]."""
    per_token = kv_heads * head_dim
    return [
        [
            values[t * per_token + h * head_dim : t * per_token + (h + 1) * head_dim]
            for h in range(kv_heads)
        ]
        for t in range(len(values) // per_token)
    ]


def valid_vector(
    name: str,
    description: str,
    codec: int,
    first_layer: int,
    token_count: int,
    layers: list[tuple[bytes, bytes]],
    *,
    raw: dict | None = None,
    slices: list[tuple[int, int]] = (),
) -> dict:
    data = container(codec, first_layer, token_count, layers)
    digests = [hashlib.sha256(k + v).digest() for k, v in layers]
    vector = {
        "name": name,
        "description": description,
        "container": data.hex(),
        "version": 1,
        "codec": codec,
        "first_layer": first_layer,
        "layer_count": len(layers),
        "token_count": token_count,
        "header_size": 20 + 16 * len(layers),
        "layers": [
            {"layer": first_layer + i, "k": k.hex(), "v": v.hex(), "digest": digest.hex()}
            for i, ((k, v), digest) in enumerate(zip(layers, digests, strict=True))
        ],
        "layer_digests": [digest.hex() for digest in digests],
        "digest": "sha-256:" + hashlib.sha256(b"".join(digests)).hexdigest(),
        "repr_digest": "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":",
    }
    if raw is not None:
        vector["raw"] = raw
    if slices:
        vector["slices"] = []
        for first, last in slices:
            part = layers[first - first_layer : last - first_layer + 1]
            vector["slices"].append(
                {
                    "layers": [first, last],
                    "container": container(codec, first, token_count, part).hex(),
                }
            )
    return vector


def build_vectors() -> dict:
    valid = []

    # float16, one layer, 2 tokens x 1 kv_head x 2 head_dim.
    k = [1.0, 2.0, -0.5, 65504.0]
    v = [0.25, -2.0, 3.0, 0.0]
    valid.append(
        valid_vector(
            "raw-float16-one-layer",
            "codec raw, float16, 2 tokens x 1 kv_heads x 2 head_dim, one layer",
            1,
            0,
            2,
            [(float16_section(k), float16_section(v))],
            raw={
                "kv_dtype": "float16",
                "kv_heads": 1,
                "head_dim": 2,
                "layers": [{"layer": 0, "k": nest(k, 1, 2), "v": nest(v, 1, 2)}],
            },
        )
    )

    # bfloat16, layers 2..4 of a block, 1 token x 2 kv_heads x 2 head_dim.
    bf_layers = []
    bf_values = []
    for layer in range(2, 5):
        kv = [float(layer), -float(layer), 0.5, 1.5]
        vv = [0.125 * layer, 4.0, -1.0, 2.0]
        bf_values.append({"layer": layer, "k": nest(kv, 2, 2), "v": nest(vv, 2, 2)})
        bf_layers.append((bfloat16_section(kv), bfloat16_section(vv)))
    valid.append(
        valid_vector(
            "raw-bfloat16-layer-range",
            "codec raw, bfloat16, layers 2-4 of a block, 1 token x 2 kv_heads x 2 head_dim; "
            "the slices are the layer ranges a holder returns for layers=3-4 and layers=2-2",
            1,
            2,
            1,
            bf_layers,
            raw={"kv_dtype": "bfloat16", "kv_heads": 2, "head_dim": 2, "layers": bf_values},
            slices=[(3, 4), (2, 2)],
        )
    )

    valid.append(
        valid_vector(
            "no-tokens",
            "token count 0: every section is empty",
            1,
            0,
            0,
            [(b"", b""), (b"", b"")],
        )
    )

    valid.append(
        valid_vector(
            "opaque-codec",
            "a codec other than raw: sections are opaque octets of any length, K and V may differ",
            0x8001,
            7,
            16,
            [(bytes(range(5)), bytes(range(250, 256)) + b"\x00"), (b"\xff", b"")],
        )
    )

    good = [(b"\x01\x02", b"\x03\x04")]
    invalid = [
        ("bad-magic", "magic is not KVB1", container(1, 0, 1, good, magic=b"KVB2")),
        ("version-0", "version is not 1", container(1, 0, 1, good, version=0)),
        ("version-2", "version is not 1", container(1, 0, 1, good, version=2)),
        ("flags-set", "a reserved flag is set", container(1, 0, 1, good, flags=0x80)),
        ("no-layers", "layer count is 0", container(1, 0, 1, [])),
        (
            "layer-index-overflow",
            "first layer + layer count - 1 exceeds 2^32 - 1",
            container(1, 0xFFFFFFFF, 1, good + good),
        ),
        ("short-fixed-header", "fewer than 20 octets", container(1, 0, 1, good)[:19]),
        (
            "short-length-table",
            "the length table is cut short",
            container(1, 0, 1, good, layer_count=2),
        ),
        ("truncated-data", "the last V section is one octet short", container(1, 0, 1, good)[:-1]),
        ("trailing-octet", "one octet after the last layer", container(1, 0, 1, good) + b"\x00"),
        (
            "length-overflow",
            "a K length of 2^64 - 1",
            container(1, 0, 1, good, lengths=[(2**64 - 1, 2)]),
        ),
        # Codec raw's sections each hold Token Count x kv_heads x head_dim elements in layout
        # kvsp-layout-1, of one geometry per container: these length tables no such layout has.
        (
            "raw-k-and-v-differ",
            "codec raw: a layer's V section is shorter than its K section",
            container(1, 0, 1, [(b"\x01\x02", b"\x03")]),
        ),
        (
            "raw-layers-differ",
            "codec raw: the second layer's sections are shorter than the first's",
            container(1, 0, 1, good + [(b"\x05", b"\x06")]),
        ),
        (
            "raw-not-a-multiple-of-the-token-count",
            "codec raw: sections of 3 octets cannot hold 2 tokens",
            container(1, 0, 2, [(b"\x01\x02\x03", b"\x04\x05\x06")]),
        ),
        (
            "raw-no-tokens-in-octets",
            "codec raw: token count 0 with sections that are not empty",
            container(1, 0, 0, good),
        ),
        (
            "raw-tokens-in-no-octets",
            "codec raw: token count 2 with empty sections",
            container(1, 0, 2, [(b"", b"")]),
        ),
    ]
    return {
        "description": (
            "KV Block Containers (KVSP section 4.3). Valid vectors list the header fields, each "
            "layer's K and V octets and layer digest SHA-256(K || V), the replica digest "
            "(SHA-256 of the layer digests concatenated) and the Repr-Digest field of the whole "
            "container (RFC 9530); for codec raw, the element values in layout kvsp-layout-1 as "
            "[token][kv_head][dimension]. Invalid vectors must be rejected, among them codec "
            "raw containers whose length table no kvsp-layout-1 can have (a layer's K and V of "
            "different lengths, layers of different lengths, sections that are not a non-zero "
            "whole multiple of the token count, or not empty for a token count of 0)."
        ),
        "valid": valid,
        "invalid": [
            {
                "name": name,
                "description": description,
                "container": data.hex(),
                "problem": "kvsp-invalid-container",
            }
            for name, description, data in invalid
        ],
    }


def render() -> str:
    return json.dumps(build_vectors(), indent=2) + "\n"


def main() -> int:
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {OUTPUT}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
