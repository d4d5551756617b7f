"""Numbers written as text: in URLs (``layers=a-b`` and ``codec=n`` of spec 6.7, query
parameters) and in header fields (Content-Length, Last-Event-ID).

Only ASCII decimal digits are numbers here, as RFC 9110 and RFC 3986 write them (``DIGIT``).
Python's ``int()`` also reads the digits of other scripts (``int("४")`` is 4), a sign, spaces
and underscores, and ``str.isdigit()`` admits superscripts that ``int()`` then refuses: a
holder that read ``layers=४-५`` as ``4-5`` would answer what another implementation refuses.
"""

from __future__ import annotations

import re

from kvsp.problems import ProtocolError

_DECIMAL = re.compile(r"-?[0-9]+")  # [0-9] is ASCII, where \d is any script's digit
# More digits than any number this protocol writes (2**64 has 20): the text is refused before
# it is converted, so a megabyte of digits costs nothing.
MAX_DIGITS = 20


def parse_decimal(
    text: object,
    what: str,
    *,
    minimum: int = 0,
    maximum: int = 2**64 - 1,
    problem: str = "kvsp-malformed-request",
) -> int:
    """The integer ``text`` writes in ASCII decimal digits (a leading ``-`` only when
    ``minimum`` is negative), from ``minimum`` to ``maximum``; a ProtocolError of ``problem``
    naming ``what`` otherwise."""
    if (
        not isinstance(text, str)
        or len(text.lstrip("-")) > MAX_DIGITS
        or _DECIMAL.fullmatch(text) is None
        or (text.startswith("-") and minimum >= 0)
    ):
        raise ProtocolError(problem, f"{what} must be an integer in ASCII decimal digits")
    number = int(text)
    if not minimum <= number <= maximum:
        raise ProtocolError(problem, f"{what} must be from {minimum} to {maximum}")
    return number
