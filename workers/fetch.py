"""Retrieving a block from a holder and verifying it (spec 6.6, 6.7): the client side of a
prefetch, and of anything else that reads blocks (the benchmark uses it as is); and storing a
block at a holder (6.7), for the copies a session's instance keeps elsewhere.

The container arrives in ascending layer order (4.3). Each layer is checked against the layer
digest of the source's Replica Record the moment it completes, the whole representation against
``Repr-Digest``, and the layer digests against the replica digest. A block that fails any check
is refused as a whole; nothing of it is kept.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from kvsp.container import (
    MEDIA_TYPE,
    Container,
    ContainerStreamReader,
    store_headers,
    verify_replica_digest,
)
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

# Octets read from the socket at a time.
CHUNK = 1 << 20
# From this size on, Repr-Digest is hashed on a second thread while the layers are hashed on
# this one (hashlib releases the GIL), so the two passes the checks need overlap.
PARALLEL_HASH_MIN = 4 << 20


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


def _timeout(deadline: float | None, cap: float = 30.0) -> httpx.Timeout:
    left = _remaining(deadline)
    return httpx.Timeout(cap if left is None else min(left, cap))


def _problem(response: httpx.Response, what: str) -> ProtocolError:
    if response.status_code == 404:
        return SourceMiss(f"{what}: {response.status_code} (a miss)")
    name, detail = None, response.reason_phrase
    try:
        document = response.json()
        name = problem_name(str(document.get("type", "")))
        detail = str(document.get("detail", detail))
    except ValueError:
        pass
    if response.status_code >= 500 or name is None:
        name = "kvsp-upstream-error"
    return ProtocolError(name, f"{what}: {response.status_code} {detail}")


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


class _ReprHasher:
    """Repr-Digest over the chunks as they arrive, on a second thread for large bodies."""

    def __init__(self, parallel: bool):
        self._hasher = ReprDigestHasher()
        self._pool = ThreadPoolExecutor(max_workers=1) if parallel else None
        self._pending = None

    def update(self, chunk: bytes) -> None:
        if self._pool is None:
            self._hasher.update(chunk)
        else:
            # One worker thread runs the updates in submission order.
            self._pending = self._pool.submit(self._hasher.update, chunk)

    def digest(self) -> bytes:
        if self._pool is not None:
            if self._pending is not None:
                self._pending.result()
            self._pool.shutdown()
            self._pool = None
        return self._hasher.digest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def fetch_block(
    client: httpx.Client,
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
    """
    if expected.layer_digests is None:
        raise ProtocolError(
            "kvsp-upstream-error", "the source's record has no layer_digests to verify against"
        )
    url = f"{holder}blocks/{expected.compat_id}/{expected.scope_id}/{expected.block_key}"
    what = f"GET {url}"
    started = time.perf_counter()
    hasher: _ReprHasher | None = None
    try:
        with client.stream(
            "GET", url, headers=_bearer(token, {"Accept": KVSP_BLOCK}), timeout=_timeout(deadline)
        ) as response:
            first_byte_s = time.perf_counter() - started
            if response.status_code != 200:
                response.read()
                raise _problem(response, what)
            field = response.headers.get("Repr-Digest")
            if field is None:
                raise ProtocolError("kvsp-upstream-error", f"{what}: no Repr-Digest field")
            claimed = parse_repr_digest(field, problem="kvsp-upstream-error").get(ALGORITHM)
            if claimed is None:
                raise ProtocolError("kvsp-upstream-error", f"{what}: Repr-Digest has no sha-256")
            length = int(response.headers.get("Content-Length") or 0)
            if length > max_size:
                raise ProtocolError(
                    "kvsp-payload-too-large", f"{what}: {length} octets exceed {max_size}"
                )
            reader = ContainerStreamReader(
                max_size=max(min(max_size, length or max_size), 20),
                max_layers=len(expected.layer_digests),
                expected_layer_digests=expected.layer_digests,
                expected_first_layer=0,
            )
            hasher = _ReprHasher(parallel=length >= PARALLEL_HASH_MIN)
            for chunk in response.iter_raw(CHUNK):
                hasher.update(chunk)
                reader.feed(chunk)
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExpired("the deadline passed")
            last_octet_at = time.perf_counter()
            container = reader.finish()
            repr_sha256 = hasher.digest()
    except httpx.HTTPError as exc:
        raise _transport(exc, what, deadline) from exc
    finally:
        if hasher is not None:
            hasher.close()
    verify_repr_digest(field, sha256=repr_sha256, problem="kvsp-upstream-error")
    if container.codec != expected.codec:
        raise ProtocolError(
            "kvsp-upstream-error", f"{what}: codec {container.codec}, not {expected.codec}"
        )
    digests = reader.layer_digests
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
        repr_sha256=repr_sha256,
        layer_digests=digests,
        first_byte_s=first_byte_s,
        elapsed_s=time.perf_counter() - started,
        transfer=Transfer(
            head_at=started + first_byte_s,
            last_octet_at=last_octet_at,
            head_s=first_byte_s,
            octets=len(container.buffer),
        ),
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
