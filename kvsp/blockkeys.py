"""Scopes and Block Keys (spec 4.2).

    scope_id = first 16 octets of SHA-256( "KVSP-SCOPE-1" || 0x00 || scope_key )

    K[i] = HMAC-SHA-256( scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id || K[i-1] ||
                         uint32(t[i*B]) || ... || uint32(t[i*B+B-1]) ),  K[-1] = 32 zero octets

Only complete blocks have keys. Block Keys sit on the path of every placement and lookup, so the
HMAC (RFC 2104) is written out over hashlib: the key pads and the constant message prefix are
absorbed into two SHA-256 states once per chain, so each block costs two state copies instead of
re-keying and re-hashing the prefix. All tokens are packed in one call.
"""

from __future__ import annotations

import hashlib
import operator
import sys
from array import array
from collections.abc import Sequence

from kvsp.problems import ProtocolError

SCOPE_KEY_MIN_OCTETS = 32
TOKEN_MAX = 2**32 - 1
BLOCK_TOKENS_MAX = 2**32 - 1
ZERO_KEY = bytes(32)

SCOPE_TAG = b"KVSP-SCOPE-1\x00"
BLOCK_TAG = b"KVSP-BLOCK-1\x00"

_SHA256_BLOCK_OCTETS = 64
_IPAD = bytes(octet ^ 0x36 for octet in range(256))
_OPAD = bytes(octet ^ 0x5C for octet in range(256))
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "little"


