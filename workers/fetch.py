"""Retrieving a block from a holder and verifying it (spec 6.6, 6.7): the client side of a
prefetch, and of anything else that reads blocks (the benchmark uses it as is); and storing a
block at a holder (6.7), for the copies a session's instance keeps elsewhere.

The container arrives in ascending layer order (4.3). Each layer is checked against the layer
digest of the source's Replica Record the moment it completes, the whole representation against
``Repr-Digest``, and the layer digests against the replica digest. A block that fails any check
is refused as a whole; nothing of it is kept.

Requests go through the peer client (``common.peers``: httpx for leases and stores,
``BlockConnections`` for the GETs) and fail as its policy says: a holder out of reach, one that
does not answer in time or answers 5xx is ``PeerUnreachable`` (worth asking again later, or
another source now); a refusal with problem details, or octets that fail a check, a
``ProtocolError`` (final). Two answers mean more here: a 404 is a miss (``SourceMiss``, 6.1),
and a transport failure once the caller's deadline has passed is ``DeadlineExpired``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass

import httpx
import orjson

from common.peers import BlockConnections, PeerUnreachable, call, problem_details, refusal
from kvsp.container import (
    MEDIA_TYPE,
    Container,
    ContainerStreamReader,
    store_headers,
    verify_replica_digest,
)
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import LeaseGrant, LeaseRequest, ReplicaRecord
from kvsp.reprdigest import (
    ALGORITHM,
    ReprDigestHasher,
    parse_repr_digest,
    verify_repr_digest,
)
from workers.links import Transfer

# The media type of the KV Block Container (spec 11.1). This module, and the peer client it
# uses, read no Django setting, so that any client can fetch and verify blocks with it.
KVSP_BLOCK = MEDIA_TYPE

# What a holder answers a batch of blocks with (docs/api.md "Blocks in batches").
BATCH_MEDIA_TYPE = "multipart/mixed"

# Octets read from the socket at a time: a layer's digest is checked as soon as it is in.
CHUNK = 1 << 20


class DeadlineExpired(Exception):
    """The directive's deadline passed while a block was loading (6.5)."""


class SourceMiss(ProtocolError):
    """The source does not hold the block (6.1: a 404 is a miss; move on)."""

    def __init__(self, detail: str):
        super().__init__("kvsp-not-found", detail)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExpired("the deadline passed")
    return left


def _seconds(deadline: float | None, cap: float = 30.0) -> float:
    """How long one request may wait on the network: until the deadline, at most ``cap``."""
    left = _remaining(deadline)
    return cap if left is None else min(left, cap)


def _timeout(deadline: float | None, cap: float = 30.0) -> httpx.Timeout:
    return httpx.Timeout(_seconds(deadline, cap))


def _bearer(token: str | None, headers: dict | None = None) -> dict:
    """``headers`` with ``Authorization: Bearer token``; a token of None leaves the client's."""
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _refused(status: int, reason: str, body: bytes, what: str) -> ProtocolError | PeerUnreachable:
    """What a holder's answer that is not a success means: a 404 is a miss, the rest as the
    peer client's policy says."""
    if status == 404:
        return SourceMiss(f"{what}: {status} (a miss)")
    return refusal(status, problem_details(body), what, reason)


def _passed(deadline: float | None) -> bool:
    """A holder out of reach once the deadline has passed is the deadline's doing."""
    return deadline is not None and time.monotonic() >= deadline


@dataclass(frozen=True)
class Lease:
    holder: str
    grant: LeaseGrant
    round_trip_s: float


