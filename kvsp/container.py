"""The KV Block Container and its digests (spec section 4.3; DESIGN.md section 5).

All integers are big-endian::

    magic "KVB1" | version u8 = 1 | flags u8 = 0 | codec u16 |
    first layer u32 | layer count u32 | token count u32 |
    layer count entries of (K length u64, V length u64) |
    data: for each layer in ascending order, its K octets then its V octets

The layer digest of layer l is SHA-256(K || V); the replica digest is the SHA-256 of the layer
digests concatenated in ascending layer order, carried as ``sha-256:<hex32>``.

The data section is never copied here. Decoding hands out memoryviews into the input; encoding
returns a small header followed by the caller's own buffers, for a writer to send with
``writelines``/``sendmsg``; a layer range is cut out of a container as a fresh header plus one
view of the contiguous data. Hashing is the only pass over the data, and because hashlib releases
the GIL for large buffers, layers can be hashed on several threads (``threads=``).

Decoders take explicit limits and raise only :class:`~kvsp.problems.ProtocolError`; no header
value makes them allocate more than the input (``decode``) or ``max_size``
(:class:`ContainerStreamReader`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from kvsp.hexids import parse_hex32
from kvsp.problems import ProtocolError
from kvsp.registries import RAW_CODEC
from kvsp.reprdigest import repr_digest_header

__all__ = [
    "DIGEST_PREFIX",
    "DIGEST_SIZE",
    "FIXED_HEADER_SIZE",
    "LENGTH_ENTRY_SIZE",
    "MAGIC",
    "MEDIA_TYPE",
    "RAW_CODEC",
    "VERSION",
    "Buffer",
    "Container",
    "ContainerStreamReader",
    "EncodedContainer",
    "Layer",
    "decode",
    "encode",
    "encode_header",
    "encode_parts",
    "encode_with_digests",
    "format_digest",
    "header_size",
    "layer_digest",
    "parse_digest",
    "replica_digest",
    "slice_layers",
    "store_headers",
    "verify_replica_digest",
]

# Anything that exports the buffer protocol with C-contiguous memory (bytes, bytearray,
# memoryview, mmap, numpy arrays) is accepted where this alias appears.
Buffer = bytes | bytearray | memoryview

MAGIC = b"KVB1"
VERSION = 1
MEDIA_TYPE = "application/kvsp-block"

_FIXED_HEADER = struct.Struct(">4sBBHIII")
FIXED_HEADER_SIZE = _FIXED_HEADER.size
_SECTION_LENGTHS = struct.Struct(">QQ")
LENGTH_ENTRY_SIZE = _SECTION_LENGTHS.size

_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF

DIGEST_PREFIX = "sha-256:"
DIGEST_SIZE = 32

# Below this much data a thread pool costs more to start than the parallel hashing saves.
_THREADED_HASH_MIN_OCTETS = 1 << 20


def header_size(layer_count: int) -> int:
    """Octets of the header of a container with ``layer_count`` layers."""
    return FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * layer_count


# -- digests -----------------------------------------------------------------------------------


def layer_digest(k: Buffer, v: Buffer) -> bytes:
    """SHA-256(K || V), the 32 raw octets; K and V are hashed in place, not concatenated."""
    hasher = hashlib.sha256(k)
    hasher.update(v)
    return hasher.digest()


def format_digest(digest: bytes) -> str:
    """The ``sha-256:<hex32>`` form of a raw SHA-256 digest."""
    if len(digest) != DIGEST_SIZE:
        raise ValueError(f"a SHA-256 digest has {DIGEST_SIZE} octets, not {len(digest)}")
    return DIGEST_PREFIX + bytes(digest).hex()


def parse_digest(
    value: object, what: str = "digest", problem: str = "kvsp-invalid-record"
) -> bytes:
    """The raw octets of a ``sha-256:<hex32>`` value; a ProtocolError otherwise."""
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX):
        raise ProtocolError(problem, f"{what} must be 'sha-256:' followed by hex32")
    return parse_hex32(value[len(DIGEST_PREFIX) :], what, problem)


def _digest_octets(value: object, what: str) -> bytes:
    """A layer digest given as 32 raw octets or as hex32 (the Replica Record's form)."""
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) != DIGEST_SIZE:
            raise ProtocolError(
                "kvsp-invalid-record", f"{what} must be {DIGEST_SIZE} octets, not {len(value)}"
            )
        return bytes(value)
    return parse_hex32(value, what)


