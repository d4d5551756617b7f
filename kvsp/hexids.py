"""The hex16 and hex32 forms of identifiers (spec 4.2, 4.4; DESIGN.md section 5).

hex16 and hex32 are 16 and 32 octets written as 32 and 64 lowercase hex digits.
"""

from __future__ import annotations

import re
import uuid

from kvsp.problems import ProtocolError

_HEX = {16: re.compile(r"[0-9a-f]{32}"), 32: re.compile(r"[0-9a-f]{64}")}


def is_hex(value: object, octets: int) -> bool:
    return isinstance(value, str) and _HEX[octets].fullmatch(value) is not None


def parse_hex(value: object, octets: int, what: str, problem: str = "kvsp-invalid-record") -> bytes:
    """The octets of a hex16 or hex32 value; a clear ProtocolError otherwise."""
    if not is_hex(value, octets):
        raise ProtocolError(
            problem, f"{what} must be hex{octets}: {octets * 2} lowercase hex digits"
        )
    return bytes.fromhex(value)


def parse_hex16(value: object, what: str, problem: str = "kvsp-invalid-record") -> bytes:
    return parse_hex(value, 16, what, problem)


def parse_hex32(value: object, what: str, problem: str = "kvsp-invalid-record") -> bytes:
    return parse_hex(value, 32, what, problem)


def parse_uuid(value: object, what: str, problem: str = "kvsp-invalid-record") -> uuid.UUID:
    """A UUID (RFC 9562) in its canonical hyphenated form, case-insensitive."""
    if isinstance(value, str) and len(value) == 36:
        try:
            parsed = uuid.UUID(value)
        except ValueError:
            pass
        else:
            if str(parsed) == value.lower():
                return parsed
    raise ProtocolError(problem, f"{what} must be a UUID in the form 8-4-4-4-12 hex digits")
