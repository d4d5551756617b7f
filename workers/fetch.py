"""Retrieving a block from a holder and verifying it (spec 6.6, 6.7): the client side of a
prefetch, and of anything else that reads blocks (the benchmark uses it as is); and storing a
block at a holder (6.7), for the copies a session's instance keeps elsewhere.

The container arrives in ascending layer order (4.3). Each layer is checked against the layer
digest of the source's Replica Record the moment it completes, the whole representation against
``Repr-Digest``, and the layer digests against the replica digest. A block that fails any check
is refused as a whole; nothing of it is kept.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import orjson

from kvsp.container import (
    MEDIA_TYPE,
    Container,
    ContainerStreamReader,
    store_headers,
    verify_replica_digest,
)
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError, problem_name
from kvsp.records import LeaseGrant, LeaseRequest, ReplicaRecord
from kvsp.reprdigest import (
    ALGORITHM,
    ReprDigestHasher,
    parse_repr_digest,
    verify_repr_digest,
)
from workers.links import Transfer

# The media type of the KV Block Container (spec 11.1). This module needs nothing of Django,
# so that any client can fetch and verify blocks with it.
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


def _problem(response: httpx.Response, what: str) -> ProtocolError:
    return _problem_of(response.status_code, response.reason_phrase, response.content, what)


def _bearer(token: str | None, headers: dict | None = None) -> dict:
    """``headers`` with ``Authorization: Bearer token``; a token of None leaves the client's."""
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _transport(exc: httpx.HTTPError, what: str, deadline: float | None) -> Exception:
    if deadline is not None and time.monotonic() >= deadline:
        return DeadlineExpired("the deadline passed")
    return ProtocolError("kvsp-upstream-error", f"{what}: {exc.__class__.__name__}")


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
        response = client.post(
            f"{holder}leases",
            json=request.to_json(),
            headers=_bearer(token),
            timeout=_timeout(deadline, 10.0),
        )
    except httpx.HTTPError as exc:
        raise _transport(exc, what, deadline) from exc
    elapsed = time.perf_counter() - started
    if response.status_code != 201:
        raise _problem(response, what)
    return Lease(holder, LeaseGrant.from_json(response.json()), elapsed)


def release_lease(client: httpx.Client, lease: Lease, *, token: str | None = None) -> None:
    """DELETE the lease; a lease the holder has already let go of is fine."""
    try:
        client.delete(
            f"{lease.holder}leases/{lease.grant.lease}", headers=_bearer(token), timeout=5.0
        )
    except httpx.HTTPError:
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


class BlockConnections:
    """Kept-alive HTTP/1.1 connections for block GETs, shared by any number of threads: each
    GET takes an idle connection to its origin (or opens one) and gives it back once the body
    is read to its end.

    The standard library's client rather than httpx for this one request, the loader's
    hundreds per second: it costs a fraction of httpx's CPU per request, which on a node's few
    cores is time taken from the GETs in flight beside it, and it hands a body over as the
    socket delivers it, with none of httpx's re-chunking.
    """

    def __init__(self, headers: dict[str, str] | None = None):
        self.headers = dict(headers or {})
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def __enter__(self) -> BlockConnections:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def get(self, url: str, headers: dict[str, str], timeout: float):
        """GET ``url``; the response, whose body the caller reads with ``readinto``. The
        connection goes back to the idle ones only when its response was read to the end."""
        return self.request("GET", url, headers, timeout)

    @contextmanager
    def request(
        self, method: str, url: str, headers: dict[str, str], timeout: float, body=None
    ) -> Iterator[_Response]:
        """``method`` on ``url`` with ``body``, as ``get``: only for requests that are safe to
        send again (a GET, or a POST that only reads, such as a batch of blocks)."""
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ProtocolError("kvsp-upstream-error", f"not an http(s) URL: {url}")
        origin = (parts.scheme, parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme])
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        fields = {**self.headers, **headers}
        connection, reused = self._take(origin, timeout)
        response = None
        try:
            try:
                connection.request(method, target, body=body, headers=fields)
                raw = connection.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                # The origin closed the idle connection meanwhile: the request is safe to send
                # again.
                connection.close()
                connection, _ = self._take(origin, timeout, fresh=True)
                connection.request(method, target, body=body, headers=fields)
                raw = connection.getresponse()
            response = _Response(raw)
            yield response
        finally:
            if response is not None and response.reusable:
                self._give_back(origin, connection)
            else:
                connection.close()

    def _take(
        self, origin: tuple[str, str, int], timeout: float, *, fresh: bool = False
    ) -> tuple[http.client.HTTPConnection, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(origin)
                connection = idle.pop() if idle else None
            if connection is not None:
                connection.timeout = timeout
                if connection.sock is not None:
                    connection.sock.settimeout(timeout)
                return connection, True
        scheme, host, port = origin
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            return http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._tls
            ), False
        return http.client.HTTPConnection(host, port, timeout=timeout), False

    def _give_back(self, origin: tuple[str, str, int], connection) -> None:
        with self._lock:
            self._idle.setdefault(origin, []).append(connection)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Response:
    """What ``BlockConnections.get`` answers: the status, the fields, and the body."""

    def __init__(self, raw: http.client.HTTPResponse):
        self._raw = raw
        self._abandoned = False
        self.status_code = raw.status
        self.reason_phrase = raw.reason
        self.headers = raw.headers

    @property
    def reusable(self) -> bool:
        """The body was read to its end and the origin keeps the connection open."""
        return self._raw.isclosed() and not self._raw.will_close and not self._abandoned

    def readinto(self, target: memoryview) -> int:
        """Read the body into ``target`` until it is full or the body ends; the octets read.
        Past what the client buffered, the socket writes into ``target`` itself."""
        return self._raw.readinto(target)

    def readline(self, limit: int) -> bytes:
        """One line of the body, with its line end, of at most ``limit`` octets."""
        return self._raw.readline(limit)

    def read_all(self, limit: int = 1 << 16) -> bytes:
        """The (short) body of an answer that is not a block, at most ``limit`` octets."""
        data = self._raw.read(limit)
        if not self._raw.isclosed():
            self._abandoned = True  # octets are left unread: the connection is not reused
        return data