def replica_digest(layer_digests: Iterable[bytes | str]) -> str:
    """``sha-256:<hex32>`` of the layer digests concatenated in ascending layer order.

    Each layer digest is 32 raw octets or its hex32 form, as listed in a Replica Record.
    """
    return joined_replica_digest(
        b"".join(
            _digest_octets(digest, f"layer digest {index}")
            for index, digest in enumerate(layer_digests)
        )
    )


def joined_replica_digest(joined: bytes) -> str:
    """``replica_digest`` of layer digests given concatenated, 32 octets each."""
    return format_digest(hashlib.sha256(joined).digest())


def verify_replica_digest(layer_digests: Iterable[bytes | str], digest: str) -> None:
    """Check a list of layer digests against a replica digest (spec 4.3, 6.7).

    Raises ProtocolError ``kvsp-digest-mismatch`` when they disagree.
    """
    expected = parse_digest(digest, "replica digest")
    actual = replica_digest(layer_digests)
    if not hmac.compare_digest(actual, format_digest(expected)):
        raise ProtocolError(
            "kvsp-digest-mismatch",
            f"the layer digests hash to {actual}, not to the replica digest {digest}",
        )


def _hash_layers(sections: Sequence[tuple[memoryview, memoryview]], threads: int | None) -> list:
    if threads is not None and threads < 1:
        raise ValueError("threads must be at least 1")
    total = sum(len(k) + len(v) for k, v in sections)
    if not threads or threads == 1 or len(sections) < 2 or total < _THREADED_HASH_MIN_OCTETS:
        return [layer_digest(k, v) for k, v in sections]
    # One layer is one SHA-256 chain and cannot be split; parallelism is across layers.
    with ThreadPoolExecutor(max_workers=min(threads, len(sections))) as pool:
        return list(pool.map(layer_digest, *zip(*sections, strict=True)))


def _expected_digests(
    expected: Sequence[bytes | str],
    expected_first_layer: int | None,
    first_layer: int,
    layer_count: int,
) -> list[bytes]:
    """The expected digests of layers first_layer.. in order, out of a list that starts at
    ``expected_first_layer`` (None: the list holds exactly this container's layers)."""
    if expected_first_layer is None:
        if len(expected) != layer_count:
            raise ProtocolError(
                "kvsp-digest-mismatch",
                f"{len(expected)} expected layer digests for a container of {layer_count} layers",
            )
        start = 0
    else:
        start = first_layer - expected_first_layer
        if start < 0 or start + layer_count > len(expected):
            covered = (
                f"layers {expected_first_layer}-{expected_first_layer + len(expected) - 1}"
                if expected
                else "no layers"
            )
            raise ProtocolError(
                "kvsp-digest-mismatch",
                f"the expected layer digests cover {covered}, not the container's layers "
                f"{first_layer}-{first_layer + layer_count - 1}",
            )
    return [
        _digest_octets(expected[start + i], f"layer digest of layer {first_layer + i}")
        for i in range(layer_count)
    ]


def _check_layer_digest(layer: int, actual: bytes, expected: bytes) -> None:
    # Digest comparisons never stop at the first differing octet: compare_digest throughout.
    if not hmac.compare_digest(actual, expected):
        raise ProtocolError(
            "kvsp-digest-mismatch",
            f"layer {layer} has digest {actual.hex()}, expected {expected.hex()}",
        )


# -- decoding ----------------------------------------------------------------------------------


def _octets(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Layer(NamedTuple):
    """One layer of a container: its absolute index, K and V views, and its digest if known."""

    index: int
    k: memoryview
    v: memoryview
    digest: bytes | None = None


def _parse_fixed_header(view: memoryview, max_layers: int | None) -> tuple[int, int, int, int, int]:
    magic, version, flags, codec, first_layer, layer_count, token_count = _FIXED_HEADER.unpack_from(
        view
    )
    if magic != MAGIC:
        raise ProtocolError("kvsp-invalid-container", f"magic is {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError("kvsp-invalid-container", f"unsupported container version {version}")
    if flags != 0:
        raise ProtocolError("kvsp-invalid-container", f"reserved flags are {flags:#04x}, not 0")
    if layer_count == 0:
        raise ProtocolError("kvsp-invalid-container", "a container holds at least one layer")
    if max_layers is not None and layer_count > max_layers:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"layer count {layer_count} exceeds the limit of {max_layers} layers",
        )
    if first_layer + layer_count - 1 > _U32_MAX:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"layers {first_layer} + {layer_count} run past the largest layer index",
        )
    return version, codec, first_layer, layer_count, token_count


