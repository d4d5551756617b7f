"""The connector's HTTP client: the control plane's scope key and lookup, blocks at holders.

The configured token goes to the control plane alone; a holder is presented a delegated token
for the one scope and that holder (DESIGN.md section 6), from ``POST CP tokens`` once per token
lifetime.

``kvsp/`` opens no sockets, so the connector brings its own client (httpx); what it checks
comes from ``kvsp/``: Block Keys, Replica Records, the container stream reader that verifies
each layer against the record the moment it arrives, Repr-Digest and the replica digest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvsp.container import (
    MEDIA_TYPE,
    ContainerStreamReader,
    EncodedContainer,
    Layer,
    store_headers,
    verify_replica_digest,
)
from kvsp.delegation import DelegatedTokenCache
from kvsp.problems import ProtocolError
from kvsp.records import LookupRequest, ReplicaRecord, TokenGrant, TokenRequest
from kvsp.reprdigest import ALGORITHM, ReprDigestHasher, parse_repr_digest, verify_repr_digest

# Octets read from a socket at a time.
_CHUNK = 1 << 20
# Block GETs in flight at once, per engine: a holder answers each after a round trip and some
# work of its own, which parallel requests overlap.
FETCHES_AT_ONCE = 4


class PeerError(Exception):
    """The control plane or a holder did not serve what was asked: a miss, a refusal, octets
    that fail a check, a peer down, a timeout."""


@dataclass(frozen=True)
class MatchedBlock:
    """One block of a lookup's matched prefix and the replicas the index lists for it."""

    block_key: str
    replicas: tuple[ReplicaRecord, ...]