def take_lease(
    client: httpx.Client,
    holder: str,
    request: LeaseRequest,
    *,
    token: str | None = None,
    deadline: float | None = None,
) -> Lease:
    """POST leases at ``holder`` (6.6); SourceMiss when it does not hold every block.
    ``token``, when given, is the bearer token presented (here and in the calls below)."""
    what = f"lease at {holder}"
    started = time.perf_counter()
    try:
        response = call(
            client,
            "POST",
            f"{holder}leases",
            json=request.to_json(),
            headers=_bearer(token),
            timeout=_timeout(deadline, 10.0),
        )
    except PeerUnreachable as exc:
        if _passed(deadline):
            raise DeadlineExpired("the deadline passed") from exc
        raise
    elapsed = time.perf_counter() - started
    if response.status_code != 201:
        raise _refused(response.status_code, response.reason_phrase, response.content, what)
    return Lease(holder, LeaseGrant.from_json(response.json()), elapsed)


def release_lease(client: httpx.Client, lease: Lease, *, token: str | None = None) -> None:
    """DELETE the lease; a lease the holder has already let go of is fine."""
    url = f"{lease.holder}leases/{lease.grant.lease}"
    try:
        call(client, "DELETE", url, headers=_bearer(token), timeout=5.0)
    except (PeerUnreachable, ProtocolError):
        pass  # it expires on its own after its TTL


@dataclass
class FetchedBlock:
    """A verified block: its container (views into ``buffer``) and what was checked."""

    container: Container
    buffer: memoryview
    repr_sha256: bytes
    layer_digests: list[bytes]
    # From sending the request to the response's head, and to its last octet verified.
    first_byte_s: float
    elapsed_s: float
    # The body's transfer alone, for the link's figures (workers/links.py).
    transfer: Transfer

    @property
    def size(self) -> int:
        return len(self.buffer)


def fetch_block(
    connections: BlockConnections,
    holder: str,
    expected: ReplicaRecord,
    *,
    max_size: int,
    token: str | None = None,
    deadline: float | None = None,
) -> FetchedBlock:
    """GET the whole block from ``holder`` and verify it against ``expected``, the holder's
    Replica Record at the IS (6.7). Raises SourceMiss for a 404, ProtocolError for anything
    the holder got wrong (``kvsp-digest-mismatch`` for octets that fail a check), and
    DeadlineExpired when ``deadline`` (a ``time.monotonic()`` value) passes first.

    The body goes into the container's own buffer a piece at a time, as the socket delivers it;
    each layer's digest is checked as the layer completes and the representation's as each
    piece arrives, so each octet is copied once and hashed once for each digest it is under.
    """
    _check_expected(expected)
    url = f"{holder}blocks/{expected.compat_id}/{expected.scope_id}/{expected.block_key}"
    what = f"GET {url}"
    started = time.perf_counter()
    headers = _bearer(token, {"Accept": KVSP_BLOCK})
    try:
        with connections.get(url, headers, _seconds(deadline)) as response:
            head_s = time.perf_counter() - started
            if response.status_code != 200:
                raise _refused(
                    response.status_code, response.reason_phrase, response.read_all(), what
                )
            length = parse_decimal(
                response.headers.get("Content-Length") or "0",
                f"{what}: Content-Length",
                problem="kvsp-upstream-error",
            )
            if length > max_size:
                raise ProtocolError(
                    "kvsp-payload-too-large", f"{what}: {length} octets exceed {max_size}"
                )
            received = _receive(
                response.readinto,
                length or max_size,
                response.headers.get("Repr-Digest"),
                expected,
                what,
                deadline,
            )
            if response.read_all(1):
                raise ProtocolError(
                    "kvsp-invalid-container",
                    f"{what}: trailing octets after the container's {received.size} octets",
                )
    except PeerUnreachable as exc:
        if _passed(deadline):
            raise DeadlineExpired("the deadline passed") from exc
        raise
    return received.verified(expected, what, started, head_s)


def _check_expected(expected: ReplicaRecord) -> None:
    if expected.layer_digests is None:
        raise ProtocolError(
            "kvsp-upstream-error", "the source's record has no layer_digests to verify against"
        )