def _section_offsets(
    table: memoryview, start: int, limit: int, too_long: Callable[[int], ProtocolError]
) -> array:
    """Where each K and V section starts, then where the data ends.

    ``offsets[2i]`` is the start of K of the i-th layer, ``offsets[2i+1]`` the start of its V,
    ``offsets[2n]`` the end of the data. Stops at the first layer whose sections would end past
    ``limit``, so lengths near 2**64 are rejected before anything is sized by them; the array
    holds 16 octets per layer, as much as the length table it comes from.
    """
    offsets = array("Q")
    position = start
    for index, (k_length, v_length) in enumerate(_SECTION_LENGTHS.iter_unpack(table)):
        end = position + k_length + v_length
        if end > limit:
            raise too_long(index)
        offsets.append(position)
        offsets.append(position + k_length)
        position = end
    offsets.append(position)
    return offsets


def _check_raw_layout(codec: int, first_layer: int, token_count: int, table: memoryview) -> None:
    """Refuse a codec raw container whose length table no ``kvsp-layout-1`` can have (4.3).

    Every section of codec raw holds token_count x kv_heads x head_dim elements (kv_heads and
    head_dim at least 1), and one container has one geometry: all K and V sections are of one
    length, a non-zero whole multiple of the token count (a container of no tokens has empty
    sections). The element type and the
    geometry themselves are the Compatibility Descriptor's (:mod:`kvsp.tensors`). Other codecs'
    sections are opaque here.
    """
    if codec != RAW_CODEC:
        return
    # One comparison of octets (a memoryview's own == goes element by element).
    octets = table.tobytes()
    if octets != octets[:8] * (len(octets) // 8):
        _raise_uneven_sections(first_layer, table)
    length = int.from_bytes(octets[:8], "big")
    if token_count == 0 and length:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"codec raw: a container of 0 tokens has empty sections, not of {length} octets",
        )
    if token_count and (length == 0 or length % token_count):
        raise ProtocolError(
            "kvsp-invalid-container",
            f"codec raw: sections of {length} octets do not hold {token_count} tokens of at "
            "least one whole element each (kvsp-layout-1)",
        )


def _raise_uneven_sections(first_layer: int, table: memoryview) -> None:
    lengths = list(_SECTION_LENGTHS.iter_unpack(table))
    for index, (k_length, v_length) in enumerate(lengths):
        layer = first_layer + index
        if k_length != v_length:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"codec raw: layer {layer} has a K section of {k_length} octets and a V section "
                f"of {v_length}; both hold the same elements (kvsp-layout-1)",
            )
        if k_length != lengths[0][0]:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"codec raw: layer {layer} has sections of {k_length} octets, layer "
                f"{first_layer} of {lengths[0][0]}; a container has one geometry",
            )


