"""Block representations (spec 6.7), sent from the serving copy's file.

What a GET of a block sends is a ``Representation``: an optional new header, then one contiguous
byte range of the serving copy's file. A whole container is the file itself (no header, the
whole file). A layer range is a new header (a few dozen octets, from
``kvsp.container.slice_layers``) followed by the range of the file that holds those layers; its
Repr-Digest is hashed once over the mapped file and remembered per file and range.

Two paths send it: the node's server answers a loader's GETs itself (``workers.blockpath``),
and Django's handler answers every other GET (``block_response``: a ``FileResponse`` for a whole
container, a streaming response for a range).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from typing import BinaryIO

from django.http import FileResponse, StreamingHttpResponse
from django.utils import timezone

from common.api import KVSP_BLOCK, problem_answer
from kvsp.container import decode, slice_layers
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import UINT16_MAX, UINT32_MAX
from kvsp.reprdigest import repr_digest_header
from workers import eviction, selectors, tiers
from workers.metrics import BLOCKS_SENT
from workers.models import StoredBlock

# Octets read from the serving copy at a time when it is sent in pieces.
CHUNK = 1 << 20
_RANGE_DIGESTS_KEPT = 4096

_range_digests: OrderedDict[tuple, bytes] = OrderedDict()
_range_digests_lock = threading.Lock()


@dataclass
class Representation:
    """What a block GET sends: ``header``, then octets ``[start, end)`` of ``handle``'s file,
    whose SHA-256 together is ``sha256``; ``max_age`` bounds Cache-Control (6.7). The
    representation owns ``handle``: ``close`` it once sent (``read`` does)."""

    handle: BinaryIO
    header: bytes
    start: int
    end: int
    sha256: bytes
    max_age: int

    @property
    def length(self) -> int:
        return len(self.header) + self.end - self.start

    def fields(self) -> list[tuple[str, str]]:
        """The representation's header fields (Content-Length is the server's to add)."""
        return [
            ("Content-Type", KVSP_BLOCK),
            ("Repr-Digest", repr_digest_header(self.sha256)),
            # Immutable but confidential, and cacheable no longer than the replica is listed.
            ("Cache-Control", f"private, immutable, max-age={self.max_age}"),
        ]

    def pieces(self, chunk: int = CHUNK):
        """The octets, ``chunk`` at a time (the header with the first); closes the file."""
        try:
            fd, offset, first = self.handle.fileno(), self.start, self.header
            while offset < self.end or first:
                piece = os.pread(fd, min(chunk, self.end - offset), offset)
                if not piece and offset < self.end:
                    raise OSError("the serving copy is shorter than its header says")
                offset += len(piece)
                yield first + piece if first else piece
                first = b""
        finally:
            self.close()

    def read(self) -> bytes:
        """All of the octets at once (a small block); closes the file."""
        return b"".join(self.pieces(self.length or 1))

    def close(self) -> None:
        self.handle.close()


def _layers(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, dash, last = value.partition("-")
    if not dash:
        raise ProtocolError(
            "kvsp-malformed-request", f"layers={value!r}: use layers=a-b (inclusive, a <= b)"
        )
    first = parse_decimal(first, f"layers={value!r}: a", maximum=UINT32_MAX)
    last = parse_decimal(last, f"layers={value!r}: b", maximum=UINT32_MAX)
    if first > last:
        raise ProtocolError("kvsp-malformed-request", f"layers={value}: a must not exceed b")
    return first, last


def _codec(value: str | None) -> int | None:
    if value is None:
        return None
    return parse_decimal(value, f"codec={value!r}: a codec", maximum=UINT16_MAX)


def representation_for(principal, params, ids: tuple[bytes, bytes, bytes]) -> Representation:
    """What a GET or HEAD of the block ``ids`` by ``principal`` sends, with the query
    parameters ``params`` (``layers=a-b``, ``codec=n``; 6.7); ProtocolError says why not. A
    block of a scope the principal may not read is a miss like any other."""
    layers = _layers(params.get("layers"))
    codec = _codec(params.get("codec"))
    block = selectors.read_block(principal, *ids)
    if block is None:
        raise ProtocolError("kvsp-not-found", selectors.MISS_DETAIL)
    if codec is not None and codec != block.codec:
        raise ProtocolError(
            "kvsp-unsupported-codec",
            f"this holder serves the block in codec {block.codec} only; it does not transcode",
        )
    if layers is not None and layers[1] >= block.layer_count:
        raise ProtocolError(
            "kvsp-layers-unavailable",
            f"this holder holds layers 0-{block.layer_count - 1} of the block",
        )
    return representation(block, layers)


def _open(block: StoredBlock):
    """The serving copy's file, opened; (None, None) when the block is gone meanwhile.

    A file missing under a row that still names it was moved to another tier since the row was
    read (read it again), or is lost: a fault, after which the block is a miss.
    """
    for _ in range(2):
        try:
            return open(tiers.stored_path(block), "rb"), block
        except FileNotFoundError:
            fresh = StoredBlock.objects.filter(pk=block.pk).first()
            if fresh is None:
                return None, None
            if fresh.tier == block.tier:
                if eviction.do_evict_after_fault(fresh, "its serving copy is missing"):
                    return None, None
                fresh = StoredBlock.objects.filter(pk=block.pk).first()
                if fresh is None:
                    return None, None
            block = fresh
    return None, None


def representation(block: StoredBlock, layers: tuple[int, int] | None) -> Representation:
    """What a GET of ``block`` sends (the whole container, or ``layers`` inclusive); a miss
    (ProtocolError) when the serving copy went away meanwhile."""
    handle, block = _open(block)
    if handle is None:
        raise ProtocolError("kvsp-not-found", selectors.MISS_DETAIL)
    max_age = selectors.remaining_record_s(block, timezone.now())
    if layers is None or layers == (0, block.layer_count - 1):
        try:
            size = os.fstat(handle.fileno()).st_size
        except BaseException:
            handle.close()
            raise
        return Representation(handle, b"", 0, size, bytes(block.repr_sha256), max_age)
    return _slice(handle, block, *layers, max_age)


def _slice(handle, block: StoredBlock, first: int, last: int, max_age: int) -> Representation:
    try:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        container = decode(mapping, max_layers=block.layer_count)
        header, data = slice_layers(container, first, last)
        start, end = container.data_range(first, last)
        stat = os.fstat(handle.fileno())
        key = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, first, last)
        with _range_digests_lock:
            sha256 = _range_digests.get(key)
        if sha256 is None:
            hasher = hashlib.sha256(header)
            hasher.update(data)
            sha256 = hasher.digest()
            with _range_digests_lock:
                _range_digests[key] = sha256
                while len(_range_digests) > _RANGE_DIGESTS_KEPT:
                    _range_digests.popitem(last=False)
        data.release()
        container = None
        with suppress(BufferError):
            mapping.close()
    except BaseException:
        handle.close()
        raise
    return Representation(handle, bytes(header), start, end, sha256, max_age)


def block_response(sent: Representation):
    """Django's response that sends ``sent``: the file itself for a whole container (a WSGI
    server sends it with ``wsgi.file_wrapper``), the representation's pieces for a range."""
    if not sent.header and sent.start == 0:
        response = FileResponse(sent.handle, content_type=KVSP_BLOCK)
        response.block_size = CHUNK
        # The file's name is the node's business, not the client's.
        del response["Content-Disposition"]
    else:
        response = StreamingHttpResponse(sent.pieces(), content_type=KVSP_BLOCK)
    response["Content-Length"] = str(sent.length)
    for name, value in sent.fields():
        response[name] = value
    return response


