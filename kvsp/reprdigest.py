"""The Repr-Digest field of RFC 9530 on block representations (spec section 6.7).

Holders send ``Repr-Digest: sha-256=:<base64>:`` with the SHA-256 of the returned container
(DESIGN.md section 5) and clients verify it. The field is a Dictionary structured field
(RFC 8941) whose keys are hash algorithms and whose values are byte sequences; it is built and
parsed with http-sfv. Algorithms other than sha-256 are ignored, as RFC 9530 allows.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Iterable

import http_sfv

from kvsp.problems import ProtocolError

Buffer = bytes | bytearray | memoryview

ALGORITHM = "sha-256"
SHA256_SIZE = 32


# The field as holders send it, one sha-256 member and nothing else: what http-sfv writes and
# reads for it, written and read directly (a loader reads one per block). Any other form of the
# field goes through http-sfv.
_PLAIN_FIELD = re.compile(r"sha-256=:([A-Za-z0-9+/]{43}=):")


def repr_digest_header(sha256: bytes) -> str:
    """The field value carrying a SHA-256 digest: ``sha-256=:<base64>:``."""
    if len(sha256) != SHA256_SIZE:
        raise ValueError(f"a SHA-256 digest has {SHA256_SIZE} octets, not {len(sha256)}")
    return f"{ALGORITHM}=:{base64.b64encode(sha256).decode('ascii')}:"


def _sha256_of(content: Buffer | Iterable[Buffer]) -> bytes:
    try:
        return hashlib.sha256(content).digest()
    except TypeError:
        pass
    # Not a buffer: a sequence of parts, such as the output of kvsp.container.encode_parts.
    hasher = hashlib.sha256()
    for part in content:
        hasher.update(part)
    return hasher.digest()


def repr_digest_of(content: Buffer | Iterable[Buffer]) -> str:
    """The field value for a representation given whole or as a sequence of parts."""
    return repr_digest_header(_sha256_of(content))


def parse_repr_digest(value: str | bytes, *, problem: str = "kvsp-malformed-request") -> dict:
    """The members of a Repr-Digest field whose values are byte sequences, by algorithm.

    Parameters are ignored, and so are members of other algorithms whose values are not byte
    sequences. Raises ProtocolError (``problem``) when the field is not a Dictionary or its
    sha-256 member is not a 32-octet byte sequence. A client checking a holder's answer passes
    a problem of its own, such as ``kvsp-upstream-error``.
    """
    if isinstance(value, str) and (plain := _PLAIN_FIELD.fullmatch(value)) is not None:
        return {ALGORITHM: base64.b64decode(plain.group(1))}
    try:
        octets = value.encode("ascii") if isinstance(value, str) else bytes(value)
        field = http_sfv.Dictionary()
        field.parse(octets)
    except (ValueError, TypeError, IndexError, UnicodeError) as error:
        raise ProtocolError(problem, "Repr-Digest is not a Dictionary structured field") from error
    digests: dict[str, bytes] = {}
    for algorithm, member in field.items():
        member_value = getattr(member, "value", None)
        if isinstance(member_value, bytes):
            digests[algorithm] = member_value
        elif algorithm == ALGORITHM:
            raise ProtocolError(problem, "the sha-256 member of Repr-Digest is not a byte sequence")
    sha256 = digests.get(ALGORITHM)
    if sha256 is not None and len(sha256) != SHA256_SIZE:
        raise ProtocolError(
            problem, f"the sha-256 member of Repr-Digest has {len(sha256)} octets, not 32"
        )
    return digests


def claimed_sha256(value: str | bytes, *, problem: str = "kvsp-malformed-request") -> bytes:
    """The SHA-256 a Repr-Digest field claims; ProtocolError (``problem``) when the field is
    malformed or has no sha-256 member."""
    sha256 = parse_repr_digest(value, problem=problem).get(ALGORITHM)
    if sha256 is None:
        raise ProtocolError(problem, "Repr-Digest has no sha-256 member")
    return sha256


class ReprDigestHasher:
    """SHA-256 of a representation that arrives in chunks, for a streamed body."""

    __slots__ = ("_hasher", "size")

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self.size = 0

    def update(self, chunk: Buffer) -> None:
        self._hasher.update(chunk)
        self.size += memoryview(chunk).nbytes

    def digest(self) -> bytes:
        return self._hasher.digest()

    def header(self) -> str:
        """The Repr-Digest field value of what was hashed so far."""
        return repr_digest_header(self.digest())

    def verify(self, value: str | bytes, *, problem: str = "kvsp-malformed-request") -> None:
        """Check the field against what was hashed so far; see :func:`verify_repr_digest`."""
        verify_repr_digest(value, sha256=self.digest(), problem=problem)


def verify_repr_digest(
    value: str | bytes,
    content: Buffer | Iterable[Buffer] | ReprDigestHasher | None = None,
    *,
    sha256: bytes | None = None,
    problem: str = "kvsp-malformed-request",
) -> None:
    """Check a Repr-Digest field against a representation or its SHA-256.

    Give either ``content`` (the octets, whole or as parts, or a :class:`ReprDigestHasher` that
    has seen them) or ``sha256`` (the 32-octet digest, computed elsewhere); a digest is never
    passed positionally, since 32 octets of content would look the same. Raises ProtocolError
    ``kvsp-digest-mismatch`` on a mismatch, and ``problem`` when the field is malformed or has
    no sha-256 member.
    """
    if (content is None) == (sha256 is None):
        raise TypeError("give either the content or its sha256, not both or neither")
    if isinstance(content, ReprDigestHasher):
        actual = content.digest()
    elif sha256 is not None:
        if len(sha256) != SHA256_SIZE:
            raise ValueError(f"a SHA-256 digest has {SHA256_SIZE} octets, not {len(sha256)}")
        actual = bytes(sha256)
    else:
        actual = _sha256_of(content)
    expected = claimed_sha256(value, problem=problem)
    if not hmac.compare_digest(actual, expected):
        raise ProtocolError(
            "kvsp-digest-mismatch",
            f"the representation's SHA-256 is {repr_digest_header(actual)}, "
            f"Repr-Digest says {repr_digest_header(expected)}",
        )
