"""KVSP Registries (spec 11.2) with the first entries of DESIGN.md section 4.

The spec asks IANA for the registries and leaves their first entries to the implementation. This
module holds them: Codecs (11.2.2), Element Types (11.2.3), Positional Encodings and Layouts.
Names are lowercase ASCII; anything not registered here is rejected with a ProtocolError that
names what is registered.

A positional value has the syntax

    positional = variant [ ";" parameter *( "," parameter ) ]
    parameter  = name "=" value

with only the parameters registered for the variant, each at most once and in the order of the
registration. A number is written the way RFC 8785 (3.2.2.3) writes it: the shortest ECMAScript
form, so ``theta=10000`` and never ``theta=10000.0`` or ``theta=1e4``. The positional string is
hashed into the Compatibility ID (spec 4.1), so one configuration must have exactly one spelling;
the fixed order and the canonical numbers give it that.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import rfc8785

from kvsp.problems import ProtocolError

RAW_CODEC = 1
LAYOUT_1 = "kvsp-layout-1"


@dataclass(frozen=True, slots=True)
class Codec:
    """A "KVSP Codecs" entry: how the K and V sections of a container are encoded (4.3)."""

    number: int
    name: str
    layout: str


@dataclass(frozen=True, slots=True)
class ElementType:
    """A "KVSP Element Types" entry; names match torch's dtype attribute names."""

    name: str
    octets: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A layout identifier for the sections of a codec (the descriptor's ``layout``)."""

    name: str
    codec: int
    description: str


@dataclass(frozen=True, slots=True)
class PositionalParameter:
    """A parameter of a positional variant; ``kind`` is "number" or "name".

    ``requires`` names a parameter without which this one has no meaning.
    """

    name: str
    kind: str
    requires: str | None = None


@dataclass(frozen=True, slots=True)
class PositionalVariant:
    """A "KVSP Positional Encodings" entry with its parameters in their registered order."""

    name: str
    parameters: tuple[PositionalParameter, ...] = ()

    def parameter(self, name: str) -> PositionalParameter | None:
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        return None


@dataclass(frozen=True, slots=True)
class Positional:
    """A validated positional value: its variant and parameters as written, in registered order."""

    variant: str
    parameters: tuple[tuple[str, str], ...] = ()

    def get(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.parameters:
            if key == name:
                return value
        return default

    def __str__(self) -> str:
        if not self.parameters:
            return self.variant
        return self.variant + ";" + ",".join(f"{key}={value}" for key, value in self.parameters)


CODECS: Mapping[int, Codec] = MappingProxyType({RAW_CODEC: Codec(RAW_CODEC, "raw", LAYOUT_1)})

ELEMENT_TYPES: Mapping[str, ElementType] = MappingProxyType(
    {
        t.name: t
        for t in (
            ElementType("float32", 4),
            ElementType("float16", 2),
            ElementType("bfloat16", 2),
            ElementType("float8_e4m3fn", 1),
            ElementType("float8_e5m2", 1),
        )
    }
)

POSITIONAL_ENCODINGS: Mapping[str, PositionalVariant] = MappingProxyType(
    {
        v.name: v
        for v in (
            PositionalVariant(
                "rope",
                (
                    PositionalParameter("theta", "number"),
                    PositionalParameter("scaling", "name"),
                    # A factor scales by a method; alone it would not say how.
                    PositionalParameter("factor", "number", requires="scaling"),
                ),
            ),
            PositionalVariant("alibi"),
            PositionalVariant("learned"),
            PositionalVariant("none"),
        )
    }
)

LAYOUTS: Mapping[str, Layout] = MappingProxyType(
    {
        LAYOUT_1: Layout(
            LAYOUT_1,
            RAW_CODEC,
            "K and V sections of Token Count x kv_heads x head_dim elements each, token index "
            "slowest and dimension index fastest, elements in little-endian octet order",
        )
    }
)

# JSON's number grammar (RFC 8259 section 6); the canonical-form check comes after it.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def _registered(names: object) -> str:
    return ", ".join(str(name) for name in names)


def _lookup_named(table: Mapping, name: object, what: str, problem: str, registry: str = ""):
    """The entry of ``table`` named ``name``; ``registry`` names the registry in the refusal."""
    if not isinstance(name, str) or name not in table:
        where = f"is not in {registry}" if registry else "is not registered"
        raise ProtocolError(problem, f"{what} {name!r} {where} (registered: {_registered(table)})")
    return table[name]


def lookup_codec(number: object, problem: str = "kvsp-unsupported-codec") -> Codec:
    """The registered codec with this number."""
    if type(number) is not int or number not in CODECS:
        raise ProtocolError(
            problem, f"codec {number!r} is not registered (registered: {_registered(CODECS)})"
        )
    return CODECS[number]


def lookup_element_type(
    name: object, what: str = "kv_dtype", problem: str = "kvsp-invalid-record"
) -> ElementType:
    """The registered element type with this name."""
    return _lookup_named(ELEMENT_TYPES, name, what, problem, "the KVSP Element Types registry")


def lookup_layout(
    name: object, what: str = "layout", problem: str = "kvsp-invalid-record"
) -> Layout:
    """The registered layout with this name."""
    return _lookup_named(LAYOUTS, name, what, problem)


def parse_positional(
    value: object, what: str = "positional", problem: str = "kvsp-invalid-record"
) -> Positional:
    """Check a positional string against the registered syntax and return its parts."""

    def fail(reason: str) -> ProtocolError:
        return ProtocolError(problem, f"{what} {value!r}: {reason}")

    if not isinstance(value, str):
        raise ProtocolError(problem, f"{what} must be a string")
    name, separator, rest = value.partition(";")
    if name not in POSITIONAL_ENCODINGS:
        raise fail(
            f"{name!r} is not in the KVSP Positional Encodings registry "
            f"(registered: {_registered(POSITIONAL_ENCODINGS)})"
        )
    variant = POSITIONAL_ENCODINGS[name]
    if not separator:
        return Positional(name)
    if not variant.parameters:
        raise fail(f"{name} takes no parameters")
    if not rest:
        raise fail("the parameter list after ';' is empty")

    order = [parameter.name for parameter in variant.parameters]
    parsed: list[tuple[str, str]] = []
    for item in rest.split(","):
        key, equals, text = item.partition("=")
        if not item:
            raise fail("a parameter is empty (a stray ',')")
        if not equals:
            raise fail(f"parameter {item!r} has no '='")
        parameter = variant.parameter(key)
        if parameter is None:
            raise fail(f"{key!r} is not a parameter of {name} (registered: {_registered(order)})")
        if any(key == seen for seen, _ in parsed):
            raise fail(f"parameter {key} is repeated")
        if parsed and order.index(key) < order.index(parsed[-1][0]):
            raise fail(f"parameters must appear in the order {', '.join(order)}")
        if not text:
            raise fail(f"parameter {key} has no value")
        if parameter.kind == "number":
            _check_number(key, text, fail)
        elif _NAME.fullmatch(text) is None:
            raise fail(
                f"{key}={text!r} is not a name (a lowercase ASCII letter, then lowercase letters, "
                "digits, '_' or '-')"
            )
        parsed.append((key, text))

    present = {key for key, _ in parsed}
    for parameter in variant.parameters:
        if parameter.name in present and parameter.requires and parameter.requires not in present:
            raise fail(f"parameter {parameter.name} requires parameter {parameter.requires}")
    return Positional(name, tuple(parsed))


def _check_number(key: str, text: str, fail) -> None:
    if _NUMBER.fullmatch(text) is None:
        raise fail(f"{key}={text!r} is not a number")
    number = float(text)
    if not math.isfinite(number):
        raise fail(f"{key}={text} is out of range for a double")
    if number <= 0:
        raise fail(f"{key} must be positive")
    canonical = rfc8785.dumps(number).decode("ascii")
    if text != canonical:
        raise fail(f"write {key}={canonical} (numbers take their RFC 8785 form)")


def lookup_positional_variant(
    name: object, what: str = "positional", problem: str = "kvsp-invalid-record"
) -> PositionalVariant:
    """The registered positional variant with this name (no parameters)."""
    return _lookup_named(
        POSITIONAL_ENCODINGS, name, what, problem, "the KVSP Positional Encodings registry"
    )


def format_positional(variant: str, **parameters: float | int | str | None) -> str:
    """The one spelling of a positional value; parameters given as None are left out.

    Numbers are written in their RFC 8785 form and parameters in registered order, so the result
    always passes ``parse_positional``.
    """
    registered = lookup_positional_variant(variant)
    unknown = sorted(set(parameters) - {p.name for p in registered.parameters})
    if unknown:
        raise ProtocolError(
            "kvsp-invalid-record",
            f"{variant} has no parameter {', '.join(unknown)} "
            f"(registered: {_registered(p.name for p in registered.parameters)})",
        )
    written = []
    for parameter in registered.parameters:
        value = parameters.get(parameter.name)
        if value is None:
            continue
        if parameter.kind == "name":
            if not isinstance(value, str):
                raise ProtocolError(
                    "kvsp-invalid-record", f"{parameter.name} must be a name, got {value!r}"
                )
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(
                "kvsp-invalid-record", f"{parameter.name} must be a number, got {value!r}"
            )
        else:
            try:
                value = rfc8785.dumps(float(value)).decode("ascii")
            except (OverflowError, rfc8785.CanonicalizationError):
                raise ProtocolError(
                    "kvsp-invalid-record", f"{parameter.name} {value!r} is not a finite number"
                ) from None
        written.append(f"{parameter.name}={value}")
    text = variant + (";" + ",".join(written) if written else "")
    parse_positional(text)
    return text
