"""What a node asks of the control plane, over the same HTTP API any holder would use (DESIGN.md
section 3), with the node's token: publish and withdraw Replica Records (6.1; many at once
through the batch form where the control plane has it), read the records of blocks it is about
to fetch (6.2), read Compatibility Descriptors (4.1), report its status (6.3), read scope keys
(4.2), and publish the checkpoints and output tokens of the sessions it serves (6.8).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import orjson
from django.conf import settings

from kvsp.blockkeys import scope_id as scope_id_of
from kvsp.problems import ProtocolError, problem_name
from kvsp.records import InstanceStatusRecord, ReplicaRecord, SessionCheckpoint
from kvspsite.peers import PeerUnreachable, call, peer_client, raise_for_problem

CONTROL_TIMEOUT = httpx.Timeout(10.0, connect=2.0)

_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def client() -> httpx.Client:
    """One pooled client per process: keep-alive connections to the control plane and peers
    (a forked process gets its own)."""
    pid = os.getpid()
    with _clients_lock:
        existing = _clients.get(pid)
        if existing is None:
            existing = _clients[pid] = peer_client(timeout=CONTROL_TIMEOUT)
        return existing


def _base() -> str:
    if not settings.KVSP_CONTROL_URL:
        raise PeerUnreachable("KVSP_CONTROL_URL is not configured")
    return settings.KVSP_CONTROL_URL


def _replica_path(compat_id: bytes, scope_id: bytes, block_key: bytes) -> str:
    return f"{_base()}replicas/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}"


def publish(record: ReplicaRecord) -> int:
    """PUT the record (6.1); the TTL the IS granted (it caps the one asked for)."""
    path = _replica_path(record.compat_id_bytes, record.scope_id_bytes, record.block_key_bytes)
    response = raise_for_problem(call(client(), "PUT", path, json=record.to_json()))
    return int(response.json().get("ttl_ms", record.ttl_ms))


@dataclass(frozen=True)
class PublishOutcome:
    """What the IS made of one record: the TTL it granted, or why it was not published."""

    record: ReplicaRecord
    ttl_ms: int | None = None
    error: ProtocolError | PeerUnreachable | None = None

    @property
    def published(self) -> bool:
        return self.error is None


# Records published at the same time where the control plane takes them one PUT each.
PUBLISH_PARALLEL = 8
# What a control plane that speaks only the spec answers to POST replicas: no such route.
_NO_BATCH_ROUTE = (404, 405)
# How long such a control plane is sent single PUTs before the batch route is tried again (it
# may have been upgraded meanwhile).
_NO_BATCH_ROUTE_RETRY_S = 300.0
_no_batch_route_until: dict[str, float] = {}
# Room for {"records": [...]} around the records themselves.
_BATCH_ENVELOPE_OCTETS = 64


def publish_replicas(records: list[ReplicaRecord]) -> list[PublishOutcome]:
    """Publish many records (6.1) in as few requests as the control plane takes: ``POST CP
    replicas`` (DESIGN.md section 3) in chunks of at most KVSP_MAX_BATCH_RECORDS records and
    KVSP_MAX_BODY_OCTETS octets, or single PUTs where the control plane has no batch route.
    One outcome per record, in order; a record the IS refused, or could not be asked about,
    is an outcome with its error rather than an exception."""
    if not records:
        return []
    try:
        url = f"{_base()}replicas"
    except PeerUnreachable as unreachable:
        return [PublishOutcome(record, error=unreachable) for record in records]
    if len(records) == 1 or time.monotonic() < _no_batch_route_until.get(url, 0.0):
        return _publish_each(records)  # the spec's own request for a single record
    encoded = [orjson.dumps(record.to_json()) for record in records]
    outcomes: list[PublishOutcome] = []
    start = 0
    for end in _chunk_ends(encoded):
        outcomes += _publish_chunk(url, records[start:end], encoded[start:end])
        start = end
    return outcomes


def _chunk_ends(encoded: list[bytes]) -> Iterator[int]:
    """Where each chunk of ``encoded`` records ends: as many as a batch may carry."""
    most_records = max(settings.KVSP_MAX_BATCH_RECORDS, 1)
    most_octets = settings.DATA_UPLOAD_MAX_MEMORY_SIZE - _BATCH_ENVELOPE_OCTETS
    count = octets = 0
    for index, body in enumerate(encoded):
        if count and (count == most_records or octets + len(body) + 1 > most_octets):
            yield index
            count = octets = 0
        count += 1
        octets += len(body) + 1
    yield len(encoded)


def _publish_chunk(url: str, records: list, encoded: list[bytes]) -> list[PublishOutcome]:
    body = b'{"records":[' + b",".join(encoded) + b"]}"
    try:
        response = call(
            client(),
            "POST",
            url,
            content=body,
            headers={"Content-Type": "application/kvsp+json"},
        )
        if response.status_code in _NO_BATCH_ROUTE:
            _no_batch_route_until[url] = time.monotonic() + _NO_BATCH_ROUTE_RETRY_S
            return _publish_each(records)
        if response.status_code == 413 and len(records) > 1:  # a smaller body limit there
            half = len(records) // 2
            return _publish_chunk(url, records[:half], encoded[:half]) + _publish_chunk(
                url, records[half:], encoded[half:]
            )
        results = raise_for_problem(response).json().get("results")
        if not isinstance(results, list) or len(results) != len(records):
            raise ProtocolError("kvsp-upstream-error", f"{url}: the answer lists other results")
    except ValueError:
        failure = ProtocolError("kvsp-upstream-error", f"{url}: the answer is not JSON")
        return [PublishOutcome(record, error=failure) for record in records]
    except (ProtocolError, PeerUnreachable) as failure:
        return [PublishOutcome(record, error=failure) for record in records]
    return [_outcome(url, record, result) for record, result in zip(records, results, strict=True)]


def _outcome(url: str, record: ReplicaRecord, result: object) -> PublishOutcome:
    """One record's outcome from its entry in a batch answer."""
    result = result if isinstance(result, dict) else {}
    status = result.get("status")
    if status in (200, 201):
        granted = result.get("ttl_ms")
        return PublishOutcome(record, ttl_ms=granted if type(granted) is int else record.ttl_ms)
    problem = result.get("problem") if isinstance(result.get("problem"), dict) else {}
    detail = f"{url}: {record.block_key}: {problem.get('detail', 'refused')}"
    if type(status) is int and status >= 500:
        return PublishOutcome(record, error=PeerUnreachable(detail))
    name = problem_name(str(problem.get("type", ""))) or "kvsp-upstream-error"
    status = status if type(status) is int and 400 <= status < 500 else None
    return PublishOutcome(record, error=ProtocolError(name, detail, status=status))