def _problem_of(status_code: int, reason: str, body: bytes, what: str) -> ProtocolError:
    if status_code == 404:
        return SourceMiss(f"{what}: {status_code} (a miss)")
    name, detail = None, reason
    try:
        document = orjson.loads(body)
        name = problem_name(str(document.get("type", "")))
        detail = str(document.get("detail", detail))
    except (orjson.JSONDecodeError, AttributeError):
        pass
    if status_code >= 500 or name is None:
        name = "kvsp-upstream-error"
    return ProtocolError(name, f"{what}: {status_code} {detail}")


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
                raise _problem_of(
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
    except (OSError, http.client.HTTPException) as exc:
        raise _transport_failure(exc, what, deadline) from exc
    return received.verified(expected, what, started, head_s)


def _check_expected(expected: ReplicaRecord) -> None:
    if expected.layer_digests is None:
        raise ProtocolError(
            "kvsp-upstream-error", "the source's record has no layer_digests to verify against"
        )


def _transport_failure(exc: Exception, what: str, deadline: float | None) -> Exception:
    if deadline is not None and time.monotonic() >= deadline:
        return DeadlineExpired("the deadline passed")
    return ProtocolError("kvsp-upstream-error", f"{what}: {exc.__class__.__name__}")


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
    """The holder did not answer with the batch: ask for each block on its own. ``unsupported``
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
) -> Iterator[tuple[ReplicaRecord, FetchedBlock | ProtocolError]]:
    """Retrieve the blocks ``expected`` lists (one compat and scope, at ``holder``) in one
    request (docs/api.md "Blocks in batches"), each verified exactly as ``fetch_block`` verifies a
    block: as each block's part completes, (its record, the verified block or the
    ProtocolError it is refused with: a SourceMiss for a miss). Raises BatchRefused when the
    holder answers otherwise than with the batch, ProtocolError when the answer breaks off or
    is malformed (the blocks not yielded yet were not received), DeadlineExpired when the
    deadline passes first."""
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
    except (OSError, http.client.HTTPException) as exc:
        raise _transport_failure(exc, what, deadline) from exc


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

    def problem(self, length: int, part: str) -> ProtocolError:
        """The problem details a part carries instead of a block."""
        if length > _PROBLEM_OCTETS:
            raise self._malformed("a part's problem details are too long")
        body = _PartBody(self._response, length)
        document = body.read_all()
        self.end_part()
        status = 502
        with suppress(orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            status = int(orjson.loads(document).get("status", 502))
        return _problem_of(status, "", document, part)

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
    names the prefix, so its copy serves as well); ProtocolError for a refusal."""
    compat_id, scope_id, block_key = ids
    url = f"{holder}blocks/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}"
    try:
        response = client.put(
            url,
            content=octets,
            headers=_bearer(token, store_headers(sha256)),
            timeout=30.0,
        )
    except httpx.HTTPError as exc:
        raise _transport(exc, f"PUT {url}", None) from exc
    if response.status_code == 412:
        return False
    if response.status_code != 201:
        raise _problem(response, f"PUT {url}")
    return True
