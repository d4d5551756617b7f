"""Block representations (spec 6.7) as HTTP responses, sent from the serving copy's file.

A whole container is the file itself: a ``FileResponse``, which the WSGI server sends with
``sendfile`` (gunicorn's ``wsgi.file_wrapper``), so its octets never pass through Python. A layer
range is a new header (a few dozen octets, from ``kvsp.container.slice_layers``) followed by one
contiguous byte range of the file, read and sent a chunk at a time; its Repr-Digest is hashed
once over the mapped file and remembered per file and range.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections import OrderedDict
from contextlib import suppress

from django.http import FileResponse, StreamingHttpResponse
from django.utils import timezone

from kvsp.container import decode, slice_layers
from kvsp.problems import ProtocolError
from kvsp.reprdigest import repr_digest_header
from kvspsite.api import KVSP_BLOCK
from workers import selectors, services, tiers
from workers.models import StoredBlock

SLICE_CHUNK = 1 << 20
_RANGE_DIGESTS_KEPT = 4096

_range_digests: OrderedDict[tuple, bytes] = OrderedDict()
_range_digests_lock = threading.Lock()


def _headers(response, block: StoredBlock, sha256: bytes) -> None:
    response["Repr-Digest"] = repr_digest_header(sha256)
    # Immutable but confidential, and cacheable no longer than the replica is listed (6.7).
    response["Cache-Control"] = (
        f"private, immutable, max-age={selectors.remaining_record_s(block, timezone.now())}"
    )
    response["Content-Type"] = KVSP_BLOCK


def _open(block: StoredBlock):
    """The serving copy's file, opened; (None, None) when the block is gone meanwhile.

    A file missing under a row that still names it was moved to another tier since the row was
    read (read it again), or is lost: a fault, after which the block is a miss.
    """
    for _ in range(2):
        try:
            # The response closes the file once it is sent.
            return open(tiers.stored_path(block), "rb"), block
        except FileNotFoundError:
            fresh = StoredBlock.objects.filter(pk=block.pk).first()
            if fresh is None:
                return None, None
            if fresh.tier == block.tier:
                if services.do_evict_after_fault(fresh, "its serving copy is missing"):
                    return None, None
                fresh = StoredBlock.objects.filter(pk=block.pk).first()
                if fresh is None:
                    return None, None
            block = fresh
    return None, None


def block_response(block: StoredBlock, layers: tuple[int, int] | None):
    """The response to a GET of ``block`` (the whole container, or ``layers`` inclusive)."""
    handle, block = _open(block)
    if handle is None:
        raise ProtocolError("kvsp-not-found", selectors.MISS_DETAIL)
    if layers is None or layers == (0, block.layer_count - 1):
        response = FileResponse(handle, content_type=KVSP_BLOCK)
        # The file's name is the node's business, not the client's.
        del response["Content-Disposition"]
        _headers(response, block, bytes(block.repr_sha256))
        return response
    return _slice_response(handle, block, *layers)


def _slice_response(handle, block: StoredBlock, first: int, last: int):
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

    def body():
        try:
            yield header
            fd, offset = handle.fileno(), start
            while offset < end:
                chunk = os.pread(fd, min(SLICE_CHUNK, end - offset), offset)
                if not chunk:
                    raise OSError("the serving copy is shorter than its header says")
                offset += len(chunk)
                yield chunk
        finally:
            handle.close()

    response = StreamingHttpResponse(body(), content_type=KVSP_BLOCK)
    response["Content-Length"] = str(len(header) + end - start)
    _headers(response, block, sha256)
    return response
