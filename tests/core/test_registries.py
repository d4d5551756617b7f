"""KVSP Registries (spec 11.2; DESIGN.md section 4): entries, lookups, the positional syntax."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.problems import ProtocolError
from kvsp.registries import (
    CODECS,
    ELEMENT_TYPES,
    LAYOUTS,
    POSITIONAL_ENCODINGS,
    RAW_CODEC,
    Positional,
    format_positional,
    lookup_codec,
    lookup_element_type,
    lookup_layout,
    lookup_positional_variant,
    parse_positional,
)


def test_first_entries_are_those_of_the_design():
    assert {number: (c.name, c.layout) for number, c in CODECS.items()} == {
        1: ("raw", "kvsp-layout-1")
    }
    assert {name: t.octets for name, t in ELEMENT_TYPES.items()} == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
    }
    assert set(POSITIONAL_ENCODINGS) == {"rope", "alibi", "learned", "none"}
    assert [p.name for p in POSITIONAL_ENCODINGS["rope"].parameters] == [
        "theta",
        "scaling",
        "factor",
    ]
    for name in ("alibi", "learned", "none"):
        assert POSITIONAL_ENCODINGS[name].parameters == ()
    assert set(LAYOUTS) == {"kvsp-layout-1"}
    assert LAYOUTS["kvsp-layout-1"].codec == RAW_CODEC


def test_registered_names_are_lowercase_ascii():
    names = [*ELEMENT_TYPES, *POSITIONAL_ENCODINGS, *LAYOUTS, *(c.name for c in CODECS.values())]
    for name in names:
        assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", name), name


def test_registries_are_read_only():
    with pytest.raises(TypeError):
        ELEMENT_TYPES["float64"] = ELEMENT_TYPES["float32"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        ELEMENT_TYPES["float32"].octets = 8  # type: ignore[misc]


def test_lookups_return_entries():
    assert lookup_codec(1).name == "raw"
    assert lookup_element_type("bfloat16").octets == 2
    assert lookup_layout("kvsp-layout-1").codec == 1
    assert lookup_positional_variant("alibi").parameters == ()


@pytest.mark.parametrize("number", [0, 2, 65535, True, "1", 1.0, None])
def test_unregistered_codec(number):
    with pytest.raises(ProtocolError) as caught:
        lookup_codec(number)
    assert caught.value.problem == "kvsp-unsupported-codec"
    assert "registered: 1" in caught.value.detail


@pytest.mark.parametrize("name", ["float64", "FLOAT16", "bf16", "", None, 2, "float16 "])
def test_unregistered_element_type(name):
    with pytest.raises(ProtocolError) as caught:
        lookup_element_type(name)
    assert caught.value.problem == "kvsp-invalid-record"
    assert "kv_dtype" in caught.value.detail and "float32" in caught.value.detail


@pytest.mark.parametrize("name", ["kvsp-layout-2", "KVSP-LAYOUT-1", "", None])
def test_unregistered_layout(name):
    with pytest.raises(ProtocolError, match="layout .* is not registered"):
        lookup_layout(name)


def test_lookup_problem_can_be_chosen():
    with pytest.raises(ProtocolError) as caught:
        lookup_codec(7, problem="kvsp-invalid-container")
    assert caught.value.problem == "kvsp-invalid-container"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("rope", Positional("rope")),
        ("alibi", Positional("alibi")),
        ("learned", Positional("learned")),
        ("none", Positional("none")),
        ("rope;theta=10000", Positional("rope", (("theta", "10000"),))),
        ("rope;theta=0.5", Positional("rope", (("theta", "0.5"),))),
        ("rope;theta=1e+21", Positional("rope", (("theta", "1e+21"),))),
        ("rope;scaling=yarn", Positional("rope", (("scaling", "yarn"),))),
        (
            "rope;theta=500000,scaling=llama3,factor=8",
            Positional("rope", (("theta", "500000"), ("scaling", "llama3"), ("factor", "8"))),
        ),
        (
            "rope;scaling=linear,factor=2.5",
            Positional("rope", (("scaling", "linear"), ("factor", "2.5"))),
        ),
    ],
)
def test_valid_positional(text, parsed):
    assert parse_positional(text) == parsed
    assert str(parsed) == text


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "not in the KVSP Positional Encodings registry"),
        ("RoPE", "not in the KVSP Positional Encodings registry"),
        ("xpos", "not in the KVSP Positional Encodings registry"),
        ("rope ", "not in the KVSP Positional Encodings registry"),
        ("alibi;theta=1", "alibi takes no parameters"),
        ("none;", "none takes no parameters"),
        ("rope;", "the parameter list after ';' is empty"),
        ("rope;theta=1,", "a parameter is empty"),
        ("rope;,theta=1", "a parameter is empty"),
        ("rope;theta", "has no '='"),
        ("rope;theta=", "parameter theta has no value"),
        ("rope;base=10000", "'base' is not a parameter of rope"),
        ("rope; theta=1", "' theta' is not a parameter of rope"),
        ("rope;theta=1,theta=1", "parameter theta is repeated"),
        ("rope;scaling=linear,theta=1", "in the order theta, scaling, factor"),
        ("rope;factor=2", "factor requires parameter scaling"),
        ("rope;theta=1e4", "write theta=10000"),
        ("rope;theta=10000.0", "write theta=10000"),
        ("rope;theta=010000", "is not a number"),
        ("rope;theta=+1", "is not a number"),
        ("rope;theta=.5", "is not a number"),
        ("rope;theta=1.", "is not a number"),
        ("rope;theta=0x10", "is not a number"),
        ("rope;theta=NaN", "is not a number"),
        ("rope;theta=inf", "is not a number"),
        ("rope;theta=1_000", "is not a number"),
        ("rope;theta=\u0661", "is not a number"),
        ("rope;theta=1e400", "out of range"),
        ("rope;theta=0", "theta must be positive"),
        ("rope;theta=-1", "theta must be positive"),
        ("rope;scaling=Linear", "is not a name"),
        ("rope;scaling=2x", "is not a name"),
        ("rope;scaling=lin ear", "is not a name"),
    ],
)
def test_invalid_positional(text, reason):
    with pytest.raises(ProtocolError) as caught:
        parse_positional(text)
    assert caught.value.problem == "kvsp-invalid-record"
    assert reason in caught.value.detail
    assert caught.value.detail.startswith(f"positional {text!r}")


@pytest.mark.parametrize("value", [None, 1, b"rope", ["rope"]])
def test_positional_must_be_a_string(value):
    with pytest.raises(ProtocolError, match="positional must be a string"):
        parse_positional(value)


def test_format_positional_writes_the_one_spelling():
    assert format_positional("rope", theta=10000.0) == "rope;theta=10000"
    assert format_positional("rope", theta=500000) == "rope;theta=500000"
    assert (
        format_positional("rope", factor=8.0, scaling="llama3", theta=5e5)
        == "rope;theta=500000,scaling=llama3,factor=8"
    )
    assert format_positional("rope", theta=1e-7) == "rope;theta=1e-7"
    assert format_positional("rope", theta=None, scaling=None) == "rope"
    assert format_positional("alibi") == "alibi"


@pytest.mark.parametrize(
    ("variant", "parameters", "reason"),
    [
        ("xpos", {}, "not in the KVSP Positional Encodings registry"),
        ("rope", {"base": 1}, "rope has no parameter base"),
        ("alibi", {"theta": 1}, "alibi has no parameter theta"),
        ("rope", {"theta": "10000"}, "theta must be a number"),
        ("rope", {"theta": True}, "theta must be a number"),
        ("rope", {"theta": float("nan")}, "not a finite number"),
        ("rope", {"theta": 10**400}, "not a finite number"),
        ("rope", {"theta": -5}, "theta must be positive"),
        ("rope", {"scaling": 3}, "scaling must be a name"),
        ("rope", {"scaling": "Linear"}, "is not a name"),
        ("rope", {"factor": 2.0}, "factor requires parameter scaling"),
    ],
)
def test_format_positional_rejects(variant, parameters, reason):
    with pytest.raises(ProtocolError) as caught:
        format_positional(variant, **parameters)
    assert reason in caught.value.detail


@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_every_positive_double_has_exactly_one_accepted_spelling(theta):
    text = format_positional("rope", theta=theta)
    written = parse_positional(text).get("theta")
    assert float(written) == theta
    spellings = {repr(theta), f"{theta:.17g}", f"{theta:.17e}", f"{theta:.20f}".rstrip("0")}
    for other in {s for s in spellings if float(s) == theta} - {written}:
        with pytest.raises(ProtocolError):
            parse_positional(f"rope;theta={other}")
