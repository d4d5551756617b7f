"""What a node asks of the control plane, over the same HTTP API any holder would use (DESIGN.md
section 3), with the node's token: publish and withdraw Replica Records (6.1), read the records
of blocks it is about to fetch (6.2), read Compatibility Descriptors (4.1), report its status
(6.3), read scope keys (4.2), and publish the checkpoints and output tokens of the sessions it
serves (6.8).
"""

from __future__ import annotations

import os
import threading

import httpx
from django.conf import settings

from kvsp.blockkeys import scope_id as scope_id_of
from kvsp.problems import ProtocolError
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
    import time

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


def put_checkpoint(record: SessionCheckpoint, extensions: dict | None = None) -> int:
    """PUT sessions/{session}/checkpoint (6.8), with extension members beside the record's
    own (4.4: a receiver ignores those it does not know); the output_offset the PC
    acknowledges."""
    response = raise_for_problem(
        call(
            client(),
            "PUT",
            f"{_base()}sessions/{record.session}/checkpoint",
            json={**(extensions or {}), **record.to_json()},
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