class KvspClient:
    """Calls on the control plane (``control_url``) and on holders, with one bearer token."""

    def __init__(self, control_url: str, token: str, *, timeout_s: float = 10.0):
        self.control_url = control_url
        self._token = token
        self._http = httpx.Client(timeout=timeout_s)
        self._delegated = DelegatedTokenCache(self._issue_token, time.monotonic)

    def close(self) -> None:
        self._http.close()

    def _control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}

    def token_for(self, holder: str, scope_id: str) -> str:
        """The bearer token to present to ``holder`` for blocks of ``scope_id``: a delegated
        token with the holder as audience (DESIGN.md section 6), the local node's included,
        asked for once per lifetime. PeerError when the control plane gives none."""
        return self._delegated.token(scope_id, holder)

    def _issue_token(self, scope_id: str, audience: str) -> TokenGrant:
        request = TokenRequest(scope_id=scope_id, audience=audience)
        body = self._json("POST", "tokens", "a delegated token", json=request.to_json())
        try:
            return TokenGrant.from_json(body)
        except ProtocolError as error:
            raise PeerError(f"the token answer: {error.detail}") from None

    def _holder_headers(self, holder: str, scope_id: str, extra: dict[str, str]) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_for(holder, scope_id)}", **extra}

    def _json(self, method: str, path: str, what: str, **kwargs) -> dict:
        url = f"{self.control_url}{path}"
        try:
            response = self._http.request(method, url, headers=self._control_headers(), **kwargs)
        except httpx.HTTPError as error:
            raise PeerError(f"{what}: {method} {url} failed: {error!r}") from None
        if response.status_code != 200:
            raise PeerError(f"{what}: {method} {url} answered {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise PeerError(f"{what}: {method} {url} answered no JSON") from None
        if not isinstance(body, dict):
            raise PeerError(f"{what}: {method} {url} answered {type(body).__name__}")
        return body

    def scope_key(self, scope_id: str) -> bytes:
        """The scope key, from ``GET CP scopes/{scope}/key``."""
        body = self._json("GET", f"scopes/{scope_id}/key", "the scope key")
        try:
            return bytes.fromhex(body["scope_key"])
        except (KeyError, TypeError, ValueError):
            raise PeerError("the scope key answer has no hex scope_key") from None

    def lookup(self, scope_id: str, compat_id: str, block_keys: list[str]) -> list[MatchedBlock]:
        """The matched prefix of ``block_keys`` at the IS (6.2), with each block's replicas.

        A replica whose record does not parse, or names another block, is left out; a block left
        without replicas ends the usable prefix.
        """
        request = LookupRequest(
            scope_id=scope_id, compat_id=compat_id, block_keys=tuple(block_keys)
        )
        body = self._json("POST", "lookup", "the lookup", json=request.to_json())
        blocks = body.get("blocks")
        if not isinstance(blocks, list):
            raise PeerError("the lookup answer has no list of blocks")
        matched: list[MatchedBlock] = []
        for expected_key, block in zip(block_keys, blocks, strict=False):
            if not isinstance(block, dict) or block.get("block_key") != expected_key:
                break
            replicas = []
            for obj in block.get("replicas") or ():
                try:
                    record = ReplicaRecord.from_json(obj)
                except ProtocolError:
                    continue
                if (record.block_key, record.compat_id, record.scope_id) == (
                    expected_key,
                    compat_id,
                    scope_id,
                ) and record.layer_digests is not None:
                    replicas.append(record)
            if not replicas:
                break
            matched.append(MatchedBlock(expected_key, tuple(replicas)))
        return matched

    def fetch_block(
        self,
        record: ReplicaRecord,
        *,
        max_size: int,
        deadline: float,
        on_layer: Callable[[Layer], None],
    ) -> None:
        """GET the block of ``record`` from its holder and hand each layer to ``on_layer`` as
        soon as it has arrived and matched its layer digest in the record (6.7).

        The whole representation is then checked against Repr-Digest and the layer digests
        against the replica digest; any failure raises PeerError, and the caller must treat
        the layers it was handed as unusable. ``deadline`` is a ``time.monotonic()`` value.
        """
        url = f"{record.holder}blocks/{record.compat_id}/{record.scope_id}/{record.block_key}"
        what = f"GET {url}"
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerError(f"{what}: the load deadline passed")
            headers = self._holder_headers(record.holder, record.scope_id, {"Accept": MEDIA_TYPE})
            with self._http.stream("GET", url, headers=headers, timeout=remaining) as response:
                if response.status_code != 200:
                    raise PeerError(f"{what} answered {response.status_code}")
                field = response.headers.get("Repr-Digest")
                if field is None:
                    raise PeerError(f"{what}: no Repr-Digest field")
                reader = ContainerStreamReader(
                    max_size=max_size,
                    max_layers=len(record.layer_digests),
                    expected_layer_digests=record.layer_digests,
                    expected_first_layer=0,
                )
                hasher = ReprDigestHasher()
                for chunk in response.iter_raw(_CHUNK):
                    hasher.update(chunk)
                    for layer in reader.feed(chunk):
                        on_layer(layer)
                    if time.monotonic() >= deadline:
                        raise PeerError(f"{what}: the load deadline passed")
                container = reader.finish()
            if ALGORITHM not in parse_repr_digest(field, problem="kvsp-upstream-error"):
                raise PeerError(f"{what}: Repr-Digest has no sha-256")
            verify_repr_digest(field, sha256=hasher.digest(), problem="kvsp-upstream-error")
            if container.codec != record.codec:
                raise PeerError(f"{what}: codec {container.codec}, not {record.codec}")
            if container.layer_count != len(record.layer_digests):
                raise PeerError(
                    f"{what}: {container.layer_count} layers, the record lists "
                    f"{len(record.layer_digests)}"
                )
            verify_replica_digest(reader.layer_digests, record.digest)
        except ProtocolError as error:
            raise PeerError(f"{what}: {error.detail}") from None
        except httpx.HTTPError as error:
            raise PeerError(f"{what} failed: {error!r}") from None

    def store_block(
        self, holder: str, compat_id: str, scope_id: str, block_key: str, encoded: EncodedContainer
    ) -> bool:
        """PUT a container at ``holder`` with If-None-Match: * and its Repr-Digest (6.7): True
        when it was stored, False when the holder already had the block (412)."""
        url = f"{holder}blocks/{compat_id}/{scope_id}/{block_key}"
        hasher = ReprDigestHasher()
        for part in encoded.parts:
            hasher.update(part)
        headers = self._holder_headers(holder, scope_id, store_headers(hasher.digest()))
        try:
            response = self._http.put(url, content=encoded.tobytes(), headers=headers)
        except httpx.HTTPError as error:
            raise PeerError(f"PUT {url} failed: {error!r}") from None
        if response.status_code == 412:
            return False
        if response.status_code != 201:
            raise PeerError(f"PUT {url} answered {response.status_code}: {response.text[:200]}")
        return True
