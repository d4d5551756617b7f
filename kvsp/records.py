"""The JSON records of KVSP: spec 4.1 (Compatibility Descriptor), 4.4 (Replica Record, Instance
Status Record, Session Checkpoint), 6.2 (lookup request), 6.4 (placement request), 6.5 (prefetch
directive and its state), 6.6 (leases), 6.8 (resume request) and 6.9 (shard map and reshard
messages), in the shapes DESIGN.md section 3 fixes where the spec leaves them open; the node's
generate request; and the delegated token messages of DESIGN.md section 6.

Every record is defined once, as a frozen ``msgspec`` struct (``WireRecord``): the bounds of
each member are in its type and checked, in C, as a record is decoded; the rules that span
members or need more than a bound are in ``__post_init__``, checked also when code builds a
record. The OpenAPI description is generated from the same types (``common.openapi``).
``from_json(obj)`` turns a decoded JSON value into a record: it bounds every array by ``Limits``
before it does per-entry work, ignores unknown members (4.4: "Unknown members MUST be
ignored"; the descriptor of 4.1 refuses them, for the reason ``CompatibilityDescriptor`` gives),
and raises ``InvalidRecord``, a ``ProtocolError`` of type ``kvsp-invalid-record``
whose detail starts with the path of the offending member, e.g. ``residency[1].layers: overlaps
residency[0].layers``. ``record.to_json()`` is the record as a JSON-ready dict, and
``from_json(r.to_json()) == r``.

Choices made where the spec is silent:

- Integers are JSON integers (``3.0`` is not taken for ``3``) no larger than 2**53 - 1, the range
  every JSON implementation holds exactly (RFC 7493); tokens and layer indexes are uint32, codecs
  uint16, sampler seeds uint64. Other numbers must be finite and no larger than 2**53 - 1.
- Identifiers stay the lowercase strings of the wire (``*_bytes`` properties give the octets);
  UUIDs are accepted in either case and kept in lowercase.
- An optional member that is null is treated as absent.
- URLs are compared as strings. A base URL (an instance, a holder reached over HTTP) is an
  absolute ``http``/``https`` URL with a lowercase scheme, a host, a path ending in "/", and no
  user information, query or fragment. A holder may instead be a ``moqt`` URI (4.4) with the
  same restrictions except the trailing "/". Every URL is made of the characters RFC 3986
  allows (unreserved, reserved, and ``%`` with two hex digits): ``"``, ``<``, ``>``, ``\\``,
  ``^``, ``{``, ``|``, ``}`` and backquotes are refused, not stored for a page to escape later.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hmac
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, NoReturn, Self, TypeVar
from urllib.parse import SplitResult, urlsplit

import msgspec
import msgspec.inspect
import msgspec.structs

from kvsp.container import DIGEST_PREFIX, joined_replica_digest
from kvsp.hexids import is_hex, parse_uuid
from kvsp.problems import ProtocolError
from kvsp.registries import (
    ELEMENT_TYPES,
    LAYOUTS,
    lookup_element_type,
    lookup_layout,
    parse_positional,
)
from kvsp.states import (
    FIRST_SESSION_EPOCH,
    REQUESTABLE_INSTANCE_STATES,
    SETTABLE_INSTANCE_STATES,
    DirectiveState,
    InstanceState,
    ReshardPhase,
)

MAX_SAFE_INTEGER = 2**53 - 1
UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_URL_LENGTH = 2048
MAX_TEXT_LENGTH = 1024
# A router's reference of a placement, kept with the directive it leads to.
MAX_REQUEST_REF_LENGTH = 400

# Tiers this implementation stores blocks in (DESIGN.md section 1). The spec does not register
# tier names, so a holder may report another lowercase name (a new kind of memory); placement
# only ever reads a tier's "read_mbit_per_s", never its name.
KNOWN_TIERS = ("device", "host", "disk")
_TIER_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")

# Layer orders of a prefetch directive (6.5 defines only this one).
LAYER_ORDERS = ("ascending",)

# Lease ids and shard map ids are used as one path segment (leases/{id}, shardmaps/{map}), so
# they are limited to URL-unreserved characters.
_SEGMENT = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
# What RFC 3986 lets a URI contain: unreserved and reserved characters, and percent-encodings.
_URI_CHARACTERS = re.compile(r"(?:[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a decoder accepts, checked before any per-entry work.

    The defaults admit a context of two million tokens in blocks of 16 and a model of 4096
    layers; a deployment lowers them to what it serves.
    """

    max_layers: int = 4096  # layer_digests, residency entries
    max_block_keys: int = 131072  # lookup, checkpoint prompt_blocks, directive blocks, leases
    max_tokens: int = 2_097_152  # placement tokens, checkpoint prompt_tail and generated
    max_sources: int = 64  # sources of one directive block
    max_links: int = 1024  # links of one status record
    max_targets: int = 1024  # lookup targets
    max_compat_ids: int = 256  # compat_ids of one status record
    max_shards: int = 4096  # shards of one shard map
    max_ranges: int = 8192  # each of retain, fetch and release of a reshard plan
    max_params: int = 64  # JSON values inside sampler.params, all levels together
    max_depth: int = 8  # nesting of sampler.params


DEFAULT_LIMITS = Limits()


# --- Errors -----------------------------------------------------------------------------------

Path = tuple[str | int, ...]


def render_path(path: Path) -> str:
    out = ""
    for segment in path:
        if isinstance(segment, int):
            out += f"[{segment}]"
        else:
            out += f".{segment}" if out else segment
    return out


class InvalidRecord(ProtocolError):
    """A record that breaks a rule; ``path`` names the member, ``message`` the rule.

    A message about two members (an overlap, a duplicate) names the other one as ``related``,
    written where the message has ``{related}``, so that it gets the same prefix when the error
    travels out of a nested record.
    """

    def __init__(self, path: Path, message: str, related: Path | None = None):
        self.path = path
        self.message = message
        self.related = related
        text = message if related is None else message.format(related=render_path(related))
        detail = f"{render_path(path)}: {text}" if path else text
        super().__init__("kvsp-invalid-record", detail)

    def within(self, *prefix: str | int) -> InvalidRecord:
        related = None if self.related is None else tuple(prefix) + self.related
        return InvalidRecord(tuple(prefix) + self.path, self.message, related)


def _fail(path: Path, message: str, related: Path | None = None) -> NoReturn:
    raise InvalidRecord(path, message, related)


# --- Checks on values (used by the records' __post_init__) ------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: object, path: Path, lo: int = 0, hi: int = MAX_SAFE_INTEGER) -> None:
    if not _is_int(value):
        _fail(path, "must be an integer")
    if not lo <= value <= hi:
        _fail(path, f"must be an integer from {lo} to {hi}")


