"""Numbers written in URLs and header fields are ASCII decimal digits, and nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.numerals import MAX_DIGITS, parse_decimal
from kvsp.problems import ProtocolError


@pytest.mark.parametrize(
    ("text", "number"), [("0", 0), ("7", 7), ("0042", 42), ("18446744073709551615", 2**64 - 1)]
)
def test_ascii_digits_are_read(text, number):
    assert parse_decimal(text, "n") == number


@pytest.mark.parametrize(
    "text",
    [
        "४",  # Devanagari four: int() reads it as 4
        "٣",  # Arabic-Indic three
        "４",  # fullwidth four
        "²",  # superscript two: str.isdigit() says yes, int() says no
        "+5",
        " 5",
        "5 ",
        "5_000",
        "0x10",
        "1e3",
        "",
        "-",
        "-1",  # no sign where the smallest number is 0
        "1" * (MAX_DIGITS + 1),
        "18446744073709551616",  # past the maximum
    ],
)
def test_anything_else_is_a_malformed_request(text):
    with pytest.raises(ProtocolError) as refused:
        parse_decimal(text, "layers")
    assert refused.value.problem == "kvsp-malformed-request"
    assert refused.value.detail.startswith("layers must be")


def test_bounds_and_a_sign_where_a_negative_number_is_allowed():
    assert parse_decimal("-1", "after", minimum=-1) == -1
    for text in ("-2", "--1", "−1"):  # the last is U+2212 MINUS SIGN
        with pytest.raises(ProtocolError):
            parse_decimal(text, "after", minimum=-1)
    with pytest.raises(ProtocolError, match="codec must be from 0 to 65535"):
        parse_decimal("65536", "codec", maximum=2**16 - 1)
    with pytest.raises(ProtocolError, match="the upstream"):
        parse_decimal("x", "the upstream", problem="kvsp-upstream-error")


@given(st.text(max_size=30))
def test_whatever_is_accepted_is_ascii_digits_and_reads_back(text):
    try:
        number = parse_decimal(text, "n", minimum=-(2**64))
    except ProtocolError:
        return
    assert text.lstrip("-").isascii() and text.lstrip("-").isdigit()
    assert int(text) == number