def _publish_one(record: ReplicaRecord) -> PublishOutcome:
    try:
        return PublishOutcome(record, ttl_ms=publish(record))
    except (ProtocolError, PeerUnreachable) as failure:
        return PublishOutcome(record, error=failure)


def _publish_each(records: list[ReplicaRecord]) -> list[PublishOutcome]:
    if len(records) == 1:
        return [_publish_one(records[0])]
    with ThreadPoolExecutor(max_workers=min(PUBLISH_PARALLEL, len(records))) as pool:
        return list(pool.map(_publish_one, records))


def withdraw(compat_id: bytes, scope_id: bytes, block_key: bytes) -> None:
    """DELETE this node's record of a replica (6.1); a record the IS no longer has is fine."""
    response = call(
        client(),
        "DELETE",
        _replica_path(compat_id, scope_id, block_key),
        params={"holder": settings.KVSP_PUBLIC_URL},
    )
    if response.status_code != 404:
        raise_for_problem(response)


def _records(blocks: list) -> dict[str, dict[str, ReplicaRecord]]:
    found: dict[str, dict[str, ReplicaRecord]] = {}
    for block in blocks:
        for replica in block.get("replicas", []):
            record = ReplicaRecord.from_json(replica)
            found.setdefault(record.block_key, {})[record.holder] = record
    return found


def replicas(compat_id: bytes, scope_id: bytes, block_key: bytes) -> dict[str, ReplicaRecord]:
    """The unexpired records of one block, by holder; none when the IS lists none."""
    response = call(client(), "GET", _replica_path(compat_id, scope_id, block_key))
    if response.status_code == 404:
        return {}
    raise_for_problem(response)
    return _records([response.json()]).get(block_key.hex(), {})