def _check_number(
    value: object,
    path: Path,
    *,
    positive: bool = False,
    lo: float | None = None,
    hi: float | None = None,
) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(path, "must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        _fail(path, "must be a finite number")
    if abs(value) > MAX_SAFE_INTEGER:
        _fail(path, f"must be at most {MAX_SAFE_INTEGER} in magnitude")
    if positive and not value > 0:
        _fail(path, "must be greater than 0")
    if lo is not None and value < lo:
        _fail(path, f"must be at least {lo}")
    if hi is not None and value > hi:
        _fail(path, f"must be at most {hi}")


def _check_bool(value: object, path: Path) -> None:
    if not isinstance(value, bool):
        _fail(path, "must be true or false")


def _check_text(value: object, path: Path, max_length: int = MAX_TEXT_LENGTH) -> None:
    if not isinstance(value, str):
        _fail(path, "must be a string")
    if len(value) > max_length:
        _fail(path, f"must be at most {max_length} characters")


def _check_hex(value: object, path: Path, octets: int) -> None:
    if not is_hex(value, octets):
        _fail(path, f"must be hex{octets}: {octets * 2} lowercase hex digits")


def _check_digest(value: object, path: Path) -> None:
    if not (isinstance(value, str) and value.startswith(DIGEST_PREFIX) and is_hex(value[8:], 32)):
        _fail(path, 'must be "sha-256:" followed by 64 lowercase hex digits')


def _check_uuid(value: object, path: Path) -> None:
    try:
        parsed = parse_uuid(value, render_path(path))
    except ProtocolError:
        _fail(path, "must be a UUID: 8-4-4-4-12 hex digits")
    if str(parsed) != value:
        _fail(path, "must be a UUID in lowercase")


def _check_segment(value: object, path: Path) -> None:
    if not (isinstance(value, str) and _SEGMENT.fullmatch(value)):
        _fail(path, "must be 1 to 128 characters from A-Z a-z 0-9 . _ ~ -")


def _check_choice(value: object, path: Path, choices: tuple[str, ...] | frozenset[str]) -> None:
    # The isinstance test comes first: an array or object is not hashable.
    if not (isinstance(value, str) and value in choices):
        _fail(path, "must be one of " + ", ".join(sorted(f'"{c}"' for c in choices)))


def _check_tuple(value: object, path: Path, *, non_empty: bool = False) -> None:
    if not isinstance(value, tuple):
        _fail(path, "must be an array")
    if non_empty and not value:
        _fail(path, "must not be empty")


def _check_each(values: tuple, path: Path, check: Callable[[object, Path], None]) -> None:
    for index, value in enumerate(values):
        check(value, (*path, index))


def _check_hex_list(values: object, path: Path, octets: int, *, non_empty: bool = False) -> None:
    _check_tuple(values, path, non_empty=non_empty)
    # Lookups carry thousands of keys: check them all at once in C, and only look at each one
    # when something is wrong, to say which.
    try:
        joined = "".join(values)
        same_width = not values or set(map(len, values)) == {2 * octets}
        # fromhex also takes upper case and spaces; what hex() gives back is neither.
        if same_width and bytes.fromhex(joined).hex() == joined:
            return
    except (TypeError, ValueError):
        pass
    for index, value in enumerate(values):
        _check_hex(value, (*path, index), octets)


def _check_unique(values: tuple, path: Path, key: Callable[[Any], Any], member: str = "") -> None:
    seen: dict[Any, int] = {}
    for index, value in enumerate(values):
        identity = key(value)
        if identity in seen:
            if member:
                _fail(
                    (*path, index, member), "duplicates {related}", (*path, seen[identity], member)
                )
            _fail((*path, index), "duplicates {related}", (*path, seen[identity]))
        seen[identity] = index


def _check_uint32_list(values: object, path: Path) -> None:
    _check_tuple(values, path)
    # One pass over a long token list in the common case; the slow pass only names the culprit.
    if not values or (
        set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= UINT32_MAX
    ):
        return
    for index, value in enumerate(values):
        _check_int(value, (*path, index), 0, UINT32_MAX)


def _url_parts(value: object, path: Path) -> SplitResult:
    if not isinstance(value, str):
        _fail(path, "must be a URL string")
    if len(value) > MAX_URL_LENGTH:
        _fail(path, f"must be at most {MAX_URL_LENGTH} characters")
    if not value.isascii() or any(ch <= " " or ch == "\x7f" for ch in value):
        _fail(path, "must be ASCII without spaces or control characters")
    if _URI_CHARACTERS.fullmatch(value) is None:
        _fail(path, "must have only the characters RFC 3986 allows (unreserved, reserved, %HH)")
    if "?" in value or "#" in value:
        _fail(path, "must not have a query or a fragment")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsing the port is what raises for a bad one
    except ValueError:
        _fail(path, "is not a valid URL")
    if not value.startswith(parts.scheme + "://"):
        _fail(path, "must be an absolute URL with a lowercase scheme")
    if "@" in parts.netloc:
        _fail(path, "must not carry user information")
    if not parts.hostname:
        _fail(path, "must name a host")
    return parts


def _check_base_url(value: object, path: Path) -> None:
    parts = _url_parts(value, path)
    if parts.scheme not in ("http", "https"):
        _fail(path, "must be an http or https URL")
    if not parts.path.endswith("/"):
        _fail(path, 'must end with "/"')


def _check_holder(value: object, path: Path) -> None:
    if not isinstance(value, str):
        _fail(path, "must be a URL string")
    broken = _broken_holder_rule(value)
    if broken is not None:
        _fail(path, broken)


@functools.lru_cache(maxsize=1024)
def _broken_holder_rule(value: str) -> str | None:
    """The rule a holder URL breaks, or None. Cached: a holder publishes thousands of records
    naming the same few URLs, and parsing a URL costs more than the rest of a record."""
    try:
        parts = _url_parts(value, ())
        if parts.scheme == "moqt":
            return None
        if parts.scheme not in ("http", "https"):
            _fail((), "must be an http, https or moqt URL")
        if not parts.path.endswith("/"):
            _fail((), 'must end with "/"')
    except InvalidRecord as error:
        return error.message
    return None


def base_url_rule_broken(value: object) -> str | None:
    """The rule of a base URL (an instance, an HTTP holder) that ``value`` breaks, or None: for
    URLs given outside a record (an instance's registration, settings)."""
    try:
        _check_base_url(value, ())
    except InvalidRecord as error:
        return error.message
    return None


def holder_url_rule_broken(value: object) -> str | None:
    """The rule of a holder URL (a base URL, or a ``moqt`` URI) that ``value`` breaks, or None:
    for URLs given outside a record (the holders a principal publishes for)."""
    if not isinstance(value, str):
        return "must be a URL string"
    return _broken_holder_rule(value)


def is_moqt_holder(holder: str) -> bool:
    return holder.startswith("moqt://")


def parse_moqt_namespace(value: object) -> tuple[bytes, ...] | None:
    """The five Track Namespace Fields of a ``moqt_namespace`` member (4.4), or None.

    The member is unpadded base64url of the fields, each preceded by its length in one octet.
    Only the canonical encoding is accepted, so that one namespace has one spelling.
    """
    if not isinstance(value, str) or len(value) > MAX_URL_LENGTH or len(value) % 4 == 1:
        return None
    if not _BASE64URL.fullmatch(value):
        return None
    raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != value:
        return None
    fields = []
    offset = 0
    while offset < len(raw):
        length = raw[offset]
        offset += 1
        if offset + length > len(raw):
            return None
        fields.append(raw[offset : offset + length])
        offset += length
    return tuple(fields) if len(fields) == 5 else None


def encode_moqt_namespace(fields: tuple[bytes, ...]) -> str:
    """The ``moqt_namespace`` member for five Track Namespace Fields of at most 255 octets."""
    if len(fields) != 5 or any(len(f) > 255 for f in fields):
        raise ValueError("a namespace is five fields of at most 255 octets")
    raw = b"".join(bytes([len(f)]) + f for f in fields)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _check_layer_range(value: object, path: Path) -> None:
    if not (isinstance(value, tuple) and len(value) == 2):
        _fail(path, "must be [first, last]")
    _check_int(value[0], (*path, 0), 0, UINT32_MAX)
    _check_int(value[1], (*path, 1), 0, UINT32_MAX)
    if value[0] > value[1]:
        _fail(path, "the first layer must not be after the last (ranges are inclusive)")


def _check_token_range(value: object, path: Path) -> None:
    if not (isinstance(value, tuple) and len(value) == 2):
        _fail(path, "must be [start, end]")
    _check_int(value[0], (*path, 0))
    _check_int(value[1], (*path, 1))
    if value[0] >= value[1]:
        _fail(path, "start must be less than end (ranges are half-open)")


def _first_overlap(
    ranges: list[tuple[int, int, Path]], *, inclusive: bool
) -> tuple[Path, Path] | None:
    """Two overlapping ranges of ``ranges`` (listed in document order), or None.

    The answer is (path of the later range, path of the earlier one), so that the error names
    the range that broke the rule. Sorting by start makes this O(n log n) for hostile sizes.
    """
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    furthest = None  # the index of the range reaching furthest among those before
    for i in order:
        start, end, _ = ranges[i]
        if furthest is not None:
            reach = ranges[furthest][1]
            if (start <= reach) if inclusive else (start < reach):
                later, earlier = max(i, furthest), min(i, furthest)
                return ranges[later][2], ranges[earlier][2]
            if end <= reach:
                continue
        furthest = i
    return None


# --- A frozen JSON object (sampler parameters) ------------------------------------------------


class JsonObject(Mapping[str, Any]):
    """An immutable, hashable JSON object: nested objects are JsonObjects, arrays are tuples."""

    __slots__ = ("_members",)

    def __init__(self, members: Mapping[str, Any] | None = None):
        self._members = dict(members or {})

    def __getitem__(self, key: str) -> Any:
        return self._members[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __hash__(self) -> int:
        return hash(frozenset(self._members.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._members == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"JsonObject({self._members!r})"

    def to_json(self) -> dict[str, Any]:
        return _thaw(self)


def freeze_json(value: object, path: Path, budget: list[int], depth: int, max_depth: int) -> Any:
    """A JSON value made immutable; ``budget[0]`` counts the values that may still be taken."""
    budget[0] -= 1
    if budget[0] < 0:
        _fail(path, "has too many values")
    if value is None or isinstance(value, bool | str):
        if isinstance(value, str):
            _check_text(value, path)
        return value
    if isinstance(value, int | float):
        _check_number(value, path)
        return value
    if depth >= max_depth:
        _fail(path, f"is nested deeper than {max_depth} levels")
    if isinstance(value, list | tuple):
        return tuple(
            freeze_json(item, (*path, i), budget, depth + 1, max_depth)
            for i, item in enumerate(value)
        )
    if isinstance(value, Mapping):
        members = {}
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(path, "member names must be strings")
            _check_text(key, path)
            members[key] = freeze_json(item, (*path, key), budget, depth + 1, max_depth)
        return JsonObject(members)
    _fail(path, "must be a JSON value")


def _thaw(value: Any) -> Any:
    if isinstance(value, JsonObject):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


# --- Records as msgspec structs ----------------------------------------------------------------
#
# A record defined as a frozen ``msgspec.Struct`` is decoded and bounded in C: each member's
# type carries its bounds and, as its ``description``, the rule a value that breaks them is told
# (``_rule``); the struct's ``__post_init__`` checks what spans members, on decoding and when code
# builds the record. ``_decode`` turns msgspec's errors into ``InvalidRecord`` with the member's
# path and rule.


def _rule(description: str, schema: dict[str, Any] | None = None, **bounds: Any) -> msgspec.Meta:
    """A member's bounds, checked by msgspec, and the rule a value that breaks them is told.

    ``schema`` adds to the member's JSON Schema what ``__post_init__`` checks instead of msgspec
    (a hex pattern is checked for every identifier of a record in one pass, faster than a
    regular expression per member), so that the OpenAPI description states it too.
    """
    return msgspec.Meta(description=description, extra_json_schema=schema, **bounds)


class _BrokenRule(InvalidRecord, ValueError):
    """A rule broken inside a struct's ``__post_init__``. It is a ValueError so that msgspec,
    decoding a nested struct, adds the path of that struct to it (``_decode`` joins the two)."""


def _broken(path: Path, message: str, related: Path | None = None) -> NoReturn:
    raise _BrokenRule(path, message, related)


_ERROR_PATH = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _error_path(where: str) -> Path:
    return tuple(name if name else int(index) for name, index in _ERROR_PATH.findall(where))


def _field_type(info: Any, segment: str | int) -> Any:
    info = _unwrapped(info)
    if isinstance(info, msgspec.inspect.StructType):
        return next((f.type for f in info.fields if f.encode_name == segment), None)
    if isinstance(info, msgspec.inspect.TupleType) and isinstance(segment, int):
        return info.item_types[segment] if segment < len(info.item_types) else None
    return getattr(info, "item_type", None)


def _unwrapped(info: Any) -> Any:
    """The type inside a nullable union and its metadata."""
    while True:
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        elif isinstance(info, msgspec.inspect.UnionType):
            others = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(others) != 1:
                return info
            info = others[0]
        else:
            return info


def _description(info: Any) -> str | None:
    while info is not None:
        if isinstance(info, msgspec.inspect.Metadata):
            described = (info.extra_json_schema or {}).get("description")
            if described:
                return described
            info = info.type
        elif isinstance(info, msgspec.inspect.UnionType):
            found = (_description(t) for t in info.types)
            return next((d for d in found if d), None)
        else:
            return None
    return None


@functools.cache
def _type_info(cls: type) -> Any:
    return msgspec.inspect.type_info(cls)


def _invalid(cls: type, error: msgspec.ValidationError) -> InvalidRecord:
    message, at, where = str(error).rpartition(" - at `$")
    if not at:
        message, where = str(error), ""
    path = _error_path(where.rstrip("`"))
    cause = error.__cause__
    if isinstance(cause, InvalidRecord):
        return InvalidRecord(*_joined(path, cause))
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        return InvalidRecord((*path, missing.group(1)), "required member is missing")
    if message.startswith("Expected `object`"):
        return InvalidRecord(path, "must be a JSON object")
    info: Any = _type_info(cls)
    for segment in path:
        info = _field_type(info, segment) if info is not None else None
    return InvalidRecord(path, _description(info) or message[:1].lower() + message[1:])


def _joined(prefix: Path, error: InvalidRecord) -> tuple:
    related = None if error.related is None else (*prefix, *error.related)
    return (*prefix, *error.path), error.message, related


def _check_array_bounds(obj: dict, bounded: Mapping[str, int], path: Path) -> None:
    for name, most in bounded.items():
        value = obj.get(name)
        if isinstance(value, list | tuple) and len(value) > most:
            _fail((*path, name), f"has {len(value)} entries; at most {most} are accepted")


def _decode(cls: type[S], obj: object, bounded: Mapping[str, int] | None = None) -> S:
    """``obj``, a decoded JSON value, as a record of ``cls``; each member named in ``bounded``
    is an array of at most that many entries, checked before any entry is looked at."""
    if not isinstance(obj, dict):
        raise InvalidRecord((), f"a {cls.NAME} must be a JSON object")
    _check_array_bounds(obj, bounded or {}, ())
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as error:  # __post_init__'s _BrokenRule is its cause
        raise _invalid(cls, error) from None


S = TypeVar("S", bound=msgspec.Struct)


class WireRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the records defined as msgspec structs share: ``from_json`` bounds the arrays named
    by ``_array_bounds`` and decodes; ``to_json`` is the struct's members in their order, an
    optional member at its default (absent, or null) left out. A record whose JSON differs
    from that (a member always present, even null) says so in its own ``to_json``."""

    NAME: ClassVar[str] = "record"

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _decode(cls, obj, cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        """The most entries each array member may have, checked before any entry is."""
        return {}

    def to_json(self) -> dict[str, Any]:
        members = msgspec.to_builtins(self, enc_hook=_thawed)
        return _with_lists(members, _list_members(type(self)))


def _thawed(value: object) -> object:
    if isinstance(value, JsonObject):
        return value.to_json()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


# msgspec.to_builtins keeps a record's tuples; a JSON-ready dict has lists, as JSON decodes to.
_Lister = Callable[[Any], Any]


def _with_lists(members: dict[str, Any], listers: tuple[tuple[str, _Lister], ...]) -> dict:
    for name, lister in listers:
        value = members.get(name)
        if value is not None:
            members[name] = lister(value)
    return members


@functools.cache
def _list_members(cls: type) -> tuple[tuple[str, _Lister], ...]:
    """(JSON name, what makes lists of its tuples) for each member of ``cls`` holding some."""
    found = ((f.encode_name, _lister(f.type)) for f in _type_info(cls).fields)
    return tuple((name, lister) for name, lister in found if lister is not None)


def _lister(info: Any) -> _Lister | None:
    info = _unwrapped(info)
    if isinstance(info, msgspec.inspect.StructType):
        inner = _list_members(info.cls)
        return (lambda members: _with_lists(members, inner)) if inner else None
    if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.TupleType):
        items = getattr(info, "item_types", None) or (info.item_type,)
        item = _lister(items[0]) if all(t == items[0] for t in items) else None
        if item is None:
            return list
        return lambda values: [item(value) for value in values]
    return None


_HEX16_RULE = "must be hex16: 32 lowercase hex digits"
_HEX32_RULE = "must be hex32: 64 lowercase hex digits"
_DIGEST_RULE = 'must be "sha-256:" followed by 64 lowercase hex digits'
_NAMESPACE_RULE = "must be unpadded base64url of five length-prefixed namespace fields"
Hex16 = Annotated[
    str, _rule(_HEX16_RULE, {"pattern": "^[0-9a-f]{32}$"}, min_length=32, max_length=32)
]
Hex32 = Annotated[
    str, _rule(_HEX32_RULE, {"pattern": "^[0-9a-f]{64}$"}, min_length=64, max_length=64)
]
Digest = Annotated[
    str,
    _rule(
        _DIGEST_RULE, {"pattern": f"^{DIGEST_PREFIX}[0-9a-f]{{64}}$"}, min_length=72, max_length=72
    ),
]
LayerIndex = Annotated[
    int, _rule(f"must be an integer from 0 to {UINT32_MAX}", ge=0, le=UINT32_MAX)
]
# URLs are checked in __post_init__ (``holder_url_rule_broken``, ``base_url_rule_broken``); the
# schema states the part of their rules a pattern can.
HolderUrl = Annotated[
    str,
    _rule(
        "must be a URL string",
        {"maxLength": MAX_URL_LENGTH, "pattern": "^(https?://[^/]+/.*/|moqt://[^/]+.*)$"},
    ),
]
BaseUrl = Annotated[
    str,
    _rule("must be a URL string", {"maxLength": MAX_URL_LENGTH, "pattern": "^https?://[^/]+/.*/$"}),
]
_RATE_RULE = f"must be a number greater than 0 and at most {MAX_SAFE_INTEGER}"
Rate = (
    Annotated[int, _rule(_RATE_RULE, gt=0, le=MAX_SAFE_INTEGER)]
    | Annotated[float, _rule(_RATE_RULE, gt=0, le=MAX_SAFE_INTEGER)]
)


PositiveInt = Annotated[
    int, _rule(f"must be an integer from 1 to {MAX_SAFE_INTEGER}", ge=1, le=MAX_SAFE_INTEGER)
]
Count = Annotated[
    int, _rule(f"must be an integer from 0 to {MAX_SAFE_INTEGER}", ge=0, le=MAX_SAFE_INTEGER)
]
Text = Annotated[str, _rule("must be a string", {"maxLength": MAX_TEXT_LENGTH})]
Uuid = Annotated[str, _rule("must be a UUID: 8-4-4-4-12 hex digits", {"format": "uuid"})]
Segment = Annotated[
    str,
    _rule("must be 1 to 128 characters from A-Z a-z 0-9 . _ ~ -", pattern=f"^{_SEGMENT.pattern}$"),
]


def _choice_rule(choices: Iterable[str]) -> str:
    return "must be one of " + ", ".join(sorted(f'"{c}"' for c in choices))


def _rules(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    """A struct's ``__post_init__`` written with the ``_check_*`` functions: a rule they find
    broken is raised as ``_BrokenRule``, so that msgspec adds the path of a nested struct."""

    @functools.wraps(post_init)
    def checked(self: Any) -> None:
        try:
            post_init(self)
        except _BrokenRule:
            raise
        except InvalidRecord as error:
            raise _BrokenRule(error.path, error.message, error.related) from None

    return checked


def _lowered(obj: object, member: str) -> object:
    """``obj`` with ``member`` in lowercase when it is a string (a UUID is taken in either
    case and kept in lowercase)."""
    if isinstance(obj, dict) and isinstance(obj.get(member), str):
        return {**obj, member: obj[member].lower()}
    return obj


def _lower_hex(value: str) -> bytes | None:
    """The octets of ``value`` when it is lowercase hex, else None."""
    try:
        octets = bytes.fromhex(value)
    except ValueError:
        return None
    # fromhex also takes upper case and spaces; what hex() gives back is neither.
    return octets if octets.hex() == value else None


# --- Compatibility Descriptor (4.1) ---------------------------------------------------------

# Layers and block tokens are 32-bit counts in the KV Block Container (4.3).
_Count32 = Annotated[int, _rule(f"must be an integer from 1 to {UINT32_MAX}", ge=1, le=UINT32_MAX)]


class CompatibilityDescriptor(WireRecord, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a KV cache was computed under (4.1): its JCS form is what the Compatibility ID
    hashes, so it is validated against every MUST of 4.1 first.

    Unknown members are refused. The "ignore unknown members" rule of spec 4.4 covers the records
    of 4.4, not the descriptor of 4.1, and neither way of ignoring one is safe here: dropping it
    before hashing would give one id to caches that differ in whatever the member describes
    (breaking the MUST NOT of 4.1), and hashing it unread would let a misspelled optional member
    (``"adapter"``) pass silently while changing the id. A later revision that adds a member adds
    a field here. For the same reason a null member is refused rather than taken as absent:
    ``adapters`` is absent when no adapter is applied, never null or empty.
    """

    NAME: ClassVar[str] = "Compatibility Descriptor"

    model: Annotated[str, _rule("must be a non-empty string", min_length=1)]
    model_digest: Digest
    tokenizer_digest: Digest
    adapters: (
        Annotated[
            tuple[Digest, ...],
            _rule(
                "must be absent when no adapter is applied, else a non-empty array of adapter "
                "digests",
                min_length=1,
            ),
        ]
        | msgspec.UnsetType
    ) = msgspec.UNSET
    layers: _Count32
    kv_heads: PositiveInt
    head_dim: PositiveInt
    kv_dtype: Annotated[
        str,
        _rule("must name an entry of the KVSP Element Types registry", {"enum": [*ELEMENT_TYPES]}),
    ]
    positional: Annotated[
        str, _rule("must be a string: a registered positional encoding, parameters after ';'")
    ]
    block_tokens: _Count32
    layout: Annotated[str, _rule("must name a registered layout", {"enum": [*LAYOUTS]})]

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        """The descriptor ``obj`` holds; the members it lacks, and those 4.1 does not define, are
        named all at once (msgspec names only the first)."""
        if isinstance(obj, dict):
            fields = msgspec.structs.fields(cls)
            unknown = [key for key in obj if key not in {f.encode_name for f in fields}]
            if unknown:
                listed = ", ".join(repr(key) for key in sorted(unknown, key=repr))
                _fail((), f"the descriptor has members that spec 4.1 does not define: {listed}")
            missing = [f.encode_name for f in fields if f.required and f.encode_name not in obj]
            if missing:
                _fail((), f"the descriptor lacks required members: {', '.join(missing)}")
        return _decode(cls, obj)

    @_rules
    def __post_init__(self) -> None:
        try:
            self.model.encode("utf-8")
        except UnicodeEncodeError:
            _fail(("model",), "must be valid Unicode (it holds a lone surrogate)")
        _check_digest(self.model_digest, ("model_digest",))
        _check_digest(self.tokenizer_digest, ("tokenizer_digest",))
        if self.adapters is not msgspec.UNSET:
            _check_each(self.adapters, ("adapters",), _check_digest)
        # The registries' own refusals name the member, the value and what is registered.
        lookup_element_type(self.kv_dtype)
        parse_positional(self.positional)
        lookup_layout(self.layout)


# --- Replica Record (4.4) ---------------------------------------------------------------------


class ResidencyEntry(WireRecord, frozen=True):
    """Which layers of a replica reside in one tier, and how fast the holder reads that tier."""

    NAME: ClassVar[str] = "residency entry"

    tier: Annotated[
        str,
        _rule(
            "must be a lowercase tier name such as " + ", ".join(KNOWN_TIERS),
            pattern=f"^{_TIER_NAME.pattern}$",
        ),
    ]
    layers: Annotated[tuple[LayerIndex, LayerIndex], _rule("must be [first, last]")]  # inclusive
    read_mbit_per_s: Rate | None = None

    def __post_init__(self) -> None:
        if self.layers[0] > self.layers[1]:
            _broken(
                ("layers",), "the first layer must not be after the last (ranges are inclusive)"
            )

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0] + 1


@functools.cache
def _batch_body_type(member: str) -> type:
    return msgspec.defstruct(
        "ReplicaBatchBody", [("records", list[ReplicaRecord])], rename={"records": member}
    )


class ReplicaRecord(WireRecord, frozen=True, kw_only=True):
    """A replica of one block at one holder (4.4, 6.1).

    ``residency`` is required and non-empty: a holder always knows where it keeps a replica, and
    placement prices the tiers. It need not cover every layer (a holder may keep only some layers
    of a block). When ``layer_digests`` is present, every residency range lies inside it and the
    digests reproduce ``digest``; a record that breaks either rule is refused, because a client
    would refuse every layer it served. ``moqt_namespace`` is required with a ``moqt`` holder and
    refused with any other.
    """

    NAME: ClassVar[str] = "Replica Record"

    block_key: Hex32
    compat_id: Hex32
    scope_id: Hex16
    holder: HolderUrl
    codec: Annotated[int, _rule(f"must be an integer from 1 to {UINT16_MAX}", ge=1, le=UINT16_MAX)]
    size: Annotated[
        int, _rule(f"must be an integer from 0 to {MAX_SAFE_INTEGER}", ge=0, le=MAX_SAFE_INTEGER)
    ]
    digest: Digest
    layer_digests: (
        Annotated[tuple[Hex32, ...], _rule("must be a non-empty array of hex32", min_length=1)]
        | None
    ) = None
    residency: Annotated[
        tuple[ResidencyEntry, ...],
        _rule("must be a non-empty array of residency entries", min_length=1),
    ]
    ttl_ms: Annotated[
        int, _rule(f"must be an integer from 1 to {MAX_SAFE_INTEGER}", ge=1, le=MAX_SAFE_INTEGER)
    ]
    moqt_namespace: Annotated[str, _rule(_NAMESPACE_RULE)] | None = None

    def __post_init__(self) -> None:
        # Every identifier and digest is converted at once, in C: the lengths are the types'
        # bounds, and each member is looked at on its own only to name the one that is wrong.
        layers_hex = "".join(self.layer_digests) if self.layer_digests is not None else ""
        octets = _lower_hex(
            self.block_key + self.compat_id + self.scope_id + self.digest[8:] + layers_hex
        )
        if octets is None:
            self._name_broken_hex()
        if not self.digest.startswith(DIGEST_PREFIX):
            _broken(("digest",), _DIGEST_RULE)
        holder_rule = holder_url_rule_broken(self.holder)
        if holder_rule is not None:
            _broken(("holder",), holder_rule)
        if self.layer_digests is not None:
            joined = octets[112:]
            if not hmac.compare_digest(joined_replica_digest(joined), self.digest):
                _broken(("layer_digests",), "do not reproduce digest (4.3)")
        if not isinstance(self.residency, tuple):
            _broken(("residency",), "must be an array")
        for index, entry in enumerate(self.residency):
            if not isinstance(entry, ResidencyEntry):
                _broken(("residency", index), "must be a residency entry")
        if len(self.residency) > 1:
            overlap = _first_overlap(
                [
                    (e.layers[0], e.layers[1], ("residency", i))
                    for i, e in enumerate(self.residency)
                ],
                inclusive=True,
            )
            if overlap:
                _broken((*overlap[0], "layers"), "overlaps {related}", (*overlap[1], "layers"))
        if self.layer_digests is not None:
            count = len(self.layer_digests)
            for index, entry in enumerate(self.residency):
                if entry.layers[1] >= count:
                    _broken(
                        ("residency", index, "layers"),
                        f"layer {entry.layers[1]} is beyond the {count} layers of layer_digests",
                    )
        if is_moqt_holder(self.holder):
            if self.moqt_namespace is None:
                _broken(("moqt_namespace",), "is required when the holder is a moqt URI")
            if parse_moqt_namespace(self.moqt_namespace) is None:
                _broken(("moqt_namespace",), _NAMESPACE_RULE)
        elif self.moqt_namespace is not None:
            _broken(("moqt_namespace",), "is only allowed when the holder is a moqt URI")

    def _name_broken_hex(self) -> NoReturn:
        for path, value, rule in (
            (("block_key",), self.block_key, _HEX32_RULE),
            (("compat_id",), self.compat_id, _HEX32_RULE),
            (("scope_id",), self.scope_id, _HEX16_RULE),
            (("digest",), self.digest[8:], _DIGEST_RULE),
            *(
                (("layer_digests", i), d, _HEX32_RULE)
                for i, d in enumerate(self.layer_digests or ())
            ),
        ):
            if _lower_hex(value) is None:
                _broken(path, rule)
        raise AssertionError("the joined hex was wrong, so one of its parts is")

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"layer_digests": limits.max_layers, "residency": limits.max_layers}

    @classmethod
    def batch_from_body(
        cls, body: bytes, member: str, limits: Limits = DEFAULT_LIMITS
    ) -> list[ReplicaRecord] | None:
        """The records of a JSON body ``{member: [record, ...]}`` decoded from its octets in
        one pass, when every one of them is valid; None when the body is anything else, so
        that the caller judges its items one by one (``from_json``) and says what is wrong
        with each."""
        try:
            records = msgspec.json.decode(body, type=_batch_body_type(member)).records
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError):
            return None
        bound = limits.max_layers
        for record in records:
            if len(record.residency) > bound or len(record.layer_digests or ()) > bound:
                return None
        return records

    def with_ttl(self, ttl_ms: int) -> ReplicaRecord:
        """The same record with another ``ttl_ms`` (the IS caps it at its maximum, 6.1)."""
        _check_int(ttl_ms, ("ttl_ms",), 1)
        return msgspec.structs.replace(self, ttl_ms=ttl_ms)

    @property
    def block_key_bytes(self) -> bytes:
        return bytes.fromhex(self.block_key)

    @property
    def compat_id_bytes(self) -> bytes:
        return bytes.fromhex(self.compat_id)

    @property
    def scope_id_bytes(self) -> bytes:
        return bytes.fromhex(self.scope_id)

    @property
    def digest_bytes(self) -> bytes:
        return bytes.fromhex(self.digest[len(DIGEST_PREFIX) :])

    @property
    def layer_digest_bytes(self) -> tuple[bytes, ...] | None:
        if self.layer_digests is None:
            return None
        return tuple(bytes.fromhex(d) for d in self.layer_digests)

    @property
    def layer_count(self) -> int | None:
        """The number of layers of the block, known when ``layer_digests`` is present."""
        return None if self.layer_digests is None else len(self.layer_digests)

    @property
    def servable_by_layer_range(self) -> bool:
        """Whether the record lets a holder serve layer ranges (4.4 requires layer_digests)."""
        return self.layer_digests is not None

    @property
    def identity(self) -> tuple[str, str, str, str]:
        """What names one replica: (compat_id, scope_id, block_key, holder) (DESIGN.md 3)."""
        return (self.compat_id, self.scope_id, self.block_key, self.holder)

    @property
    def moqt_namespace_fields(self) -> tuple[bytes, ...] | None:
        if self.moqt_namespace is None:
            return None
        return parse_moqt_namespace(self.moqt_namespace)

    def holds_layers(self, first: int, last: int) -> bool:
        """Whether the residency covers every layer of the inclusive range ``first..last``."""
        covered = sorted(entry.layers for entry in self.residency)
        needed = first
        for start, end in covered:
            if start > needed:
                break
            needed = max(needed, end + 1)
            if needed > last:
                return True
        return needed > last

    def layer_range_digests(self, first: int, last: int) -> tuple[str, ...]:
        """The layer digests of the inclusive range ``first..last``, to verify a ranged GET.

        A record without ``layer_digests`` cannot be served by layer range (4.4); a range this
        replica does not hold is ``kvsp-layers-unavailable`` (6.7).
        """
        if self.layer_digests is None:
            raise ProtocolError(
                "kvsp-layers-unavailable",
                "the replica has no layer_digests, so it is not served by layer range",
            )
        if not (0 <= first <= last < len(self.layer_digests)) or not self.holds_layers(first, last):
            raise ProtocolError(
                "kvsp-layers-unavailable", f"the replica does not hold layers {first}-{last}"
            )
        return self.layer_digests[first : last + 1]


# --- Instance Status Record (4.4, 6.3) --------------------------------------------------------


def _number(schema: dict[str, Any] | None = None) -> Any:
    """A JSON number member, integer or not (an integer stays one); its range is checked by
    ``_check_number`` in ``__post_init__``, which names the bound broken, and ``schema``
    states it."""
    rule = _rule("must be a number", schema)
    return Annotated[int, rule] | Annotated[float, rule]


class Link(WireRecord, frozen=True):
    """The instance's link to one holder: its rate and round-trip time."""

    NAME: ClassVar[str] = "link"

    holder: HolderUrl
    mbit_per_s: _number({"minimum": 0, "exclusiveMinimum": True})
    rtt_us: _number({"minimum": 0})

    @_rules
    def __post_init__(self) -> None:
        _check_holder(self.holder, ("holder",))
        _check_number(self.mbit_per_s, ("mbit_per_s",), positive=True)
        _check_number(self.rtt_us, ("rtt_us",), lo=0)


class InstanceStatusRecord(WireRecord, frozen=True, kw_only=True):
    """An instance's report to the PC (4.4, 6.3).

    Every member of the spec's example is required except ``requested_state`` (absent means
    null, and the record always states it): the PC prices placement with ``queued``,
    ``prefill_tokens_per_s`` (recompute) and ``decode_tokens_per_s`` (service time), and judges
    capacity with ``running``, ``batch_size`` and ``kv_utilization``, so a record without them is
    more likely a fault than a choice. ``links`` may be empty; a holder without a link is one the
    instance cannot be priced to fetch from. ``requested_state`` may only be "sleeping" (6.3: an
    instance may ask to sleep; waking is the PC's decision). Two extension members (DESIGN.md
    section 3) say which requests placement may send the instance: ``compat_ids`` lists the
    compatibility ids it serves (absent or empty, it serves any), and ``engine`` is false for a
    node without an engine (a storage-only holder, which reports its status for its links and
    liveness alone and is never a placement or resume candidate, whatever its compat ids);
    absent, the instance runs an engine.
    """

    NAME: ClassVar[str] = "Instance Status Record"

    instance: BaseUrl
    epoch: Count
    state: Annotated[str, _rule(_choice_rule(InstanceState), {"enum": sorted(InstanceState)})]
    running: Count
    queued: Count
    batch_size: Count
    kv_utilization: _number({"minimum": 0, "maximum": 1})
    prefill_tokens_per_s: _number({"minimum": 0, "exclusiveMinimum": True})
    decode_tokens_per_s: _number({"minimum": 0, "exclusiveMinimum": True})
    links: Annotated[tuple[Link, ...], _rule("must be an array of links")]
    # UNSET only until __post_init__: absent or null, the member is written as null.
    requested_state: (
        Annotated[
            str,
            _rule(
                _choice_rule(REQUESTABLE_INSTANCE_STATES),
                {"enum": sorted(REQUESTABLE_INSTANCE_STATES)},
            ),
        ]
        | None
        | msgspec.UnsetType
    ) = msgspec.UNSET
    ttl_ms: PositiveInt
    compat_ids: (
        Annotated[
            tuple[Hex32, ...],
            _rule("must be an array of compatibility ids", {"uniqueItems": True}),
        ]
        | None
    ) = None
    engine: Annotated[bool, _rule("must be true or false")] | None = True

    @_rules
    def __post_init__(self) -> None:
        if self.requested_state is msgspec.UNSET:
            msgspec.structs.force_setattr(self, "requested_state", None)
        if self.engine is None:
            msgspec.structs.force_setattr(self, "engine", True)
        _check_base_url(self.instance, ("instance",))
        _check_int(self.epoch, ("epoch",))
        _check_choice(self.state, ("state",), frozenset(InstanceState))
        _check_int(self.running, ("running",))
        _check_int(self.queued, ("queued",))
        _check_int(self.batch_size, ("batch_size",))
        _check_number(self.kv_utilization, ("kv_utilization",), lo=0, hi=1)
        _check_number(self.prefill_tokens_per_s, ("prefill_tokens_per_s",), positive=True)
        _check_number(self.decode_tokens_per_s, ("decode_tokens_per_s",), positive=True)
        _check_tuple(self.links, ("links",))
        for index, link in enumerate(self.links):
            if not isinstance(link, Link):
                _fail(("links", index), "must be a link")
        _check_unique(self.links, ("links",), lambda link: link.holder, "holder")
        _check_int(self.ttl_ms, ("ttl_ms",), 1)
        if self.requested_state is not None:
            _check_choice(self.requested_state, ("requested_state",), REQUESTABLE_INSTANCE_STATES)
        if self.compat_ids is not None:
            _check_hex_list(self.compat_ids, ("compat_ids",), 32)
            _check_unique(self.compat_ids, ("compat_ids",), lambda c: c)
        _check_bool(self.engine, ("engine",))

    def link_to(self, holder: str) -> Link | None:
        for link in self.links:
            if link.holder == holder:
                return link
        return None

    def serves(self, compat_id: str) -> bool:
        """Whether placement may consider the instance for ``compat_id`` (DESIGN.md 3)."""
        return self.engine and (not self.compat_ids or compat_id in self.compat_ids)

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"links": limits.max_links, "compat_ids": limits.max_compat_ids}