def _invalid(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-invalid-record", detail)


def _octets(value: object, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise _invalid(f"{what} must be octets, not {type(value).__name__}")
    return bytes(value)


def _scope_key(value: object) -> bytes:
    key = _octets(value, "the scope key")
    if len(key) < SCOPE_KEY_MIN_OCTETS:
        raise _invalid(
            f"the scope key is {len(key)} octets; spec 4.2 requires at least {SCOPE_KEY_MIN_OCTETS}"
        )
    return key


def _key32(value: object, what: str) -> bytes:
    octets = _octets(value, what)
    if len(octets) != 32:
        raise _invalid(f"{what} must be 32 octets, got {len(octets)}")
    return octets


def _block_tokens(value: object) -> int:
    if type(value) is not int or not 1 <= value <= BLOCK_TOKENS_MAX:
        raise _invalid(f"block_tokens must be an integer in 1..{BLOCK_TOKENS_MAX}, got {value!r}")
    return value


def _hmac_states(key: bytes, prefix: bytes = b"") -> tuple:
    """HMAC-SHA-256 (RFC 2104) split at the key: the inner state after key XOR ipad and
    ``prefix``, the outer state after key XOR opad."""
    if len(key) > _SHA256_BLOCK_OCTETS:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_SHA256_BLOCK_OCTETS, b"\x00")
    inner = hashlib.sha256(key.translate(_IPAD))
    inner.update(prefix)
    return inner, hashlib.sha256(key.translate(_OPAD))


def _mac_chain(inner, outer, previous: bytes, packed: bytes, block_octets: int) -> list[bytes]:
    """For each complete block b of ``packed``: MAC(prefix || previous || b), which becomes the
    next ``previous``. Bytes slices beat memoryview slices and a joined update beats two."""
    keys: list[bytes] = []
    append = keys.append
    copy_inner = inner.copy
    copy_outer = outer.copy
    for start in range(0, len(packed) - block_octets + 1, block_octets):
        state = copy_inner()
        state.update(previous + packed[start : start + block_octets])
        result = copy_outer()
        result.update(state.digest())
        previous = result.digest()
        append(previous)
    return keys


def _bad_token(tokens: Sequence) -> ProtocolError:
    for index, token in enumerate(tokens):
        if type(token) is not bool:
            try:
                if 0 <= operator.index(token) <= TOKEN_MAX:
                    continue
            except TypeError:
                pass
        shown = repr(token)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return _invalid(f"tokens[{index}] is {shown}: token ids are integers in 0..{TOKEN_MAX}")
    return _invalid(f"tokens must be integers in 0..{TOKEN_MAX}")


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """The tokens as uint32 in network byte order, all at once; bad tokens are named by index."""
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise _invalid(f"tokens must be a sequence of integers, not {type(tokens).__name__}")
    if not isinstance(tokens, array):
        if not isinstance(tokens, list | tuple):
            tokens = list(tokens)
        # array() takes bools as 0 and 1; a bool in a token list is a caller's type error.
        if bool in set(map(type, tokens)):
            raise _bad_token(tokens)
    try:
        packed = array(_U32, tokens)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token(tokens) from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def scope_id(scope_key: bytes) -> bytes:
    """The 16-octet Scope ID of a scope key of at least 32 octets."""
    return hashlib.sha256(SCOPE_TAG + _scope_key(scope_key)).digest()[:16]


def scope_id_hex(scope_key: bytes) -> str:
    """The Scope ID as hex16."""
    return scope_id(scope_key).hex()


def block_keys(
    scope_key: bytes, compat_id: bytes, tokens: Sequence[int], block_tokens: int
) -> list[bytes]:
    """K[0], K[1], ... for the complete blocks of ``tokens``; the tail after them gets no key."""
    return BlockKeyChain(scope_key, compat_id, block_tokens).extend(tokens)


def block_keys_hex(
    scope_key: bytes, compat_id: bytes, tokens: Sequence[int], block_tokens: int
) -> list[str]:
    """The Block Keys as hex32."""
    return [key.hex() for key in block_keys(scope_key, compat_id, tokens, block_tokens)]


class BlockKeyChain:
    """The Block Keys of a token stream that arrives in pieces, such as generated tokens.

    ``extend`` returns the keys of the blocks the new tokens complete and keeps the incomplete
    tail for the next call, so any split of a stream yields the keys of the whole stream. To
    continue a chain, pass its last key as ``previous`` and the number of keys so far as ``count``.
    """

    __slots__ = ("_block_octets", "_count", "_inner", "_outer", "_previous", "_tail")

    def __init__(
        self,
        scope_key: bytes,
        compat_id: bytes,
        block_tokens: int,
        *,
        previous: bytes | None = None,
        count: int = 0,
    ):
        key = _scope_key(scope_key)
        compat = _key32(compat_id, "compat_id")
        self._block_octets = 4 * _block_tokens(block_tokens)
        if type(count) is not int or count < 0:
            raise _invalid(f"count must be a non-negative integer, got {count!r}")
        if previous is None:
            if count:
                raise _invalid(f"a chain with {count} keys so far needs its last key as previous")
            previous = ZERO_KEY
        else:
            previous = _key32(previous, "previous")
            if not count and previous != ZERO_KEY:
                raise _invalid("a chain with no keys so far starts from K[-1], 32 zero octets")
        self._inner, self._outer = _hmac_states(key, BLOCK_TAG + compat)
        self._previous = previous
        self._count = count
        self._tail = b""

    @classmethod
    def after(
        cls, scope_key: bytes, compat_id: bytes, block_tokens: int, keys: Sequence[bytes]
    ) -> BlockKeyChain:
        """The chain that continues after ``keys``, the keys of its first blocks (none or
        more)."""
        return cls(
            scope_key,
            compat_id,
            block_tokens,
            previous=keys[-1] if keys else None,
            count=len(keys),
        )

    @property
    def previous(self) -> bytes:
        """The last key of the chain, K[count-1]; 32 zero octets before the first."""
        return self._previous

    @property
    def count(self) -> int:
        """How many keys the chain has so far."""
        return self._count

    @property
    def tail(self) -> tuple[int, ...]:
        """The tokens after the last complete block, which have no key yet."""
        packed = array(_U32, self._tail)
        if _SWAP:
            packed.byteswap()
        return tuple(packed)

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Append tokens; return the keys of the blocks they complete, in order."""
        packed = self._tail + pack_tokens(tokens)
        keys = _mac_chain(self._inner, self._outer, self._previous, packed, self._block_octets)
        self._tail = packed[len(packed) - len(packed) % self._block_octets :]
        if keys:
            self._previous = keys[-1]
            self._count += len(keys)
        return keys