class Container:
    """A decoded KV Block Container; layers are views into ``buffer``, never copies.

    Layer digests are computed once, from the octets as they were decoded or received.
    """

    __slots__ = (
        "buffer",
        "version",
        "codec",
        "first_layer",
        "layer_count",
        "token_count",
        "header_size",
        "_offsets",
        "_layer_digests",
    )

    def __init__(
        self,
        buffer: memoryview,
        *,
        version: int,
        codec: int,
        first_layer: int,
        layer_count: int,
        token_count: int,
        offsets: array,
        layer_digests: list[bytes] | None = None,
    ):
        self.buffer = buffer
        self.version = version
        self.codec = codec
        self.first_layer = first_layer
        self.layer_count = layer_count
        self.token_count = token_count
        self.header_size = offsets[0]
        self._offsets = offsets
        self._layer_digests = layer_digests

    def __repr__(self) -> str:
        return (
            f"<Container codec={self.codec} layers {self.first_layer}-{self.last_layer} "
            f"tokens={self.token_count} size={self.size}>"
        )

    @property
    def last_layer(self) -> int:
        return self.first_layer + self.layer_count - 1

    @property
    def size(self) -> int:
        return len(self.buffer)

    def section_lengths(self, layer: int) -> tuple[int, int]:
        """K length and V length of an absolute layer index."""
        i = self._index(layer)
        offsets = self._offsets
        return offsets[2 * i + 1] - offsets[2 * i], offsets[2 * i + 2] - offsets[2 * i + 1]

    def layer(self, layer: int) -> tuple[memoryview, memoryview]:
        """K and V of an absolute layer index, as views into the container."""
        i = self._index(layer)
        offsets, buffer = self._offsets, self.buffer
        return (
            buffer[offsets[2 * i] : offsets[2 * i + 1]],
            buffer[offsets[2 * i + 1] : offsets[2 * i + 2]],
        )

    def layers(self) -> Iterator[Layer]:
        """Every layer in ascending order, with its digest when it is already known."""
        digests = self._layer_digests
        for i in range(self.layer_count):
            k, v = self.layer(self.first_layer + i)
            yield Layer(self.first_layer + i, k, v, digests[i] if digests else None)

    def data_range(self, first: int, last: int) -> tuple[int, int]:
        """Start and end offsets of the data of the inclusive layer range first..last."""
        if first > last:
            raise ProtocolError("kvsp-malformed-request", f"layer range {first}-{last} is empty")
        start = self._offsets[2 * self._index(first)]
        end = self._offsets[2 * self._index(last) + 2]
        return start, end

    def layer_digests(self, *, threads: int | None = None) -> list[bytes]:
        """The 32-octet layer digest of every layer, in ascending order."""
        if self._layer_digests is None:
            self._layer_digests = _hash_layers(
                [self.layer(self.first_layer + i) for i in range(self.layer_count)], threads
            )
        return list(self._layer_digests)

    def digest(self, *, threads: int | None = None) -> str:
        """The replica digest over this container's layers (spec 4.3)."""
        return replica_digest(self.layer_digests(threads=threads))

    def verify_layer_digests(
        self,
        expected: Sequence[bytes | str],
        *,
        expected_first_layer: int | None = None,
        threads: int | None = None,
    ) -> list[bytes]:
        """Check every layer against its expected digest and return the layer digests.

        ``expected`` holds raw or hex32 digests. With ``expected_first_layer`` None it lists
        exactly this container's layers; otherwise it starts at that layer, as a Replica
        Record's ``layer_digests`` starts at 0, and must cover the container's layers.
        Raises ProtocolError ``kvsp-digest-mismatch``.
        """
        wanted = _expected_digests(
            expected, expected_first_layer, self.first_layer, self.layer_count
        )
        actual = self.layer_digests(threads=threads)
        for i, (have, want) in enumerate(zip(actual, wanted, strict=True)):
            _check_layer_digest(self.first_layer + i, have, want)
        return actual

    def inspect(self, *, threads: int | None = None) -> dict:
        """The header fields and digests, in the JSON shape of ``kvsp container inspect``."""
        digests = self.layer_digests(threads=threads)
        return {
            "version": self.version,
            "codec": self.codec,
            "first_layer": self.first_layer,
            "layer_count": self.layer_count,
            "token_count": self.token_count,
            "layer_digests": [digest.hex() for digest in digests],
            "digest": replica_digest(digests),
        }

    def _index(self, layer: int) -> int:
        if not self.first_layer <= layer <= self.last_layer:
            raise ProtocolError(
                "kvsp-layers-unavailable",
                f"layer {layer} is not in this container "
                f"(layers {self.first_layer}-{self.last_layer})",
            )
        return layer - self.first_layer


def decode(
    data: Buffer, *, max_size: int | None = None, max_layers: int | None = None
) -> Container:
    """Validate a whole container and return views into ``data``.

    The length table must account for every octet after the header: truncation and trailing
    octets are both errors. Raises ProtocolError ``kvsp-invalid-container``, or
    ``kvsp-payload-too-large`` when ``data`` is longer than ``max_size``. Receivers should pass
    the model's layer count as ``max_layers``; without it the layer count is bounded only by the
    length of ``data``. The codec is not looked up; for codec raw the length table must be one
    that layout ``kvsp-layout-1`` can have (every section of one length, a whole multiple of
    the token count), and :mod:`kvsp.tensors` checks the geometry a descriptor states; other
    codecs' sections are opaque octets.
    """
    view = _octets(data)
    size = len(view)
    if max_size is not None and size > max_size:
        raise ProtocolError(
            "kvsp-payload-too-large", f"container of {size} octets exceeds {max_size}"
        )
    if size < FIXED_HEADER_SIZE:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"truncated header: {size} octets, the fixed header alone has {FIXED_HEADER_SIZE}",
        )
    version, codec, first_layer, layer_count, token_count = _parse_fixed_header(view, max_layers)
    table_end = header_size(layer_count)
    if table_end > size:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"truncated header: {layer_count} layers need a {table_end}-octet header, "
            f"the container has {size} octets",
        )

    def truncated(index: int) -> ProtocolError:
        return ProtocolError(
            "kvsp-invalid-container",
            f"truncated: layer {first_layer + index} ends past the end of the container "
            f"({size} octets)",
        )

    table = view[FIXED_HEADER_SIZE:table_end]
    offsets = _section_offsets(table, table_end, size, truncated)
    if offsets[-1] != size:
        raise ProtocolError(
            "kvsp-invalid-container",
            f"{size - offsets[-1]} trailing octets after the last layer",
        )
    _check_raw_layout(codec, first_layer, token_count, table)
    return Container(
        view,
        version=version,
        codec=codec,
        first_layer=first_layer,
        layer_count=layer_count,
        token_count=token_count,
        offsets=offsets,
    )