class StateChange(WireRecord, frozen=True):
    """PUT {ii-base}state, the PC's decision, and PUT instances/{name}/state, an operator's
    (6.3): the state the instance is to take. Asking for "sleeping" drains it first."""

    NAME: ClassVar[str] = "state change"

    state: Annotated[
        str,
        _rule(_choice_rule(SETTABLE_INSTANCE_STATES), {"enum": sorted(SETTABLE_INSTANCE_STATES)}),
    ]

    @_rules
    def __post_init__(self) -> None:
        _check_choice(self.state, ("state",), SETTABLE_INSTANCE_STATES)


# --- Session Checkpoint (4.4, 6.8) ------------------------------------------------------------


def _check_probability(value: object, path: Path) -> None:
    _check_number(value, path, positive=True, hi=1)


def _check_positive(value: object, path: Path) -> None:
    _check_number(value, path, positive=True)


def _check_top_k(value: object, path: Path) -> None:
    _check_int(value, path, 1, UINT32_MAX)


# The registered sampler methods: for each, the parameters it requires and the ones it may take,
# with their checks. These are the samplers the reference engine restores on resume (6.8, step 3);
# a checkpoint naming another method could not be resumed, so it is refused when published.
# Other members of "params" are kept as given, for engines that take more (a repetition penalty,
# say): the resuming engine receives them unchanged.
SAMPLER_METHODS: Mapping[
    str, tuple[Mapping[str, Callable[[object, Path], None]], Mapping[str, Callable]]
] = {
    "greedy": ({}, {}),
    "temperature": ({"temperature": _check_positive}, {}),
    "top-k": ({"k": _check_top_k}, {"temperature": _check_positive}),
    "top-p": ({"p": _check_probability}, {"temperature": _check_positive}),
    "min-p": ({"p": _check_probability}, {"temperature": _check_positive}),
}


