"""Delegated tokens (DESIGN.md section 6): bearer tokens that carry one scope, one audience
holder and an expiry, so that what a client presents to a holder grants no more than the
request needs.

The control plane signs the claims with a key derived from its master key under a label of
their own, so that the key that seals scope keys never signs anything itself; a holder that
shares the master key checks the signature, the audience and the expiry here, and asks its own
database whether the principal behind the token still holds the scope. A holder that shares
neither asks the control plane (``POST CP tokens/introspect``).

Claims are ``version u8 = 1 || principal u64 || scope_id (16 octets) || expires_ms u64 ||
nonce (12 octets) || audience (ASCII)``, all integers big-endian; the token is
``kvspd_`` followed by base64url (no padding) of the claims and their HMAC-SHA-256 tag.

``DelegatedTokenCache`` is the client's side: one token per (scope, audience), asked for once
and used until shortly before it expires.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvsp.records import MAX_BEARER_TOKEN_LENGTH, TokenGrant

DELEGATED_PREFIX = "kvspd_"
# Domain separation: the signing key is HMAC(master key, KEY_LABEL), and every tag is over
# TAG_LABEL || 0x00 || claims.
KEY_LABEL = b"KVSP-DELEGATED-TOKEN-KEY-1"
TAG_LABEL = b"KVSP-DELEGATED-TOKEN-1"
VERSION = 1
NONCE_OCTETS = 12
_HEAD = struct.Struct(">BQ16sQ")
_TAG_OCTETS = 32
_DEFAULT_PORTS = {"http": 80, "https": 443}


def signing_key(master_key: bytes) -> bytes:
    """The key delegated tokens are signed with, derived from the master key."""
    return hmac.new(master_key, KEY_LABEL, hashlib.sha256).digest()


def normal_audience(url: str) -> str:
    """A holder base URL as tokens carry it and holders compare it: scheme and host in
    lowercase, the scheme's default port left out, the path as it is ("" as "/")."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = parts.port
    if port is not None and port != _DEFAULT_PORTS.get(parts.scheme.lower()):
        host = f"{host}:{port}"
    return f"{parts.scheme.lower()}://{host}{parts.path or '/'}"


@dataclass(frozen=True, slots=True)
class DelegatedClaims:
    principal_id: int
    scope_id: bytes
    audience: str
    expires_ms: int

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_ms


def is_delegated(token: str) -> bool:
    return token.startswith(DELEGATED_PREFIX)


def _tag(key: bytes, claims: bytes) -> bytes:
    return hmac.new(key, TAG_LABEL + b"\x00" + claims, hashlib.sha256).digest()


def sign(key: bytes, claims: DelegatedClaims, nonce: bytes) -> str:
    """The token of ``claims``; ``nonce`` (NONCE_OCTETS random octets) makes every token
    issued distinct."""
    if len(nonce) != NONCE_OCTETS:
        raise ValueError(f"the nonce must be {NONCE_OCTETS} octets")
    encoded = (
        _HEAD.pack(VERSION, claims.principal_id, claims.scope_id, claims.expires_ms)
        + nonce
        + claims.audience.encode("ascii")
    )
    body = base64.urlsafe_b64encode(encoded + _tag(key, encoded)).rstrip(b"=")
    return DELEGATED_PREFIX + body.decode("ascii")


def read(key: bytes, token: str) -> DelegatedClaims | None:
    """The claims of a token signed with ``key``, or None for anything else. Expiry and
    audience are the caller's to check (``DelegatedClaims.expired``, ``normal_audience``)."""
    if not is_delegated(token) or len(token) > MAX_BEARER_TOKEN_LENGTH:
        return None
    body = token[len(DELEGATED_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        return None
    # The decoder skips what is not of the alphabet and ignores spare bits: only the one
    # spelling ``sign`` gives is the token.
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != body:
        return None
    if len(raw) < _HEAD.size + NONCE_OCTETS + _TAG_OCTETS:
        return None
    encoded, tag = raw[:-_TAG_OCTETS], raw[-_TAG_OCTETS:]
    if not hmac.compare_digest(tag, _tag(key, encoded)):
        return None
    version, principal_id, scope_id, expires_ms = _HEAD.unpack_from(encoded)
    if version != VERSION:
        return None
    try:
        audience = encoded[_HEAD.size + NONCE_OCTETS :].decode("ascii")
    except UnicodeDecodeError:
        return None
    return DelegatedClaims(principal_id, scope_id, audience, expires_ms)


# A token is asked for again when this share of its life is left, or REFRESH_AHEAD_S, which
# ever is less: a request sent with it still arrives before it expires.
REFRESH_SHARE = 0.25
REFRESH_AHEAD_S = 10.0
_MAX_CACHED = 10_000


class DelegatedTokenCache:
    """Delegated tokens by (scope_id, audience), each asked for once per lifetime.

    ``issue(scope_id, audience)`` asks the control plane (``POST CP tokens``) and returns its
    TokenGrant; ``clock`` is a monotonic clock in seconds. Threads that need the same token at
    once wait for one request rather than each sending their own; an error of ``issue``
    reaches every caller and nothing is cached.
    """

    def __init__(self, issue: Callable[[str, str], TokenGrant], clock: Callable[[], float]):
        self._issue = issue
        self._clock = clock
        self._tokens: dict[tuple[str, str], tuple[float, str]] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def token(self, scope_id: str, audience: str) -> str:
        key = (scope_id, audience)
        cached = self._fresh(key)
        if cached is not None:
            return cached
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            cached = self._fresh(key)
            if cached is not None:
                return cached
            asked_at = self._clock()
            grant = self._issue(scope_id, audience)
            life_s = grant.ttl_ms / 1000
            refresh_at = asked_at + life_s - min(life_s * REFRESH_SHARE, REFRESH_AHEAD_S)
            with self._lock:
                if len(self._tokens) >= _MAX_CACHED:
                    self._tokens.clear()  # bounded memory; a lock dropped here is made again
                    self._locks.clear()
                self._tokens[key] = (refresh_at, grant.token)
            return grant.token

    def forget(self, scope_id: str, audience: str) -> None:
        """Drop the token of (scope_id, audience): the holder refused it."""
        with self._lock:
            self._tokens.pop((scope_id, audience), None)

    def _fresh(self, key: tuple[str, str]) -> str | None:
        with self._lock:
            cached = self._tokens.get(key)
        if cached is not None and self._clock() < cached[0]:
            return cached[1]
        return None