def lookup(compat_id: bytes, scope_id: bytes, block_keys: list[str]) -> dict:
    """The records of the matched prefix of ``block_keys`` (6.2), by key and holder: one round
    trip for a whole directive."""
    body = {"scope_id": scope_id.hex(), "compat_id": compat_id.hex(), "block_keys": block_keys}
    response = raise_for_problem(call(client(), "POST", f"{_base()}lookup", json=body))
    return _records(response.json().get("blocks", []))


def descriptor(compat_id: bytes) -> dict | None:
    """The registered Compatibility Descriptor of ``compat_id``, or None."""
    response = call(client(), "GET", f"{_base()}compat/{compat_id.hex()}")
    if response.status_code == 404:
        return None
    return raise_for_problem(response).json()


def report_status(instance: str, record: InstanceStatusRecord) -> str:
    """PUT the Instance Status Record (6.3); the state the PC decided."""
    response = raise_for_problem(
        call(client(), "PUT", f"{_base()}instances/{instance}/status", json=record.to_json())
    )
    state = response.json().get("state") if response.content else None
    if not isinstance(state, str):
        raise ProtocolError("kvsp-upstream-error", "the status answer carries no state")
    return state


_GEOMETRY_MISS_S = 30.0
_geometries: dict[bytes, tuple[float, object]] = {}
_geometries_lock = threading.Lock()


def geometry(compat_id: bytes):
    """The geometry of ``compat_id`` from its registered descriptor (cached: descriptors never
    change), or None when none is registered or the control plane cannot say (asked again after
    a while)."""
    from workers.tiers import Geometry

    with _geometries_lock:
        cached = _geometries.get(compat_id)
    if cached is not None and (cached[1] is not None or time.monotonic() < cached[0]):
        return cached[1]
    try:
        found = descriptor(compat_id)
    except (PeerUnreachable, ProtocolError):
        found = None
    value = Geometry.from_descriptor(found) if found is not None else None
    with _geometries_lock:
        _geometries[compat_id] = (time.monotonic() + _GEOMETRY_MISS_S, value)
    return value


_scope_keys: dict[bytes, bytes] = {}
_scope_keys_lock = threading.Lock()


def scope_key(scope_id: bytes) -> bytes:
    """The scope key of ``scope_id`` (4.2), from ``GET CP scopes/{scope}/key`` once per process:
    a scope's key never changes (its id is a digest of it). kvsp-not-found when the node's
    principal is not one of the scope's."""
    with _scope_keys_lock:
        known = _scope_keys.get(scope_id)
    if known is not None:
        return known
    response = raise_for_problem(call(client(), "GET", f"{_base()}scopes/{scope_id.hex()}/key"))
    key = bytes.fromhex(str(response.json().get("scope_key", "")))
    if scope_id_of(key) != scope_id:
        raise ProtocolError("kvsp-upstream-error", "the scope key does not hash to the scope id")
    with _scope_keys_lock:
        _scope_keys[scope_id] = key
    return key


def put_checkpoint(record: SessionCheckpoint) -> int:
    """PUT sessions/{session}/checkpoint (6.8); the output_offset the PC acknowledges."""
    response = raise_for_problem(
        call(
            client(),
            "PUT",
            f"{_base()}sessions/{record.session}/checkpoint",
            json=record.to_json(),
        )
    )
    offset = response.json().get("output_offset")
    if type(offset) is not int:
        raise ProtocolError("kvsp-upstream-error", "the checkpoint answer carries no output_offset")
    return offset


def post_output(session: str, tokens: list[dict]) -> dict:
    """POST sessions/{session}/output: tokens with their index and the session epoch (6.8)."""
    body = tokens[0] if len(tokens) == 1 else tokens
    return raise_for_problem(
        call(client(), "POST", f"{_base()}sessions/{session}/output", json=body)
    ).json()


def delivered_indices(session: str) -> set[int]:
    """The output indices the front end holds for the session (6.8)."""
    response = raise_for_problem(call(client(), "GET", f"{_base()}sessions/{session}/output"))
    return {int(token["index"]) for token in response.json().get("tokens", [])}