class Sampler(WireRecord, frozen=True, omit_defaults=False):
    """The sampler state of a session (4.4): method, parameters, seed (uint64), step.

    ``params`` is decoded as a JSON object and kept frozen, as a ``JsonObject``. A record
    decoded holds it to ``Limits.max_params`` and ``max_depth``; one built in code (from an
    engine's sampler) to generous bounds only.
    """

    NAME: ClassVar[str] = "sampler"

    method: Annotated[str, _rule(_choice_rule(SAMPLER_METHODS), {"enum": sorted(SAMPLER_METHODS)})]
    params: Annotated[dict[str, Any], _rule("must be a JSON object")]
    # msgspec bounds integers within int64: the uint64 bound is checked in __post_init__.
    seed: Annotated[
        int, _rule(f"must be an integer from 0 to {UINT64_MAX}", {"maximum": UINT64_MAX}, ge=0)
    ]
    step: Count
    deterministic: Annotated[bool, _rule("must be true or false")]

    @_rules
    def __post_init__(self) -> None:
        _check_choice(self.method, ("method",), tuple(SAMPLER_METHODS))
        if isinstance(self.params, Mapping) and not isinstance(self.params, JsonObject):
            frozen = freeze_json(self.params, ("params",), [4096], 0, 64)
            msgspec.structs.force_setattr(self, "params", frozen)
        if not isinstance(self.params, JsonObject):
            _fail(("params",), "must be a JSON object")
        required, optional = SAMPLER_METHODS[self.method]
        for name, check in required.items():
            if name not in self.params:
                _fail(("params", name), f'is required by method "{self.method}"')
            check(self.params[name], ("params", name))
        for name, check in optional.items():
            if name in self.params:
                check(self.params[name], ("params", name))
        _check_int(self.seed, ("seed",), 0, UINT64_MAX)
        _check_int(self.step, ("step",))
        _check_bool(self.deterministic, ("deterministic",))

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        _check_params_bounds(obj, (), limits)
        return _decode(cls, obj)


