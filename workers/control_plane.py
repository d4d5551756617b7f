"""What a node asks of the control plane, over the same HTTP API any holder would use (DESIGN.md
section 3), with the node's token: publish and withdraw Replica Records (6.1; many at once
through the batch form where the control plane has it), read the records of blocks it is about
to fetch (6.2), read Compatibility Descriptors (4.1), report its status (6.3), read scope keys
(4.2), publish the checkpoints and output tokens of the sessions it serves (6.8), and obtain the
delegated tokens it presents to other holders (DESIGN.md section 6): the node's own token goes
to the control plane alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import httpx
import orjson
from django.conf import settings

from common.peers import PeerUnreachable, call, peer_client, raise_for_problem, refusal
from kvsp import blockkeys
from kvsp.delegation import DelegatedTokenCache
from kvsp.problems import ProtocolError
from kvsp.records import (
    InstanceStatusRecord,
    ReplicaRecord,
    SessionCheckpoint,
    TokenGrant,
    TokenRequest,
)

CONTROL_TIMEOUT = httpx.Timeout(10.0, connect=2.0)

_clients: dict[tuple[int, str], httpx.Client] = {}
_clients_lock = threading.Lock()


def client() -> httpx.Client:
    """One pooled client per process for the control plane, with the node's token: keep-alive
    connections (a forked process gets its own)."""
    return _pooled("control", token=None)


def holder_client() -> httpx.Client:
    """One pooled client per process for other holders. It carries no token of its own: each
    request carries the delegated token for its scope and holder (``delegated_token``)."""
    return _pooled("holders", token="")


def _pooled(purpose: str, *, token: str | None) -> httpx.Client:
    # token None: the node's KVSP_TOKEN; "" none at all.
    key = (os.getpid(), purpose)
    with _clients_lock:
        existing = _clients.get(key)
        if existing is None:
            existing = _clients[key] = peer_client(token=token, timeout=CONTROL_TIMEOUT)
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
# What a control plane that speaks only the spec answers to a batch route: no such route.
_NO_BATCH_ROUTE = (404, 405)
# How long such a control plane is sent single PUTs before the batch route is tried again (it
# may have been upgraded meanwhile).
_NO_BATCH_ROUTE_RETRY_S = 300.0
_no_batch_route_until: dict[str, float] = {}
# Room for the envelope, {"records": [...]} or {"replicas": [...]}, around the items.
_BATCH_ENVELOPE_OCTETS = 64


def publish_replicas(records: list[ReplicaRecord]) -> list[PublishOutcome]:
    """Publish many records (6.1) in as few requests as the control plane takes: ``POST CP
    replicas`` (DESIGN.md section 3) in chunks of at most KVSP_MAX_BATCH_RECORDS records and
    KVSP_MAX_BODY_OCTETS octets, or single PUTs where the control plane has no batch route.
    One outcome per record, in order; a record the IS refused, or could not be asked about,
    is an outcome with its error rather than an exception."""

    def outcome(url: str, record: ReplicaRecord, result: dict) -> PublishOutcome:
        if result.get("status") in (200, 201):
            granted = result.get("ttl_ms")
            ttl_ms = granted if type(granted) is int else record.ttl_ms
            return PublishOutcome(record, ttl_ms=ttl_ms)
        return PublishOutcome(record, error=_refusal(url, record.block_key, result))

    return _in_batches(
        "replicas",
        "records",
        records,
        encode=ReplicaRecord.to_json,
        outcome=outcome,
        one_by_one=_publish_each,
        failed=lambda record, failure: PublishOutcome(record, error=failure),
    )


def withdraw_replicas(replicas: list[tuple[bytes, bytes, bytes]]) -> list[Exception | None]:
    """Withdraw this node's records of many replicas, each (compat_id, scope_id, block_key)
    (6.1), as ``publish_replicas`` publishes: ``POST CP replicas/withdrawals`` in chunks, or
    one DELETE each where the control plane has no batch route. One error or None per replica,
    in order; a record the IS no longer has is fine."""
    holder = settings.KVSP_PUBLIC_URL

    def encode(ids: tuple) -> dict:
        compat_id, scope_id, block_key = ids
        return {
            "compat_id": compat_id.hex(),
            "scope_id": scope_id.hex(),
            "block_key": block_key.hex(),
            "holder": holder,
        }

    def outcome(url: str, ids: tuple, result: dict) -> Exception | None:
        if result.get("status") in (204, 404):
            return None
        return _refusal(url, ids[2].hex(), result)

    return _in_batches(
        "replicas/withdrawals",
        "replicas",
        replicas,
        encode=encode,
        outcome=outcome,
        one_by_one=lambda items: [_withdraw_one(ids) for ids in items],
        failed=lambda ids, failure: failure,
    )


def _in_batches(route: str, member: str, items: list, *, encode, outcome, one_by_one, failed):
    """``items`` sent to the batch route ``route`` as ``{member: [...]}``, in chunks the
    control plane takes; ``outcome(url, item, result)`` of each result, ``one_by_one(items)``
    where the route is missing (or for a single item), ``failed(item, error)`` for each item of
    a request that failed whole."""
    if not items:
        return []
    try:
        url = f"{_base()}{route}"
    except PeerUnreachable as unreachable:
        return [failed(item, unreachable) for item in items]
    if len(items) == 1 or time.monotonic() < _no_batch_route_until.get(url, 0.0):
        return one_by_one(items)  # the spec's own request for a single item
    encoded = [orjson.dumps(encode(item)) for item in items]
    chunk = partial(_post_chunk, url, member, outcome=outcome, one_by_one=one_by_one, failed=failed)
    results, start = [], 0
    for end in _chunk_ends(encoded):
        results += chunk(items[start:end], encoded[start:end])
        start = end
    return results


def _chunk_ends(encoded: list[bytes]) -> Iterator[int]:
    """Where each chunk of ``encoded`` items ends: as many as a batch may carry."""
    most_items = max(settings.KVSP_MAX_BATCH_RECORDS, 1)
    most_octets = settings.DATA_UPLOAD_MAX_MEMORY_SIZE - _BATCH_ENVELOPE_OCTETS
    count = octets = 0
    for index, body in enumerate(encoded):
        if count and (count == most_items or octets + len(body) + 1 > most_octets):
            yield index
            count = octets = 0
        count += 1
        octets += len(body) + 1
    yield len(encoded)


def _post_chunk(url, member, items, encoded, *, outcome, one_by_one, failed) -> list:
    body = b'{"' + member.encode() + b'":[' + b",".join(encoded) + b"]}"
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
            return one_by_one(items)
        if response.status_code == 413 and len(items) > 1:  # a smaller body limit there
            half = len(items) // 2
            again = partial(
                _post_chunk, url, member, outcome=outcome, one_by_one=one_by_one, failed=failed
            )
            return again(items[:half], encoded[:half]) + again(items[half:], encoded[half:])
        results = raise_for_problem(response).json().get("results")
        if not isinstance(results, list) or len(results) != len(items):
            raise ProtocolError("kvsp-upstream-error", f"{url}: the answer lists other results")
    except ValueError:
        failure = ProtocolError("kvsp-upstream-error", f"{url}: the answer is not JSON")
        return [failed(item, failure) for item in items]
    except (ProtocolError, PeerUnreachable) as failure:
        return [failed(item, failure) for item in items]
    return [
        outcome(url, item, result if isinstance(result, dict) else {})
        for item, result in zip(items, results, strict=True)
    ]


def _refusal(url: str, block_key: str, result: dict) -> ProtocolError | PeerUnreachable:
    """The error one result of a batch answer reports, as the peer client's policy says."""
    status = result.get("status")
    if type(status) is not int:
        return ProtocolError("kvsp-upstream-error", f"{url}: {block_key}: a result without status")
    return refusal(status, result.get("problem"), f"{url}: {block_key}", "refused")


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