# -- encoding ----------------------------------------------------------------------------------


def encode_header(
    codec: int, first_layer: int, token_count: int, section_lengths: Sequence[tuple[int, int]]
) -> bytes:
    """The header of a container whose layers have these (K length, V length) pairs."""
    layer_count = len(section_lengths)
    if not 0 <= codec <= _U16_MAX:
        raise ValueError(f"codec {codec} does not fit in 16 bits")
    if not 0 <= token_count <= _U32_MAX:
        raise ValueError(f"token count {token_count} does not fit in 32 bits")
    if layer_count == 0:
        raise ValueError("a container holds at least one layer")
    if first_layer < 0 or first_layer + layer_count - 1 > _U32_MAX:
        raise ValueError(f"layers {first_layer} + {layer_count} do not fit in 32 bits")
    lengths = [length for pair in section_lengths for length in pair]
    if any(not 0 <= length <= _U64_MAX for length in lengths):
        raise ValueError("section lengths must fit in 64 bits")
    return _FIXED_HEADER.pack(
        MAGIC, VERSION, 0, codec, first_layer, layer_count, token_count
    ) + struct.pack(f">{len(lengths)}Q", *lengths)


def _sections(layers: Sequence[tuple[Buffer, Buffer]]) -> list[tuple[memoryview, memoryview]]:
    return [(_octets(k), _octets(v)) for k, v in layers]


def encode_parts(
    codec: int, first_layer: int, token_count: int, layers: Sequence[tuple[Buffer, Buffer]]
) -> list[bytes | memoryview]:
    """The container as [header, K of the first layer, its V, K of the next, ...].

    The sections are views of the caller's buffers, so nothing is copied; send the list with
    ``writelines``/``sendmsg``, or join it once with :func:`encode`. The caller keeps the
    buffers unchanged until the parts are sent.
    """
    sections = _sections(layers)
    header = encode_header(codec, first_layer, token_count, [(len(k), len(v)) for k, v in sections])
    parts: list[bytes | memoryview] = [header]
    for k, v in sections:
        parts.append(k)
        parts.append(v)
    return parts


def encode(
    codec: int, first_layer: int, token_count: int, layers: Sequence[tuple[Buffer, Buffer]]
) -> bytes:
    """The container as one bytes object: the data is copied exactly once."""
    return b"".join(encode_parts(codec, first_layer, token_count, layers))


@dataclass(frozen=True, slots=True)
class EncodedContainer:
    """An encoded container as parts (see :func:`encode_parts`) with its layer digests."""

    parts: list[bytes | memoryview]
    layer_digests: list[bytes]
    size: int

    @property
    def digest(self) -> str:
        """The replica digest over the encoded layers."""
        return replica_digest(self.layer_digests)

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


def encode_with_digests(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[Buffer, Buffer]],
    *,
    threads: int | None = None,
) -> EncodedContainer:
    """Encode as parts and compute the layer digests in the same single pass over the data."""
    parts = encode_parts(codec, first_layer, token_count, layers)
    sections = list(zip(parts[1::2], parts[2::2], strict=True))
    size = sum(len(part) for part in parts)
    return EncodedContainer(parts, _hash_layers(sections, threads), size)