def _check_params_bounds(sampler: object, path: Path, limits: Limits) -> None:
    """The bounds of ``limits`` on the params of a sampler about to be decoded."""
    params = sampler.get("params") if isinstance(sampler, dict) else None
    if isinstance(params, dict):
        budget = [limits.max_params + 1]
        freeze_json(params, (*path, "params"), budget, 0, limits.max_depth)


class SessionCheckpoint(WireRecord, frozen=True):
    """A session's state, enough for another instance to resume it (4.4, 6.8).

    ``generated`` holds the session's output tokens from the first; ``output_offset`` is how many
    of them the checkpoint covers, so ``output_offset <= len(generated)``. A resuming instance
    continues from the covered tokens (``covered_generated``) and labels its first token with
    index ``output_offset``. Epochs start at ``FIRST_SESSION_EPOCH`` (1).
    """

    NAME: ClassVar[str] = "Session Checkpoint"

    session: Uuid
    epoch: Annotated[
        int,
        _rule(
            f"must be an integer from {FIRST_SESSION_EPOCH} to {MAX_SAFE_INTEGER}",
            ge=FIRST_SESSION_EPOCH,
            le=MAX_SAFE_INTEGER,
        ),
    ]
    compat_id: Hex32
    scope_id: Hex16
    prompt_blocks: Annotated[tuple[Hex32, ...], _rule("must be an array of block keys")]
    prompt_tail: Annotated[tuple[TokenId, ...], _rule("must be an array of token ids")]
    generated: Annotated[tuple[TokenId, ...], _rule("must be an array of token ids")]
    output_offset: Count
    sampler: Sampler

    @_rules
    def __post_init__(self) -> None:
        _check_uuid(self.session, ("session",))
        _check_int(self.epoch, ("epoch",), FIRST_SESSION_EPOCH)
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex_list(self.prompt_blocks, ("prompt_blocks",), 32)
        _check_uint32_list(self.prompt_tail, ("prompt_tail",))
        _check_uint32_list(self.generated, ("generated",))
        _check_int(self.output_offset, ("output_offset",))
        if self.output_offset > len(self.generated):
            _fail(
                ("output_offset",),
                f"covers {self.output_offset} output tokens but generated holds "
                f"{len(self.generated)}",
            )
        if not isinstance(self.sampler, Sampler):
            _fail(("sampler",), "must be a sampler object")

    @property
    def covered_generated(self) -> tuple[int, ...]:
        return self.generated[: self.output_offset]

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        if isinstance(obj, dict):
            _check_params_bounds(obj.get("sampler"), ("sampler",), limits)
        return _decode(cls, _lowered(obj, "session"), cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {
            "prompt_blocks": limits.max_block_keys,
            "prompt_tail": limits.max_tokens,
            "generated": limits.max_tokens,
        }


# --- Output tokens (6.8) ------------------------------------------------------------------------

# The most output tokens one POST output carries.
MAX_OUTPUT_TOKENS_PER_POST = 4096
# The front end keeps the epoch and index of each output token in 32-bit signed columns.
_OUTPUT_COUNT_MAX = 2**31 - 1
_OutputCount = Annotated[
    int,
    _rule(f"must be an integer from 0 to {_OUTPUT_COUNT_MAX}", ge=0, le=_OUTPUT_COUNT_MAX),
]


class OutputToken(WireRecord, frozen=True):
    """One output token of a session as its instance posts it to the front end (6.8): the
    epoch it was generated under, its index in the session's output, and ``final`` on the
    session's last token."""

    # Every bound is in the types, checked in C as a token is decoded, and no rule spans
    # members: so no __post_init__, whose Python call per token would cost more than the
    # decoding of the token (output is posted for every token a session generates).

    NAME: ClassVar[str] = "output token"

    epoch: _OutputCount
    index: _OutputCount
    token: Annotated[int, _rule(f"must be an integer from 0 to {UINT32_MAX}", ge=0, le=UINT32_MAX)]
    final: Annotated[bool, _rule("must be true or false")] | None = None


class DeliveredOutput(WireRecord, frozen=True, kw_only=True):
    """GET sessions/{session}/output (6.8): the session's epoch and state, the tokens the front
    end delivered after the index asked for, and whether the session's output is complete.
    Written from the front end's rows (``sessions.selectors.output_after``), which the output
    stream reads too."""

    session: Uuid
    epoch: Count
    state: Text
    tokens: tuple[OutputToken, ...]
    complete: bool


_OutputTokens = tuple[OutputToken, ...]


def parse_output_post(obj: object) -> tuple[OutputToken, ...]:
    """The body of POST sessions/{session}/output (6.8), decoded: one output token, or an
    array of 1 to ``MAX_OUTPUT_TOKENS_PER_POST``. A lone token is entry [0], as in an array,
    so that an error names it the same way."""
    items = obj if isinstance(obj, list) else [obj]
    if not 1 <= len(items) <= MAX_OUTPUT_TOKENS_PER_POST:
        _fail((), f"post 1 to {MAX_OUTPUT_TOKENS_PER_POST} output tokens")
    try:
        return msgspec.convert(items, _OutputTokens)
    except msgspec.ValidationError as error:
        raise _invalid(_OutputTokens, error) from None


# --- Lookup (6.2) and placement (6.4) requests ------------------------------------------------


class LookupRequest(WireRecord, frozen=True):
    """POST {is-base}lookup (6.2). ``block_keys`` may be empty (a prompt shorter than a block)."""

    NAME: ClassVar[str] = "lookup request"

    scope_id: Hex16
    compat_id: Hex32
    block_keys: Annotated[tuple[Hex32, ...], _rule("must be an array of block keys")]
    targets: (
        Annotated[
            tuple[BaseUrl, ...], _rule("must be an array of instance URLs", {"uniqueItems": True})
        ]
        | None
    ) = None

    @_rules
    def __post_init__(self) -> None:
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_hex_list(self.block_keys, ("block_keys",), 32)
        if self.targets is not None:
            _check_tuple(self.targets, ("targets",))
            _check_each(self.targets, ("targets",), _check_base_url)
            _check_unique(self.targets, ("targets",), lambda t: t)

    @classmethod
    def from_json(
        cls, obj: object, limits: Limits = DEFAULT_LIMITS, *, max_keys: int | None = None
    ) -> Self:
        """As ``WireRecord.from_json``; ``max_keys``, when given, bounds ``block_keys`` instead
        of ``limits.max_block_keys``."""
        if max_keys is not None:
            limits = dataclasses.replace(limits, max_block_keys=max_keys)
        return _decode(cls, obj, cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"block_keys": limits.max_block_keys, "targets": limits.max_targets}


TokenId = Annotated[int, _rule(f"must be an integer from 0 to {UINT32_MAX}", ge=0, le=UINT32_MAX)]


class PlacementRequest(WireRecord, frozen=True):
    """POST CP placements (DESIGN.md section 3): a prompt of at least one token to place."""

    NAME: ClassVar[str] = "placement request"

    scope_id: Hex16
    compat_id: Hex32
    tokens: Annotated[tuple[TokenId, ...], _rule("must be an array of token ids", {"minItems": 1})]
    request_ref: (
        Annotated[
            str,
            _rule(
                f"must be a string of at most {MAX_REQUEST_REF_LENGTH} characters",
                max_length=MAX_REQUEST_REF_LENGTH,
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        if _lower_hex(self.scope_id) is None:
            _broken(("scope_id",), _HEX16_RULE)
        if _lower_hex(self.compat_id) is None:
            _broken(("compat_id",), _HEX32_RULE)
        if not self.tokens:
            _broken(("tokens",), "must not be empty")

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"tokens": limits.max_tokens}


# --- Lookup (6.1, 6.2) and placement (6.4) answers --------------------------------------------
# The index and the PC write these on their hot paths from rows and prices (a block's replicas
# as JSON written once per row, ``index.selectors.ReplicaRow.fragment``); the types say what
# they answer, for the OpenAPI description and for the tests that decode real answers.

Micros = Annotated[float, _rule("must be a number of microseconds", ge=0)]


class Replicas(WireRecord, frozen=True):
    """A block's unexpired Replica Records: GET replicas/{compat}/{scope}/{key} (6.1), and
    each block of a lookup's matched prefix (6.2)."""

    block_key: Hex32
    replicas: tuple[ReplicaRecord, ...]


class LookupEstimate(WireRecord, frozen=True):
    """One entry of a lookup answer's ``estimates`` (6.2, DESIGN.md section 3): the time to
    make the matched blocks resident at ``target``, and to prefill their tokens there."""

    target: BaseUrl
    fetch_us: Micros
    recompute_us: Micros


class UnpricedTarget(WireRecord, frozen=True):
    """A lookup target the IS could not price, and why."""

    target: BaseUrl
    reason: Text


class LookupAnswer(WireRecord, frozen=True, kw_only=True):
    """The answer to POST lookup (6.2): the matched prefix's blocks with their replicas, and,
    when the request named targets, an estimate for each (or why there is none)."""

    matched: Count
    blocks: tuple[Replicas, ...]
    estimates: tuple[LookupEstimate, ...] | None = None
    unpriced: tuple[UnpricedTarget, ...] | None = None


class PlacementCandidate(WireRecord, frozen=True, kw_only=True):
    """One instance the PC priced for a placement: the terms of its 6.4 cost
    (``kvsp.cost.CostBreakdown``) and its state."""

    instance: BaseUrl
    name: Text
    state: Text
    wait_us: Micros
    fetch_us: Micros
    recompute_unmatched_us: Micros
    recompute_all_us: Micros
    cost_us: Micros


class PlacementAnswer(WireRecord, frozen=True, kw_only=True):
    """The answer to POST CP placements (DESIGN.md section 3): the instance chosen, the prefix
    it will load, the URL of the prefetch directive sent to it (null when it loads nothing),
    whether it was woken for this request, every candidate priced, and the microseconds each
    step of the placement took."""

    instance: BaseUrl
    name: Text
    matched: Count
    directive: str | None
    woke: bool
    candidates: tuple[PlacementCandidate, ...]
    timings_us: dict[str, Annotated[int, msgspec.Meta(ge=0)]]


# --- Prefetch directive and its state (6.5, DESIGN.md section 3) ------------------------------


class DirectiveBlock(WireRecord, frozen=True):
    """One block of a prefetch directive and the holders to load it from, preferred first."""

    NAME: ClassVar[str] = "directive block"

    block_key: Hex32
    sources: Annotated[
        tuple[HolderUrl, ...],
        _rule("must be an array of holder URLs", {"minItems": 1, "uniqueItems": True}),
    ]

    @_rules
    def __post_init__(self) -> None:
        _check_hex(self.block_key, ("block_key",), 32)
        _check_tuple(self.sources, ("sources",), non_empty=True)
        _check_each(self.sources, ("sources",), _check_holder)
        _check_unique(self.sources, ("sources",), lambda s: s)

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"sources": limits.max_sources}


def _check_sources_bounds(blocks: object, path: Path, limits: Limits) -> None:
    """The bound on the sources of each directive block about to be decoded."""
    if isinstance(blocks, list) and len(blocks) <= limits.max_block_keys:
        for index, block in enumerate(blocks):
            if isinstance(block, dict):
                _check_array_bounds(block, {"sources": limits.max_sources}, (*path, index))


class PrefetchDirective(WireRecord, frozen=True, kw_only=True):
    """POST {ii-base}prefetch (6.5). ``layer_order`` defaults to "ascending", the only order."""

    NAME: ClassVar[str] = "prefetch directive"

    directive: Uuid
    request_ref: Text | None = None
    scope_id: Hex16
    compat_id: Hex32
    blocks: Annotated[
        tuple[DirectiveBlock, ...],
        _rule("must be an array of directive blocks", {"minItems": 1}),
    ]
    # Absent or null, the only order there is; the record always states it.
    layer_order: Annotated[Literal[LAYER_ORDERS], _rule(_choice_rule(LAYER_ORDERS))] | None = None
    deadline_ms: PositiveInt
    lease_ms: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        if self.layer_order is None:
            msgspec.structs.force_setattr(self, "layer_order", LAYER_ORDERS[0])
        _check_uuid(self.directive, ("directive",))
        if self.request_ref is not None:
            _check_text(self.request_ref, ("request_ref",))
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_tuple(self.blocks, ("blocks",), non_empty=True)
        for index, block in enumerate(self.blocks):
            if not isinstance(block, DirectiveBlock):
                _fail(("blocks", index), "must be a directive block")
        _check_unique(self.blocks, ("blocks",), lambda b: b.block_key, "block_key")
        _check_choice(self.layer_order, ("layer_order",), LAYER_ORDERS)
        _check_int(self.deadline_ms, ("deadline_ms",), 1)
        _check_int(self.lease_ms, ("lease_ms",), 1)

    @property
    def block_keys(self) -> tuple[str, ...]:
        return tuple(block.block_key for block in self.blocks)

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        if isinstance(obj, dict):
            _check_sources_bounds(obj.get("blocks"), ("blocks",), limits)
        return _decode(cls, _lowered(obj, "directive"), cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"blocks": limits.max_block_keys}


class DirectiveStatusRecord(WireRecord, frozen=True, omit_defaults=False):
    """The directive's status resource, GET {ii-base}prefetch/{directive} (6.5, DESIGN.md
    section 3): the state (``states.DirectiveState``), the keys loaded so far in prefix order,
    and a reason (for "partial" and "failed"; null otherwise, and always present)."""

    NAME: ClassVar[str] = "directive status"

    directive: Uuid
    state: Annotated[str, _rule(_choice_rule(DirectiveState), {"enum": sorted(DirectiveState)})]
    loaded: Annotated[
        tuple[Hex32, ...], _rule("must be an array of block keys", {"uniqueItems": True})
    ]
    reason: Text | None = None

    @_rules
    def __post_init__(self) -> None:
        _check_uuid(self.directive, ("directive",))
        _check_choice(self.state, ("state",), frozenset(DirectiveState))
        _check_hex_list(self.loaded, ("loaded",), 32)
        _check_unique(self.loaded, ("loaded",), lambda k: k)
        if self.reason is not None:
            _check_text(self.reason, ("reason",))

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        return _decode(cls, _lowered(obj, "directive"), cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"loaded": limits.max_block_keys}


# --- Requests that start serving a session on a node (6.8, DESIGN.md section 3) --------------

# The member of ``sampler.params`` that carries a session's length. A Session Checkpoint (4.4) has
# no member for the number of output tokens the session was asked for, yet the instance that
# resumes it must stop where the first one would have: params reach the resuming instance
# unchanged, and a sampler ignores the member (it changes no draw).
MAX_TOKENS_PARAM = "max_tokens"
GREEDY = "greedy"


def session_sampler(method: object, params: object, seed: object, step: object) -> Sampler:
    """The sampler member of a session's checkpoints (4.4), checked as the engine's samplers
    check it: a registered method, its parameters, and no parameter the engine does not
    implement (``max_tokens`` aside), since ignoring one would resume a different sampler."""
    if not isinstance(params, Mapping):
        _fail(("params",), "must be a JSON object")
    record = Sampler(
        method=method, params=params, seed=seed, step=step, deterministic=method == GREEDY
    )
    required, optional = SAMPLER_METHODS[record.method]
    unknown = sorted(set(record.params) - set(required) - set(optional) - {MAX_TOKENS_PARAM})
    if unknown:
        _fail(("params",), f"method {record.method!r} here takes no {', '.join(unknown)}")
    if MAX_TOKENS_PARAM in record.params:
        _check_int(record.params[MAX_TOKENS_PARAM], ("params", MAX_TOKENS_PARAM), 1)
    return record


class GenerateSampler(WireRecord, frozen=True, omit_defaults=False):
    """The sampler a generate request asks for: a method, its parameters (absent, none) and a
    seed (absent, 0); the session's checkpoints carry it from step 0 (``record``)."""

    NAME: ClassVar[str] = "sampler"

    method: Annotated[str, _rule(_choice_rule(SAMPLER_METHODS), {"enum": sorted(SAMPLER_METHODS)})]
    params: Annotated[dict[str, Any], _rule("must be a JSON object")] | None = None
    # msgspec bounds integers within int64: the uint64 bound is the sampler's to check.
    seed: (
        Annotated[
            int, _rule(f"must be an integer from 0 to {UINT64_MAX}", {"maximum": UINT64_MAX}, ge=0)
        ]
        | None
    ) = None

    @_rules
    def __post_init__(self) -> None:
        if self.params is None:
            msgspec.structs.force_setattr(self, "params", {})
        if self.seed is None:
            msgspec.structs.force_setattr(self, "seed", 0)
        self.record()

    def record(self, step: int = 0) -> Sampler:
        return session_sampler(self.method, self.params, self.seed, step)


class GenerateRequest(WireRecord, frozen=True, kw_only=True):
    """``POST II generate``, this implementation's own request (inference is outside the spec's
    scope, 1.3): a new session from a prompt of token ids. ``sampler`` absent is greedy;
    ``request_ref`` is that of the placement whose prefetch directive loads the prompt's blocks
    (6.5). A body that is not an object, or a ``session`` that is not a UUID, is a malformed
    request, not an invalid record: the node cannot name the session it would refuse."""

    NAME: ClassVar[str] = "generate request"

    session: Uuid
    scope_id: Hex16
    compat_id: Hex32
    prompt: Annotated[tuple[TokenId, ...], _rule("must be an array of token ids", {"minItems": 1})]
    max_tokens: PositiveInt
    sampler: GenerateSampler | None = None
    request_ref: (
        Annotated[
            str,
            _rule(
                f"must be a string of 1 to {MAX_TEXT_LENGTH} characters",
                min_length=1,
                max_length=MAX_TEXT_LENGTH,
            ),
        ]
        | None
    ) = None

    @_rules
    def __post_init__(self) -> None:
        if self.sampler is None:
            msgspec.structs.force_setattr(self, "sampler", GenerateSampler(GREEDY))
        _check_uuid(self.session, ("session",))
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_tuple(self.prompt, ("prompt",), non_empty=True)
        _check_uint32_list(self.prompt, ("prompt",))
        _check_int(self.max_tokens, ("max_tokens",), 1)
        if not isinstance(self.sampler, GenerateSampler):
            _fail(("sampler",), "must be a sampler object")
        if MAX_TOKENS_PARAM in self.sampler.params:
            _fail(
                ("sampler", "params"),
                f"give {MAX_TOKENS_PARAM} beside the sampler, not in it",
            )

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        if not isinstance(obj, dict):
            raise ProtocolError("kvsp-malformed-request", f"a {cls.NAME} must be a JSON object")
        session = parse_uuid(obj.get("session"), "session", problem="kvsp-malformed-request")
        return _decode(cls, {**obj, "session": str(session)}, cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"prompt": limits.max_tokens}


class ResumeRequest(WireRecord, frozen=True, kw_only=True, omit_defaults=False):
    """``POST II sessions/{session}/resume`` (6.8), as the PC sends it: the session, its new
    epoch, its latest checkpoint, and the blocks of the checkpoint's prompt to load (with their
    sources) or already resident where it is sent. ``blocks`` and ``resident`` absent are empty;
    ``deadline_ms`` and ``lease_ms`` absent are the node's to choose (``with_prefetch_bounds``).
    """

    NAME: ClassVar[str] = "resume request"

    session: Uuid
    epoch: PositiveInt
    checkpoint: SessionCheckpoint
    blocks: (
        Annotated[tuple[DirectiveBlock, ...], _rule("must be an array of directive blocks")] | None
    ) = None
    resident: Annotated[tuple[Hex32, ...], _rule("must be an array of block keys")] | None = None
    deadline_ms: PositiveInt | None = None
    lease_ms: PositiveInt | None = None

    @_rules
    def __post_init__(self) -> None:
        if self.blocks is None:
            msgspec.structs.force_setattr(self, "blocks", ())
        if self.resident is None:
            msgspec.structs.force_setattr(self, "resident", ())
        _check_uuid(self.session, ("session",))
        _check_int(self.epoch, ("epoch",), 1)
        checkpoint = self.checkpoint
        if not isinstance(checkpoint, SessionCheckpoint):
            _fail(("checkpoint",), "must be a Session Checkpoint")
        if checkpoint.session != self.session:
            _fail(("checkpoint", "session"), "not the session resumed")
        if checkpoint.epoch >= self.epoch:
            _fail(
                ("epoch",),
                f"must be above the checkpoint's epoch {checkpoint.epoch}: a resumed session "
                "runs under a new epoch (6.8)",
            )
        sampler = checkpoint.sampler
        try:
            session_sampler(sampler.method, sampler.params, sampler.seed, sampler.step)
        except InvalidRecord as error:
            raise error.within("checkpoint", "sampler") from None
        if not checkpoint.prompt_tail and not checkpoint.output_offset:
            _fail(
                ("checkpoint",),
                "no token after the prompt blocks, so there is nothing to compute the first "
                "output token from",
            )
        _check_tuple(self.blocks, ("blocks",))
        for index, block in enumerate(self.blocks):
            if not isinstance(block, DirectiveBlock):
                _fail(("blocks", index), "must be a directive block")
        _check_hex_list(self.resident, ("resident",), 32)

    def with_prefetch_bounds(self, deadline_ms: int, lease_ms: int) -> ResumeRequest:
        """The request with the node's ``deadline_ms`` and ``lease_ms`` where the PC left them
        out."""
        return msgspec.structs.replace(
            self,
            deadline_ms=deadline_ms if self.deadline_ms is None else self.deadline_ms,
            lease_ms=lease_ms if self.lease_ms is None else self.lease_ms,
        )

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        checkpoint = obj.get("checkpoint") if isinstance(obj, dict) else None
        if isinstance(checkpoint, dict):
            _check_array_bounds(
                checkpoint, SessionCheckpoint._array_bounds(limits), ("checkpoint",)
            )
            _check_params_bounds(checkpoint.get("sampler"), ("checkpoint", "sampler"), limits)
            checkpoint = _lowered(checkpoint, "session")
            obj = {**_lowered(obj, "session"), "checkpoint": checkpoint}
        if isinstance(obj, dict):
            _check_sources_bounds(obj.get("blocks"), ("blocks",), limits)
        return _decode(cls, _lowered(obj, "session"), cls._array_bounds(limits))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"blocks": limits.max_block_keys, "resident": limits.max_block_keys}


# --- Leases (6.6) -----------------------------------------------------------------------------


class BlockBatchRequest(WireRecord, frozen=True):
    """POST {holder}blocks/{compat}/{scope}: the blocks of one compat and scope that a client
    retrieves in one request, in the order it wants them (an extension of 6.7; each block comes
    back as the part a GET of its resource would answer, docs/api.md "Blocks in batches"). Keys are
    unique; a holder bounds how many one request may name."""

    NAME: ClassVar[str] = "block batch request"

    block_keys: Annotated[
        tuple[Hex32, ...],
        _rule("must be a non-empty array of block keys", {"uniqueItems": True}, min_length=1),
    ]

    def __post_init__(self) -> None:
        seen: dict[str, int] = {}
        for index, key in enumerate(self.block_keys):
            if _lower_hex(key) is None:
                _broken(("block_keys", index), _HEX32_RULE)
            if key in seen:
                _broken(("block_keys", index), "duplicates {related}", ("block_keys", seen[key]))
            seen[key] = index

    @classmethod
    def from_json(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Self:
        keys = obj.get("block_keys") if isinstance(obj, dict) else None
        if isinstance(keys, list) and len(keys) > limits.max_block_keys:
            _fail(("block_keys",), f"has more than {limits.max_block_keys} entries")
        return _decode(cls, obj)


_BLOCK_KEYS_RULE = _rule("must be an array of block keys", {"minItems": 1, "uniqueItems": True})


class LeaseRequest(WireRecord, frozen=True):
    """POST {holder}leases (6.6).

    Besides the block keys and ``ttl_ms`` the spec names, the request carries ``compat_id`` and
    ``scope_id``: a holder names a block by (compat, scope, key) (6.7) and must check that the
    client is authorized for the scope before it pins anything, as it does for a GET.
    """

    NAME: ClassVar[str] = "lease request"

    compat_id: Hex32
    scope_id: Hex16
    block_keys: Annotated[tuple[Hex32, ...], _BLOCK_KEYS_RULE]
    ttl_ms: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex_list(self.block_keys, ("block_keys",), 32, non_empty=True)
        _check_unique(self.block_keys, ("block_keys",), lambda k: k)
        _check_int(self.ttl_ms, ("ttl_ms",), 1)

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"block_keys": limits.max_block_keys}


class LeaseRenewal(WireRecord, frozen=True):
    """PUT {holder}leases/{id} (6.6): the TTL asked for from now."""

    NAME: ClassVar[str] = "lease renewal"

    ttl_ms: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        _check_int(self.ttl_ms, ("ttl_ms",), 1)


class LeaseGrant(WireRecord, frozen=True):
    """A holder's answer to a lease request or renewal (6.6).

    ``lease`` is the identifier (one URL path segment), ``ttl_ms`` the TTL granted, which the
    holder may have lowered to its quota, and ``expires_ms`` the expiry in milliseconds since the
    Unix epoch by the holder's clock, for display; a client times the lease by ``ttl_ms``.
    """

    NAME: ClassVar[str] = "lease grant"

    lease: Segment
    compat_id: Hex32
    scope_id: Hex16
    block_keys: Annotated[tuple[Hex32, ...], _BLOCK_KEYS_RULE]
    ttl_ms: PositiveInt
    expires_ms: Count

    @_rules
    def __post_init__(self) -> None:
        _check_segment(self.lease, ("lease",))
        _check_hex(self.compat_id, ("compat_id",), 32)
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_hex_list(self.block_keys, ("block_keys",), 32, non_empty=True)
        _check_unique(self.block_keys, ("block_keys",), lambda k: k)
        _check_int(self.ttl_ms, ("ttl_ms",), 1)
        _check_int(self.expires_ms, ("expires_ms",))

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"block_keys": limits.max_block_keys}