@dataclass
class _Received:
    """A container as it arrived, before the checks that need all of it."""

    reader: ContainerStreamReader
    container: Container
    field: str
    repr_sha256: bytes
    head_at: float
    last_octet_at: float

    @property
    def size(self) -> int:
        return len(self.container.buffer)

    def verified(self, expected, what: str, started: float, head_s: float) -> FetchedBlock:
        """The block, once Repr-Digest, the codec, the layer count and the replica digest are
        checked (each layer's digest was as it arrived)."""
        verify_repr_digest(self.field, sha256=self.repr_sha256, problem="kvsp-upstream-error")
        container = self.container
        if container.codec != expected.codec:
            raise ProtocolError(
                "kvsp-upstream-error", f"{what}: codec {container.codec}, not {expected.codec}"
            )
        digests = self.reader.layer_digests
        if container.layer_count != len(expected.layer_digests):
            raise ProtocolError(
                "kvsp-upstream-error",
                f"{what}: {container.layer_count} layers, the record lists "
                f"{len(expected.layer_digests)}",
            )
        verify_replica_digest(digests, expected.digest)
        return FetchedBlock(
            container=container,
            buffer=container.buffer,
            repr_sha256=self.repr_sha256,
            layer_digests=digests,
            first_byte_s=head_s,
            elapsed_s=time.perf_counter() - started,
            transfer=Transfer(
                head_at=self.head_at,
                last_octet_at=self.last_octet_at,
                head_s=head_s,
                octets=self.size,
            ),
        )


def _receive(
    readinto,
    length: int,
    field: str | None,
    expected: ReplicaRecord,
    what: str,
    deadline: float | None,
) -> _Received:
    """Read a container of at most ``length`` octets with ``readinto`` (which fills a view and
    says how much it wrote, 0 at the end), checking each layer against ``expected`` as it
    completes and hashing the whole for ``field``, its Repr-Digest."""
    head_at = time.perf_counter()
    if field is None:
        raise ProtocolError("kvsp-upstream-error", f"{what}: no Repr-Digest field")
    claimed = parse_repr_digest(field, problem="kvsp-upstream-error").get(ALGORITHM)
    if claimed is None:
        raise ProtocolError("kvsp-upstream-error", f"{what}: Repr-Digest has no sha-256")
    reader = ContainerStreamReader(
        max_size=max(length, 20),
        max_layers=len(expected.layer_digests),
        expected_layer_digests=expected.layer_digests,
        expected_first_layer=0,
    )
    hasher = ReprDigestHasher()
    while True:
        target = reader.get_buffer()
        if not target:
            break
        # Up to CHUNK octets at a time, straight into the container's buffer: a body that
        # trickles is seen to pass the deadline between its pieces.
        target = target[:CHUNK]
        count = readinto(target)
        if not count:
            break  # the body ended early: ``finish`` says what is missing
        hasher.update(target[:count])
        reader.buffer_updated(count)
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExpired("the deadline passed")
    last_octet_at = time.perf_counter()
    container = reader.finish()
    return _Received(reader, container, field, hasher.digest(), head_at, last_octet_at)


# The most octets of a part's header fields, and of a miss's problem details, in a batch.
_PART_HEAD_OCTETS = 8192
_PROBLEM_OCTETS = 1 << 16


class BatchRefused(Exception):
    """The holder answered, not with the batch: ask for each block on its own. ``unsupported``
    when its answer says it has no such resource (a holder that speaks the spec alone), so that
    it is not asked for batches again."""

    def __init__(self, detail: str, status: int):
        super().__init__(detail)
        self.unsupported = status in (400, 404, 405, 406, 415, 501)