def slice_layers(container: Container, first: int, last: int) -> list[bytes | memoryview]:
    """The inclusive layer range first..last of ``container`` as [header, data view].

    The layers' data are contiguous in the container, so the result is a fresh header and one
    view of the existing data; nothing is re-encoded or copied. Raises ProtocolError
    ``kvsp-layers-unavailable`` when the range is not inside the container (spec 6.7).
    """
    start, end = container.data_range(first, last)
    lengths = [container.section_lengths(layer) for layer in range(first, last + 1)]
    header = encode_header(container.codec, first, container.token_count, lengths)
    return [header, container.buffer[start:end]]


# -- streaming ---------------------------------------------------------------------------------

_FIXED = "fixed header"
_TABLE = "length table"
_DATA = "data"
_DONE = "done"


class ContainerStreamReader:
    """Receives a container in chunks and hands out each layer as soon as it is complete.

    Octets are written once into one buffer of the container's total size, allocated when the
    length table has arrived (never larger than ``max_size``). Each layer is hashed as its octets
    arrive and, when ``expected_layer_digests`` is given, checked the moment it completes, so a
    receiver can start using layer l while later layers are still in flight.

    Two ways to give it octets: ``feed(chunk)`` copies a chunk in; ``get_buffer()`` and
    ``buffer_updated(n)`` (the shape of ``asyncio.BufferedProtocol``) let the caller receive
    straight into the reader's buffer, e.g. with ``socket.recv_into``. Either returns the layers
    that became complete, in ascending order. ``finish()`` checks nothing is missing and
    returns the :class:`Container`. After an error every call raises it again.
    """

    def __init__(
        self,
        *,
        max_size: int,
        max_layers: int | None = None,
        expected_layer_digests: Sequence[bytes | str] | None = None,
        expected_first_layer: int | None = None,
        compute_digests: bool = True,
    ):
        if max_size < FIXED_HEADER_SIZE:
            raise ValueError(f"max_size must be at least {FIXED_HEADER_SIZE} octets")
        self.max_size = max_size
        self.max_layers = max_layers
        # Malformed expectations are the caller's to hear about now, not mid-stream; whether
        # they cover the container's layers is known only once its header has arrived.
        self._expected_source = (
            None
            if expected_layer_digests is None
            else [
                _digest_octets(digest, f"expected layer digest {index}")
                for index, digest in enumerate(expected_layer_digests)
            ]
        )
        self._expected_first_layer = expected_first_layer
        self._expected: list[bytes] | None = None
        self._hashing = compute_digests or expected_layer_digests is not None

        self._buffer = bytearray(FIXED_HEADER_SIZE)
        self._view = memoryview(self._buffer)
        self._filled = 0
        self._target = FIXED_HEADER_SIZE
        self._state = _FIXED
        self._error: ProtocolError | None = None

        self.version: int | None = None
        self.codec: int | None = None
        self.first_layer: int | None = None
        self.layer_count: int | None = None
        self.token_count: int | None = None
        self.header_size: int | None = None
        self.size: int | None = None
        self._offsets: array | None = None
        self._next = 0
        self._hash_position = 0
        self._hasher = hashlib.sha256()
        self._digests: list[bytes] = []
        self._container: Container | None = None

    @property
    def received(self) -> int:
        return self._filled

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next octets go: exactly the octets still needed for the current step.

        Empty once the container is complete. A view returned earlier must not be written
        after ``buffer_updated``: the buffer is replaced when the header is complete.
        """
        self._raise_if_failed()
        return self._view[self._filled : self._target]

    def buffer_updated(self, nbytes: int) -> list[Layer]:
        """``nbytes`` octets were written at the start of the last ``get_buffer()`` view."""
        self._raise_if_failed()
        if not 0 <= nbytes <= self._target - self._filled:
            raise ValueError(f"{nbytes} octets do not fit the buffer that was handed out")
        self._filled += nbytes
        try:
            return self._advance()
        except ProtocolError as error:
            self._error = error
            raise

    def feed(self, chunk: Buffer) -> list[Layer]:
        """Copy ``chunk`` in and return the layers it completed."""
        self._raise_if_failed()
        data = _octets(chunk)
        completed: list[Layer] = []
        while data:
            target = self.get_buffer()
            if not target:
                self._error = ProtocolError(
                    "kvsp-invalid-container",
                    f"trailing octets after the container's {self.size} octets",
                )
                raise self._error
            n = min(len(target), len(data))
            target[:n] = data[:n]
            data = data[n:]
            completed += self.buffer_updated(n)
        return completed

    @property
    def layer_digests(self) -> list[bytes]:
        """The digests of the layers completed so far."""
        return list(self._digests)

    def finish(self) -> Container:
        """The complete container; ProtocolError when octets are missing."""
        self._raise_if_failed()
        if self._state != _DONE:
            if self.size is None:
                detail = f"truncated header: the stream ended after {self._filled} octets"
            else:
                detail = f"truncated: received {self._filled} of {self.size} octets"
            self._error = ProtocolError("kvsp-invalid-container", detail)
            raise self._error
        if self._container is None:
            assert self._offsets is not None and self.version is not None
            self._container = Container(
                self._view,
                version=self.version,
                codec=self.codec,
                first_layer=self.first_layer,
                layer_count=self.layer_count,
                token_count=self.token_count,
                offsets=self._offsets,
                layer_digests=list(self._digests) if self._hashing else None,
            )
        return self._container

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _advance(self) -> list[Layer]:
        if self._state == _FIXED and self._filled == self._target:
            self._read_fixed_header()
        if self._state == _TABLE and self._filled == self._target:
            self._read_length_table()
        if self._state != _DATA:
            return []
        completed = self._complete_layers()
        if self._filled == self._target:
            self._state = _DONE
        return completed

    def _read_fixed_header(self) -> None:
        version, codec, first_layer, layer_count, token_count = _parse_fixed_header(
            self._view, self.max_layers
        )
        table_end = header_size(layer_count)
        if table_end > self.max_size:
            raise ProtocolError(
                "kvsp-payload-too-large",
                f"{layer_count} layers need a {table_end}-octet header, "
                f"more than the limit of {self.max_size} octets",
            )
        if self._expected_source is not None:
            self._expected = _expected_digests(
                self._expected_source, self._expected_first_layer, first_layer, layer_count
            )
        self.version, self.codec = version, codec
        self.first_layer, self.layer_count, self.token_count = (
            first_layer,
            layer_count,
            token_count,
        )
        self._replace_buffer(table_end)
        self._state = _TABLE

    def _read_length_table(self) -> None:
        table_end = self._target
        max_size = self.max_size

        def too_large(index: int) -> ProtocolError:
            return ProtocolError(
                "kvsp-payload-too-large",
                f"layer {self.first_layer + index} ends past the limit of {max_size} octets",
            )

        table = self._view[FIXED_HEADER_SIZE:table_end]
        self._offsets = _section_offsets(table, table_end, max_size, too_large)
        # Before the data's buffer is allocated: nothing of a container that cannot be is kept.
        _check_raw_layout(self.codec, self.first_layer, self.token_count, table)
        self.header_size = table_end
        self.size = self._offsets[-1]
        self._replace_buffer(self.size)
        self._hash_position = table_end
        self._state = _DATA

    def _replace_buffer(self, size: int) -> None:
        # Only the header (at most one length table) is ever copied; the data go straight
        # into the final buffer.
        buffer = bytearray(size)
        buffer[: self._filled] = self._view[: self._filled]
        self._buffer = buffer
        self._view = memoryview(buffer)
        self._target = size

    def _complete_layers(self) -> list[Layer]:
        offsets, view, filled = self._offsets, self._view, self._filled
        completed = []
        while self._next < self.layer_count:
            i = self._next
            end = offsets[2 * i + 2]
            if self._hashing:
                upto = min(filled, end)
                if upto > self._hash_position:
                    self._hasher.update(view[self._hash_position : upto])
                    self._hash_position = upto
            if filled < end:
                break
            layer = self.first_layer + i
            digest = None
            if self._hashing:
                digest = self._hasher.digest()
                self._hasher = hashlib.sha256()
                if self._expected is not None:
                    _check_layer_digest(layer, digest, self._expected[i])
                self._digests.append(digest)
            completed.append(
                Layer(
                    layer,
                    view[offsets[2 * i] : offsets[2 * i + 1]],
                    view[offsets[2 * i + 1] : end],
                    digest,
                )
            )
            self._next += 1
        return completed


def store_headers(sha256: bytes) -> dict[str, str]:
    """The fields of a PUT that stores a container of digest ``sha256`` at a holder (6.7):
    never replacing a replica, and with the Repr-Digest the holder checks the body against."""
    return {
        "Content-Type": MEDIA_TYPE,
        "If-None-Match": "*",
        "Repr-Digest": repr_digest_header(sha256),
    }