# --- Delegated tokens (DESIGN.md section 6) ---------------------------------------------------

# A bearer token is at most this long (a delegated token carries its audience URL).
MAX_BEARER_TOKEN_LENGTH = 4096


def _check_token(value: object, path: Path) -> None:
    if not (isinstance(value, str) and value and value.isascii()):
        _fail(path, "must be a non-empty ASCII string")
    if len(value) > MAX_BEARER_TOKEN_LENGTH or any(ch <= " " or ch == "\x7f" for ch in value):
        _fail(path, f"must be at most {MAX_BEARER_TOKEN_LENGTH} characters, none of them spaces")


BearerToken = Annotated[
    str,
    _rule(
        "must be a non-empty ASCII string", {"minLength": 1, "maxLength": MAX_BEARER_TOKEN_LENGTH}
    ),
]


class TokenRequest(WireRecord, frozen=True):
    """POST {cp}tokens: a delegated token for one scope at one holder (``audience``, the
    holder's base URL); ``ttl_ms`` absent asks for the longest life the control plane grants."""

    NAME: ClassVar[str] = "token request"

    scope_id: Hex16
    audience: BaseUrl
    ttl_ms: PositiveInt | None = None

    @_rules
    def __post_init__(self) -> None:
        _check_hex(self.scope_id, ("scope_id",), 16)
        _check_base_url(self.audience, ("audience",))
        if self.ttl_ms is not None:
            _check_int(self.ttl_ms, ("ttl_ms",), 1)