def _withdraw_one(ids: tuple) -> Exception | None:
    try:
        withdraw(*ids)
    except (ProtocolError, PeerUnreachable) as failure:
        return failure
    return None


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
    return _records(orjson.loads(response.content).get("blocks", []))


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
    if blockkeys.scope_id(key) != scope_id:
        raise ProtocolError("kvsp-upstream-error", "the scope key does not hash to the scope id")
    with _scope_keys_lock:
        _scope_keys[scope_id] = key
    return key


def put_checkpoint(
    record: SessionCheckpoint, extensions: dict | None = None, *, release: Sequence[dict] = ()
) -> int:
    """PUT sessions/{session}/checkpoint (6.8), with extension members beside the record's
    own (4.4: a receiver ignores those it does not know); the output_offset the PC
    acknowledges.

    ``release``: output tokens the checkpoint covers, sent with it as the extension member
    ``output`` so that a token costs no round trip of its own after its checkpoint. A control
    plane that stored them says so in its answer's ``output``; one that ignored the member
    gets them with ``POST sessions/{session}/output`` as usual.
    """
    body = {**(extensions or {}), **record.to_json()}
    if release:
        body["output"] = list(release)
    response = raise_for_problem(
        call(client(), "PUT", f"{_base()}sessions/{record.session}/checkpoint", json=body)
    )
    answer = response.json()
    offset = answer.get("output_offset")
    if type(offset) is not int:
        raise ProtocolError("kvsp-upstream-error", "the checkpoint answer carries no output_offset")
    if release and not isinstance(answer.get("output"), dict):
        post_output(record.session, list(release))
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


def _issue_delegated_token(scope_id: str, audience: str) -> TokenGrant:
    body = TokenRequest(scope_id=scope_id, audience=audience).to_json()
    response = raise_for_problem(call(client(), "POST", f"{_base()}tokens", json=body))
    try:
        return TokenGrant.from_json(response.json())
    except ValueError:
        raise ProtocolError("kvsp-upstream-error", "the token answer is not JSON") from None


_delegated_tokens = DelegatedTokenCache(_issue_delegated_token, time.monotonic)


def delegated_token(scope_id: bytes, holder: str) -> str:
    """The delegated token to present to ``holder`` for blocks and leases of ``scope_id``
    (DESIGN.md section 6): from ``POST CP tokens`` once per token lifetime, then from memory.
    PeerUnreachable or ProtocolError when the control plane gives none."""
    return _delegated_tokens.token(scope_id.hex(), holder)


def forget_delegated_token(scope_id: bytes, holder: str) -> None:
    """``holder`` refused the token (the control plane's key changed, say): ask anew next."""
    _delegated_tokens.forget(scope_id.hex(), holder)