# --- Blocks in batches (docs/api.md "Blocks in batches") --------------------------------------

BATCH_MEDIA_TYPE = "multipart/mixed"
# The octets a batch's body is sent in at least, a few small blocks at a time.
_BATCH_PIECE = 1 << 20


@dataclass
class BatchBody:
    """A ``multipart/mixed`` body (RFC 2046) of one part per block asked for, in the order
    asked: a block's part is what its GET answers (the container, with Content-Type,
    Content-Length and Repr-Digest), a block this holder cannot serve is its problem details
    (404 for a miss); every part names its block resource in Content-Location. Every serving
    copy is opened before the body starts, so its length is known and no eviction can take a
    block from under it meanwhile."""

    boundary: str
    length: int
    parts: list[tuple[bytes, Representation | None]]

    @property
    def content_type(self) -> str:
        return f"{BATCH_MEDIA_TYPE}; boundary={self.boundary}"

    def pieces(self):
        """The body, in pieces of about ``_BATCH_PIECE`` octets at least: small parts are
        gathered, a large block's pieces go as they are read; closes every file."""
        pending = bytearray()
        try:
            for head, sent in self.parts:
                pending += head
                if sent is not None:
                    for piece in sent.pieces():
                        if len(piece) >= _BATCH_PIECE:
                            if pending:
                                yield bytes(pending)
                                pending.clear()
                            yield piece
                            continue
                        pending += piece
                        if len(pending) >= _BATCH_PIECE:
                            yield bytes(pending)
                            pending.clear()
                pending += b"\r\n"
            pending += f"--{self.boundary}--\r\n".encode("ascii")
            yield bytes(pending)
        finally:
            self.close()

    def close(self) -> None:
        for _, sent in self.parts:
            if sent is not None:
                sent.close()


def batch_body(principal, compat_id: bytes, scope_id: bytes, keys: list[bytes]) -> BatchBody:
    """The body that answers a batch of ``keys`` for ``principal`` (``BatchBody``): one read of
    every row (each block marked used, as its GET would), then each serving copy opened."""
    boundary = f"kvsp-{os.urandom(12).hex()}"
    blocks = selectors.read_blocks(principal, compat_id, scope_id, keys)
    parts: list[tuple[bytes, Representation | None]] = []
    length = 0
    try:
        for key in keys:
            location = f"blocks/{compat_id.hex()}/{scope_id.hex()}/{key.hex()}"
            sent = None
            try:
                block = blocks.get(key)
                if block is None:
                    raise ProtocolError("kvsp-not-found", selectors.MISS_DETAIL)
                sent = representation(block, None)
                fields = [*sent.fields(), ("Content-Length", str(sent.length))]
                size = sent.length
                problem = b""
            except ProtocolError as exc:
                _, fields, problem = problem_answer(exc, "a block batch")
                fields = [field for field in fields if field[0] != "WWW-Authenticate"]
                fields.append(("Content-Length", str(len(problem))))
                size = len(problem)
            head = f"--{boundary}\r\nContent-Location: {location}\r\n" + "".join(
                f"{name}: {value}\r\n" for name, value in fields
            )
            head = head.encode("latin-1") + b"\r\n" + problem
            parts.append((head, sent))
            length += len(head) - len(problem) + size + 2
        BLOCKS_SENT.labels("batch").inc(sum(sent is not None for _, sent in parts))
        length += len(boundary) + 6
    except BaseException:
        BatchBody(boundary, 0, parts).close()
        raise
    return BatchBody(boundary, length, parts)