class TokenGrant(WireRecord, frozen=True):
    """The answer to a token request: the token, its expiry (RFC 3339, UTC, by the control
    plane's clock, for display) and ``ttl_ms``, the life granted, by which a client times it."""

    NAME: ClassVar[str] = "token grant"

    token: BearerToken
    expires_at: Annotated[str, _rule("must be a string", {"maxLength": 64})]
    ttl_ms: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        _check_token(self.token, ("token",))
        _check_text(self.expires_at, ("expires_at",), 64)
        _check_int(self.ttl_ms, ("ttl_ms",), 1)


class TokenIntrospectionRequest(WireRecord, frozen=True):
    """POST {cp}tokens/introspect (RFC 7662 in shape): the token a holder was presented."""

    NAME: ClassVar[str] = "introspection request"

    token: BearerToken

    @_rules
    def __post_init__(self) -> None:
        _check_token(self.token, ("token",))


class TokenIntrospection(WireRecord, frozen=True):
    """What the control plane says of a token: ``{"active": false}`` for anything that is not a
    valid delegated token for the asker; else its scope, its audience and ``exp`` (seconds
    since the Unix epoch, RFC 7519 NumericDate), until which the answer may be cached."""

    NAME: ClassVar[str] = "introspection"

    active: Annotated[bool, _rule("must be true or false")]
    scope_id: Hex16 | None = None
    audience: BaseUrl | None = None
    exp: Count | None = None

    @_rules
    def __post_init__(self) -> None:
        _check_bool(self.active, ("active",))
        if self.active:
            _check_hex(self.scope_id, ("scope_id",), 16)
            _check_base_url(self.audience, ("audience",))
            _check_int(self.exp, ("exp",))

    def to_json(self) -> dict[str, Any]:
        # An inactive token is told nothing more, whatever the record was built with.
        return super().to_json() if self.active else {"active": False}


# --- Shard Map and reshard messages (6.9, DESIGN.md section 3) --------------------------------

TokenRange = tuple[int, int]  # half-open [start, end)
# The longest prepare phase a reshard may have, so that neither the controller's operation nor
# a member's request waiting on its loads is held open without bound.
MAX_DEADLINE_MS = 600_000
TokenRangeMember = Annotated[tuple[Count, Count], _rule("must be [start, end]")]


class Shard(WireRecord, frozen=True):
    NAME: ClassVar[str] = "shard"

    tokens: TokenRangeMember
    instance: BaseUrl

    @_rules
    def __post_init__(self) -> None:
        _check_token_range(self.tokens, ("tokens",))
        _check_base_url(self.instance, ("instance",))


class ShardMap(WireRecord, frozen=True):
    """A Shard Map (6.9): which instance holds which token range of one context.

    The shards are contiguous in list order (each starts where the one before ends), hence
    sorted and non-overlapping. The first need not start at 0: a map describes the range it
    covers, and tokens outside it belong to no member (a shared prefix held elsewhere, say).
    An instance may hold several shards.
    """

    NAME: ClassVar[str] = "Shard Map"

    map: Segment
    version: Count
    shards: Annotated[tuple[Shard, ...], _rule("must be an array of shards", {"minItems": 1})]

    @_rules
    def __post_init__(self) -> None:
        _check_segment(self.map, ("map",))
        _check_int(self.version, ("version",))
        _check_tuple(self.shards, ("shards",), non_empty=True)
        for index, shard in enumerate(self.shards):
            if not isinstance(shard, Shard):
                _fail(("shards", index), "must be a shard")
            if index and shard.tokens[0] != self.shards[index - 1].tokens[1]:
                _fail(
                    ("shards", index, "tokens"),
                    f"must start at {self.shards[index - 1].tokens[1]}, where shards[{index - 1}]"
                    " ends (shards are contiguous)",
                )

    @property
    def covered(self) -> TokenRange:
        """The token range the map covers: from the first start to the last end."""
        return (self.shards[0].tokens[0], self.shards[-1].tokens[1])

    @property
    def instances(self) -> tuple[str, ...]:
        """The members, in order of their first shard."""
        return tuple(dict.fromkeys(shard.instance for shard in self.shards))

    def ranges_of(self, instance: str) -> list[TokenRange]:
        """The ranges ``instance`` holds, sorted, with adjacent ranges merged."""
        out: list[TokenRange] = []
        for shard in self.shards:
            if shard.instance != instance:
                continue
            if out and out[-1][1] == shard.tokens[0]:
                out[-1] = (out[-1][0], shard.tokens[1])
            else:
                out.append(shard.tokens)
        return out

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"shards": limits.max_shards}


