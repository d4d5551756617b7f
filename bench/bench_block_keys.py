"""Block Keys (spec 4.2) against a bare HMAC loop.

For 131,072 tokens at B=16 (8,192 keys): ``kvsp.blockkeys.block_keys`` starting from a Python list
of ints, packing included, against ``hmac.digest(key, msg, "sha256")`` over the same messages
already built. The target is a ratio ours/bare of at most 1.0. Best of several repeats, so a busy
machine shows up as noise rather than as a slower implementation.

    .venv/bin/python bench/bench_block_keys.py [--repeats N]
"""

from __future__ import annotations

import argparse
import hmac
import random
import struct
from pathlib import Path

if __package__ in (None, ""):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import best_of
from kvsp.blockkeys import BLOCK_TAG, ZERO_KEY, block_keys

TOKENS = 131_072
BLOCK_TOKENS = 16


def prebuilt_messages(scope_key: bytes, compat_id: bytes, tokens: list[int]) -> list[bytes]:
    """The HMAC messages of every block, built ahead so the bare loop times only the HMAC."""
    packed = struct.pack(f">{len(tokens)}I", *tokens)
    octets = 4 * BLOCK_TOKENS
    messages, previous = [], ZERO_KEY
    for start in range(0, len(packed) - octets + 1, octets):
        message = BLOCK_TAG + compat_id + previous + packed[start : start + octets]
        previous = hmac.digest(scope_key, message, "sha256")
        messages.append(message)
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    repeats = parser.parse_args().repeats

    rng = random.Random(4231)
    scope_key = rng.randbytes(32)
    compat_id = rng.randbytes(32)
    tokens = [rng.randrange(2**32) for _ in range(TOKENS)]
    messages = prebuilt_messages(scope_key, compat_id, tokens)

    ours_keys = block_keys(scope_key, compat_id, tokens, BLOCK_TOKENS)
    bare_keys = [hmac.digest(scope_key, message, "sha256") for message in messages]
    if ours_keys != bare_keys:
        raise SystemExit("block_keys disagrees with the bare HMAC loop")

    def bare() -> None:
        digest = hmac.digest
        for message in messages:
            digest(scope_key, message, "sha256")

    def ours() -> None:
        block_keys(scope_key, compat_id, tokens, BLOCK_TOKENS)

    bare_s = best_of(repeats, bare)
    ours_s = best_of(repeats, ours)
    print(f"block keys: {TOKENS} tokens, B={BLOCK_TOKENS}, {len(messages)} keys, best of {repeats}")
    print(f"  bare hmac.digest loop (prebuilt messages): {bare_s * 1e3:8.2f} ms")
    print(f"  kvsp block_keys (from list, packing incl.): {ours_s * 1e3:8.2f} ms")
    print(f"  ratio ours/bare: {ours_s / bare_s:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