def fetch_blocks(
    connections: BlockConnections,
    holder: str,
    expected: list[ReplicaRecord],
    *,
    max_size: int,
    token: str | None = None,
    deadline: float | None = None,
) -> Iterator[tuple[ReplicaRecord, FetchedBlock | ProtocolError | PeerUnreachable]]:
    """Retrieve the blocks ``expected`` lists (one compat and scope, at ``holder``) in one
    request (docs/api.md "Blocks in batches"), each verified exactly as ``fetch_block`` verifies a
    block: as each block's part completes, (its record, the verified block or why it is
    refused: a ProtocolError, a SourceMiss for a miss, PeerUnreachable for a part that says
    5xx). Raises BatchRefused when the holder answers 4xx or 501, or with something else than
    the batch; PeerUnreachable when it is out of reach or answers another 5xx; ProtocolError
    when the answer is malformed; DeadlineExpired when the deadline passes first. After any of
    them, the blocks not yielded yet were not received."""
    for record in expected:
        _check_expected(record)
    first = expected[0]
    url = f"{holder}blocks/{first.compat_id}/{first.scope_id}"
    what = f"POST {url}"
    started = time.perf_counter()
    headers = _bearer(token, {"Accept": BATCH_MEDIA_TYPE, "Content-Type": "application/json"})
    body = orjson.dumps({"block_keys": [record.block_key for record in expected]})
    try:
        with connections.request("POST", url, headers, _seconds(deadline), body=body) as response:
            head_s = time.perf_counter() - started
            media_type, _, parameters = response.headers.get("Content-Type", "").partition(";")
            boundary = _boundary(parameters)
            if response.status_code >= 500 and response.status_code != 501:
                raise response.refusal(what)
            if (
                response.status_code != 200
                or media_type.strip().lower() != BATCH_MEDIA_TYPE
                or boundary is None
            ):
                response.read_all()
                raise BatchRefused(
                    f"{what}: {response.status_code} {media_type}", response.status_code
                )
            parts = _Parts(response, boundary, what)
            for record in expected:
                fields = parts.next_head()
                location = f"blocks/{record.compat_id}/{record.scope_id}/{record.block_key}"
                if fields.get("content-location") != location:
                    raise ProtocolError(
                        "kvsp-upstream-error", f"{what}: a part is not {location} as asked"
                    )
                part = f"{what} ({record.block_key})"
                length = parse_decimal(
                    fields.get("content-length", ""),
                    f"{part}: Content-Length",
                    problem="kvsp-upstream-error",
                )
                if fields.get("content-type", "").lower() != KVSP_BLOCK:
                    yield record, parts.problem(length, part)
                    continue
                if length > max_size:
                    raise ProtocolError(
                        "kvsp-payload-too-large", f"{part}: {length} octets exceed {max_size}"
                    )
                body_view = parts.body(length)
                try:
                    received = _receive(
                        body_view.readinto,
                        length,
                        fields.get("repr-digest"),
                        expected=record,
                        what=part,
                        deadline=deadline,
                    )
                    body_view.finish(received.size, part)
                    outcome = received.verified(record, part, started, head_s)
                except ProtocolError as exc:
                    # The part is refused; its length still says where the next one starts.
                    body_view.skip()
                    outcome = exc
                parts.end_part()
                yield record, outcome
            parts.close()
    except PeerUnreachable as exc:
        if _passed(deadline):
            raise DeadlineExpired("the deadline passed") from exc
        raise


def _boundary(parameters: str) -> str | None:
    for parameter in parameters.split(";"):
        name, _, value = parameter.strip().partition("=")
        if name.lower() == "boundary" and value:
            value = value.strip('"')
            return value if 0 < len(value) <= 70 else None
    return None