class FetchRange(WireRecord, frozen=True):
    """A range a member gains, and the member that holds it in the current version."""

    NAME: ClassVar[str] = "fetch range"

    tokens: TokenRangeMember
    source: BaseUrl = msgspec.field(name="from")

    @_rules
    def __post_init__(self) -> None:
        _check_token_range(self.tokens, ("tokens",))
        _check_base_url(self.source, ("from",))


class ReshardPlan(WireRecord, frozen=True, kw_only=True):
    """POST {ii-base}reshard with a plan (6.9): move map ``map`` from version ``from`` to ``to``.

    ``to`` is ``from + 1``. No token is in two of retain, fetch and release, nor twice in one
    (an instance cannot both keep and load a range, nor keep and release it); the lists need not
    be sorted. ``instance`` names the member the plan is for: the PC's reshard answer lists one
    plan per member (DESIGN.md section 3); the body sent to the member may leave it out. A fetch
    from the plan's own instance is refused.
    """

    NAME: ClassVar[str] = "reshard plan"

    map: Segment
    instance: BaseUrl | None = None
    from_version: Count = msgspec.field(name="from")
    to_version: PositiveInt = msgspec.field(name="to")
    deadline_ms: PositiveInt
    retain: Annotated[tuple[TokenRangeMember, ...], _rule("must be an array of token ranges")]
    fetch: Annotated[tuple[FetchRange, ...], _rule("must be an array of fetch ranges")]
    release: Annotated[tuple[TokenRangeMember, ...], _rule("must be an array of token ranges")]

    @_rules
    def __post_init__(self) -> None:
        _check_segment(self.map, ("map",))
        _check_int(self.from_version, ("from",))
        _check_int(self.to_version, ("to",), 1)
        if self.to_version != self.from_version + 1:
            _fail(("to",), f"must be from + 1 = {self.from_version + 1}")
        _check_int(self.deadline_ms, ("deadline_ms",), 1)
        if self.instance is not None:
            _check_base_url(self.instance, ("instance",))
        # In document order, so that an overlap is reported at the later range.
        ranges: list[tuple[int, int, Path]] = []
        _check_tuple(self.retain, ("retain",))
        for index, value in enumerate(self.retain):
            _check_token_range(value, ("retain", index))
            ranges.append((value[0], value[1], ("retain", index)))
        _check_tuple(self.fetch, ("fetch",))
        for index, fetch in enumerate(self.fetch):
            if not isinstance(fetch, FetchRange):
                _fail(("fetch", index), "must be a fetch range")
            if fetch.source == self.instance:
                _fail(("fetch", index, "from"), "is the plan's own instance")
            ranges.append((fetch.tokens[0], fetch.tokens[1], ("fetch", index, "tokens")))
        _check_tuple(self.release, ("release",))
        for index, value in enumerate(self.release):
            _check_token_range(value, ("release", index))
            ranges.append((value[0], value[1], ("release", index)))
        overlap = _first_overlap(ranges, inclusive=False)
        if overlap:
            _fail(overlap[0], "overlaps {related}", overlap[1])

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {
            "retain": limits.max_ranges,
            "fetch": limits.max_ranges,
            "release": limits.max_ranges,
        }


class ReshardCommit(WireRecord, frozen=True):
    """POST reshard {"map", "commit": v+1} (6.9): version v+1 becomes authoritative."""

    NAME: ClassVar[str] = "reshard commit"

    map: Segment
    commit: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        _check_segment(self.map, ("map",))
        _check_int(self.commit, ("commit",), 1)


class ReshardAbort(WireRecord, frozen=True):
    """POST reshard {"map", "abort": v+1} (6.9): members discard what they fetched for v+1."""

    NAME: ClassVar[str] = "reshard abort"

    map: Segment
    abort: PositiveInt

    @_rules
    def __post_init__(self) -> None:
        _check_segment(self.map, ("map",))
        _check_int(self.abort, ("abort",), 1)


def parse_reshard_body(
    obj: object, limits: Limits = DEFAULT_LIMITS
) -> ReshardPlan | ReshardCommit | ReshardAbort:
    """Which of the three POST reshard bodies ``obj`` is (6.9), decoded.

    A body with "commit" is a commit and one with "abort" an abort (other members are then
    unknown and ignored); a body with both is refused; any other body is a plan.
    """
    if not isinstance(obj, dict):
        raise InvalidRecord((), "a reshard body must be a JSON object")
    has_commit = obj.get("commit") is not None
    has_abort = obj.get("abort") is not None
    if has_commit and has_abort:
        raise InvalidRecord(("abort",), 'a reshard body cannot carry both "commit" and "abort"')
    if has_commit:
        return ReshardCommit.from_json(obj, limits)
    if has_abort:
        return ReshardAbort.from_json(obj, limits)
    return ReshardPlan.from_json(obj, limits)


class ReshardRequest(WireRecord, frozen=True):
    """POST shardmaps/{map}/reshard (DESIGN.md section 3): the shards of the map's next
    version, and the time its members have to prepare. That there is a shard and that the
    shards are contiguous are the rules of the next Shard Map, which the PC checks as it makes
    it. A ``context`` for the next version (the map's extension member) is read beside the
    record, as with a Shard Map."""

    NAME: ClassVar[str] = "reshard request"

    shards: Annotated[tuple[Shard, ...], _rule("must be an array of shards", {"minItems": 1})]
    deadline_ms: Annotated[
        int,
        _rule(f"must be an integer from 1 to {MAX_DEADLINE_MS}", ge=1, le=MAX_DEADLINE_MS),
    ]

    @_rules
    def __post_init__(self) -> None:
        _check_tuple(self.shards, ("shards",))
        for index, shard in enumerate(self.shards):
            if not isinstance(shard, Shard):
                _fail(("shards", index), "must be a shard")
        _check_int(self.deadline_ms, ("deadline_ms",), 1, MAX_DEADLINE_MS)

    @classmethod
    def _array_bounds(cls, limits: Limits) -> Mapping[str, int]:
        return {"shards": limits.max_shards}


# --- Answers the API builds (DESIGN.md section 3) ---------------------------------------------
#
# Structs for the same reason as the records: the OpenAPI description is generated from them, so
# it states what the views send. The server builds them and nothing here decodes them, so they
# carry no rules beyond their types.


class StateAnswer(WireRecord, frozen=True):
    """The state of an instance: the PC's answer to its status report (6.3), and a node's to
    PUT state."""

    state: Annotated[str, _rule(_choice_rule(InstanceState), {"enum": sorted(InstanceState)})]


class ScopeKeyAnswer(WireRecord, frozen=True):
    """GET scopes/{scope_id}/key: the scope key for a principal of the scope, the spec's "means
    outside this document" of sharing it (4.2)."""

    scope_id: Hex16
    name: str
    scope_key: Annotated[str, msgspec.Meta(description="the scope key in lowercase hex")]


class SessionAdmitted(WireRecord, frozen=True, kw_only=True):
    """A session a node admitted (POST generate, POST sessions/{session}/resume). A generated
    session names its resources at the control plane, where its checkpoints and output tokens
    appear (6.8); a resumed one has them already."""

    session: Uuid
    epoch: PositiveInt
    state: str
    session_url: str | None = None
    output_url: str | None = None


class OutputAnswer(WireRecord, frozen=True, kw_only=True):
    """What the control plane took of posted output tokens: the indexes it stored, those it
    held already, and how many tokens of the session it holds in all."""

    session: Uuid
    epoch: Count
    stored: tuple[Count, ...]
    duplicates: tuple[Count, ...]
    delivered: Count


class CheckpointAnswer(WireRecord, frozen=True, kw_only=True):
    """The control plane's answer to a Session Checkpoint (6.8): the offset it holds, and what
    it took of the output tokens that came with the checkpoint (the extension member
    ``output``), when some did."""

    session: Uuid
    epoch: Count
    output_offset: Count
    output: OutputAnswer | None = None


class ReshardMoveAnswer(WireRecord, frozen=True, kw_only=True):
    """The answer to POST reshard (6.9): the move as the node sees it. ``from`` is null for a
    decision whose plan never arrived, ``attempt`` when the PC numbered none; ``owed_release``
    counts the blocks still held after a commit because a lease covered them."""

    map: Segment
    from_version: Count | None = msgspec.field(name="from")
    to_version: PositiveInt = msgspec.field(name="to")
    attempt: _Count32 | None
    state: Annotated[str, _rule(_choice_rule(ReshardPhase), {"enum": [*ReshardPhase]})]
    loaded: bool
    fetched_blocks: Count
    fetched_octets: Count
    released_blocks: Count
    owed_release: Count


# Resources the control plane answers with, written from its rows (``instance_json``,
# ``session_json``, ``operation_json``, the batch outcomes) where the dashboard reads them too;
# the types say what they answer, and tests decode real answers with them.


class BatchResult(WireRecord, frozen=True, kw_only=True):
    """What became of one item of a batch publication or withdrawal: the status and problem
    its single PUT or DELETE would have answered, and the TTL granted to a record published."""

    block_key: str | None
    holder: str | None
    status: Annotated[int, msgspec.Meta(ge=200, le=599)]
    problem: dict[str, Any] | None
    ttl_ms: PositiveInt | None = None


class ReplicaBatchAnswer(WireRecord, frozen=True):
    """The answer to POST CP replicas and POST CP replicas/withdrawals: one result per item,
    in order."""

    results: tuple[BatchResult, ...]


class InstanceAnswer(WireRecord, frozen=True, kw_only=True):
    """An instance as the PC knows it: its state and the figures of its latest status record
    (6.3), and whether the PC has told it of its latest state change."""

    name: Text
    url: BaseUrl
    state: Text
    epoch: int | None
    compat_ids: tuple[Hex32, ...]
    running: Count
    queued: Count
    batch_size: Count
    kv_utilization: float
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    links: tuple[Link, ...] | None
    requested_state: Text | None
    last_report_age_ms: int | None
    live: bool
    restarts: Count
    state_pushed: bool


class InstancesAnswer(WireRecord, frozen=True):
    """GET CP instances/: every instance registered."""

    instances: tuple[InstanceAnswer, ...]


class SessionAnswer(WireRecord, frozen=True, kw_only=True):
    """A session as the front end follows it (6.8): its epoch and state, the instance serving
    it, its latest acknowledged checkpoint, and how much of its output was delivered."""

    session: Uuid
    epoch: Count
    state: Text
    instance: str | None
    instance_name: str | None
    checkpoint: dict[str, Any] | None
    output_offset: Count
    delivered: Count
    final_length: Count | None
    failovers: Count


class ReshardOperationAnswer(WireRecord, frozen=True, kw_only=True):
    """One attempt of the move of a Shard Map to its next version (6.9, DESIGN.md section 3):
    its plans, the members that acknowledged them and those told of the decision."""

    map: Text
    from_version: Count = msgspec.field(name="from")
    to_version: Count = msgspec.field(name="to")
    attempt: PositiveInt
    state: Literal["preparing", "committed", "aborted"]
    deadline_ms: PositiveInt | None
    plans: tuple[dict[str, Any], ...]
    acknowledged: tuple[str, ...]
    informed: tuple[str, ...]
    reason: Text | None