class _Parts:
    """The parts of a ``multipart/mixed`` answer as ``fetch_blocks`` reads them: each starts
    with its delimiter line and header fields, carries Content-Length octets, and ends with a
    CRLF; the close delimiter ends the body."""

    def __init__(self, response, boundary: str, what: str):
        self._response = response
        self._delimiter = f"--{boundary}\r\n".encode("ascii")
        self._close = f"--{boundary}--\r\n".encode("ascii")
        self._what = what

    def _malformed(self, why: str) -> ProtocolError:
        return ProtocolError("kvsp-upstream-error", f"{self._what}: {why}")

    def next_head(self) -> dict[str, str]:
        line = self._response.readline(len(self._delimiter) + 1)
        if line != self._delimiter:
            raise self._malformed("the answer ends or breaks off before a part asked for")
        fields: dict[str, str] = {}
        spent = 0
        while True:
            line = self._response.readline(_PART_HEAD_OCTETS + 1)
            spent += len(line)
            if spent > _PART_HEAD_OCTETS or not line.endswith(b"\r\n"):
                raise self._malformed("a part's header fields are too long or cut off")
            if line == b"\r\n":
                return fields
            name, colon, value = line[:-2].decode("latin-1").partition(":")
            if not colon or not name or name != name.strip():
                raise self._malformed("a part has a malformed header field")
            fields[name.lower()] = value.strip()

    def body(self, length: int) -> _PartBody:
        return _PartBody(self._response, length)

    def problem(self, length: int, part: str) -> ProtocolError | PeerUnreachable:
        """What the problem details a part carries instead of a block mean."""
        if length > _PROBLEM_OCTETS:
            raise self._malformed("a part's problem details are too long")
        body = _PartBody(self._response, length)
        document = body.read_all()
        self.end_part()
        status = None
        with suppress(orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            status = int(orjson.loads(document).get("status"))
        if status is None:
            return self._malformed(f"{part}: neither a block nor problem details with a status")
        return _refused(status, "", document, part)

    def end_part(self) -> None:
        if self._response.readline(3) != b"\r\n":
            raise self._malformed("a part is longer than its Content-Length")

    def close(self) -> None:
        if self._response.readline(len(self._close) + 1) != self._close:
            raise self._malformed("the answer has more parts than blocks asked for")
        if self._response.read_all(1):
            raise self._malformed("octets follow the close delimiter")


class _PartBody:
    """The octets of one part, and no more."""

    def __init__(self, response, length: int):
        self._response = response
        self.left = length

    @property
    def done(self) -> bool:
        return self.left == 0

    def readinto(self, target: memoryview) -> int:
        if not self.left:
            return 0
        count = self._response.readinto(target[: self.left])
        self.left -= count
        return count

    def read_all(self) -> bytes:
        buffer = bytearray(self.left)
        view = memoryview(buffer)
        while self.left:
            if not self.readinto(view[len(buffer) - self.left :]):
                raise ProtocolError("kvsp-upstream-error", "a part ends before its Content-Length")
        return bytes(buffer)

    def skip(self) -> None:
        scratch = memoryview(bytearray(min(self.left, CHUNK) or 1))
        while self.left:
            if not self.readinto(scratch[: min(self.left, len(scratch))]):
                raise ProtocolError("kvsp-upstream-error", "a part ends before its Content-Length")

    def finish(self, size: int, part: str) -> None:
        if self.left:
            raise ProtocolError(
                "kvsp-invalid-container",
                f"{part}: trailing octets after the container's {size} octets",
            )


def store_block(
    client: httpx.Client,
    holder: str,
    ids: tuple[bytes, bytes, bytes],
    octets: bytes,
    sha256: bytes,
    *,
    token: str | None = None,
) -> bool:
    """PUT the container ``octets`` on the block resource at ``holder`` with If-None-Match: *
    (6.7). True when the holder stored it, False when it already had a replica (412: the key
    names the prefix, so its copy serves as well); ProtocolError for a refusal, PeerUnreachable
    for a holder out of reach or answering 5xx."""
    compat_id, scope_id, block_key = ids
    url = f"{holder}blocks/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}"
    response = call(
        client,
        "PUT",
        url,
        content=octets,
        headers=_bearer(token, store_headers(sha256)),
        timeout=30.0,
    )
    if response.status_code == 412:
        return False
    if response.status_code != 201:
        raise _refused(response.status_code, response.reason_phrase, response.content, f"PUT {url}")
    return True
