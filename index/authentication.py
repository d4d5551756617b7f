"""Token authentication (DESIGN.md section 6): what a bearer token stands for, on both roles.

A principal's own token is issued once and stored hashed (``new_token``); a delegated token
(``kvsp.delegation``, issued by ``index.delegation``) carries one scope, one audience and an
expiry, and is verified by a holder itself, which shares the database and KVSP_MASTER_KEY with
the control plane. Either becomes an ``AuthenticatedPrincipal``: a frozen snapshot of what the
request may do, made by one query, never a model instance.

The DRF authentication classes are here too: ``BearerTokenAuthentication`` for every route of
either role, ``HolderAuthentication`` for a holder's blocks and leases, and ``holder_principal``
for the node's block path outside DRF. This is the one module of the Index Service the node
imports: it reads the tables through raw SQL, imports no model, and applies the rules of
``common.permissions``, which the node applies itself.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from common.throttling import FAILED_AUTHENTICATIONS, PrincipalRateThrottle
from kvsp import delegation
from kvsp.delegation import DelegatedClaims, normal_audience

TOKEN_PREFIX = "kvsp_"


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> tuple[str, bytes]:
    """A fresh token and the hash to store; the token itself is shown once and never stored."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


@dataclass(frozen=True, slots=True)
class AuthenticatedPrincipal:
    """What a request may do, as of the moment it was authenticated."""

    id: int
    name: str
    holder_urls: tuple[str, ...]
    instance: str
    controller: bool
    scope_ids: frozenset[bytes]
    # A delegated token's expiry (ms since the Unix epoch); None for a principal's own token.
    expires_ms: int | None = None

    # DRF's IsAuthenticated asks the authenticated object this.
    @property
    def is_authenticated(self) -> bool:
        return True


# --- A principal's own token ---------------------------------------------------------------

_PRINCIPAL_WITH_GRANTS = (
    "SELECT p.id, p.name, p.holder_urls, p.instance, p.controller, p.token_hash, s.scope_id "
    "FROM index_principal p "
    "LEFT JOIN index_principal_scopes ps ON ps.principal_id = p.id "
    "LEFT JOIN index_scope s ON s.id = ps.scope_id "
    "WHERE p.token_hash = %s AND p.revoked_at IS NULL"
)


def principal_for_token(token: str) -> AuthenticatedPrincipal | None:
    """The active principal holding ``token``, with its grants, or None."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    digest = hash_token(token)
    with connection.cursor() as cursor:
        cursor.execute(_PRINCIPAL_WITH_GRANTS, [digest])
        rows = cursor.fetchall()
    # The index matched on the hash already; compare again in constant time so that no code
    # path compares secret material byte by byte.
    if not rows or not hmac.compare_digest(bytes(rows[0][5]), digest):
        return None
    principal_id, name, holder_urls, instance, controller, _, _ = rows[0]
    if isinstance(holder_urls, str):  # SQLite hands JSON back as text
        holder_urls = json.loads(holder_urls)
    return AuthenticatedPrincipal(
        id=principal_id,
        name=name,
        holder_urls=tuple(holder_urls),
        instance=instance,
        controller=bool(controller),
        scope_ids=frozenset(bytes(row[6]) for row in rows if row[6] is not None),
    )


# The Placement Controller acting inside the control plane (failover, placement): it reads every
# scope, as a controller principal does over HTTP.
CONTROLLER = AuthenticatedPrincipal(
    id=0,
    name="placement-controller",
    holder_urls=(),
    instance="",
    controller=True,
    scope_ids=frozenset(),
)


# --- A delegated token ---------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _signing_key(master_key: bytes) -> bytes:
    return delegation.signing_key(master_key)


def signing_key() -> bytes:
    return _signing_key(settings.KVSP_MASTER_KEY)


def now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


# The principal behind a token, if it is not revoked and still reads the token's scope (the
# controller reads every scope there is).
_PRINCIPAL_OF_SCOPE = (
    "SELECT p.name FROM index_principal p "
    "WHERE p.id = %s AND p.revoked_at IS NULL AND EXISTS ("
    "  SELECT 1 FROM index_scope s WHERE s.scope_id = %s AND (p.controller OR EXISTS ("
    "    SELECT 1 FROM index_principal_scopes ps"
    "    WHERE ps.principal_id = p.id AND ps.scope_id = s.id)))"
)


def verified_delegated_token(token: str) -> tuple[DelegatedClaims, str] | None:
    """The claims of a valid, unexpired delegated token and its principal's name, or None: a
    token is worth something only while its principal is not revoked and still reads its
    scope, so that revoking a principal, or taking a scope from it, ends its tokens too."""
    claims = delegation.read(signing_key(), token)
    if claims is None or claims.expired(now_ms()):
        return None
    with connection.cursor() as cursor:
        cursor.execute(_PRINCIPAL_OF_SCOPE, [claims.principal_id, claims.scope_id])
        row = cursor.fetchone()
    return None if row is None else (claims, row[0])


def principal_for_delegated_token(token: str, holder_url: str) -> AuthenticatedPrincipal | None:
    """What a delegated token lets its bearer do at the holder ``holder_url`` (this node's
    KVSP_PUBLIC_URL): read and lease, and store, blocks of its one scope; None when the token
    is not valid, has expired, is meant for another holder, or its principal may no longer."""
    if not holder_url:
        return None
    verified = verified_delegated_token(token)
    if verified is None:
        return None
    claims, name = verified
    if claims.audience != normal_audience(holder_url):
        return None
    return AuthenticatedPrincipal(
        id=claims.principal_id,
        name=name,
        holder_urls=(),
        instance="",
        controller=False,
        scope_ids=frozenset([claims.scope_id]),
        expires_ms=claims.expires_ms,
    )


# --- DRF authentication --------------------------------------------------------------------


class BearerTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer <token>``; the principal comes from the Index Service's table."""

    keyword = b"bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        token = parts[1].decode("ascii", "replace") if len(parts) == 2 else ""
        # Guessing tokens from an address that has spent its failures is answered 429 here,
        # before the lookup that each guess would cost (common/throttling.py).
        FAILED_AUTHENTICATIONS.check(request, token)
        if len(parts) != 2:
            FAILED_AUTHENTICATIONS.failed(request, None)
            raise exceptions.AuthenticationFailed(
                "the Authorization field must be 'Bearer <token>'"
            )
        if not parts[1].isascii():
            FAILED_AUTHENTICATIONS.failed(request, None)
            raise exceptions.AuthenticationFailed("the bearer token is not ASCII")
        principal = self.principal_for(token)
        if principal is None:
            FAILED_AUTHENTICATIONS.failed(request, token)
            raise exceptions.AuthenticationFailed("the bearer token is not valid")
        FAILED_AUTHENTICATIONS.verified(token)
        return principal, token

    def principal_for(self, token: str):
        """The principal a token stands for, or None: a principal's own token only."""
        return principal_for_token(token)

    def authenticate_header(self, request):
        return 'Bearer realm="kvsp"'


class CachedBearerTokenAuthentication(BearerTokenAuthentication):
    """A bearer token verified once and taken as it was for ``KVSP_AUTH_CACHE_S``, in this
    process: for the block and lease requests, which a loader sends by the hundred per second
    over kept-alive connections, so that they do not each pay a query for the same principal.
    Only valid tokens are remembered; a revoked one stops working within the period."""

    _verified: dict[str, tuple[float, object]] = {}
    _lock = threading.Lock()

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() != self.keyword:
            return super().authenticate(request)
        key = parts[1]
        now = time.monotonic()
        with self._lock:
            known = self._verified.get(key)
        if known is not None and known[0] > now:
            return known[1]
        found = super().authenticate(request)
        period = settings.KVSP_AUTH_CACHE_S
        if found is not None and found[0].expires_ms is not None:
            # A delegated token is never taken past its expiry.
            period = min(period, found[0].expires_ms / 1000 - time.time())
        if found is not None and period > 0:
            with self._lock:
                if len(self._verified) >= _MAX_VERIFIED:
                    self._verified.clear()  # bounded memory under a flood of tokens
                self._verified[key] = (now + period, found)
        return found


class HolderAuthentication(CachedBearerTokenAuthentication):
    """What a holder's blocks and leases accept: a principal's own token, or a delegated token
    (DESIGN.md section 6) whose audience is this holder (KVSP_PUBLIC_URL); every other route
    of either role takes a principal's own token alone."""

    def principal_for(self, token: str):
        if delegation.is_delegated(token):
            return principal_for_delegated_token(token, settings.KVSP_PUBLIC_URL)
        return super().principal_for(token)


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """How the OpenAPI description names the scheme (registered by being defined)."""

    target_class = BearerTokenAuthentication
    name = "bearer"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}


# Tokens remembered by CachedBearerTokenAuthentication at most, per process.
_MAX_VERIFIED = 10_000

_HOLDER_AUTHENTICATION = HolderAuthentication()


def holder_principal(request):
    """The principal of a block request on the node server's own path (``workers.blockpath``),
    checked as DRF checks a view with ``HolderAuthentication``, ``IsAuthenticated`` and
    ``PrincipalRateThrottle``: the same exceptions (401, 429 for the failed-auth budget and for
    the principal's rate), for ``common.api.problem_answer`` to answer alike. ``request`` needs
    only ``META``."""
    found = _HOLDER_AUTHENTICATION.authenticate(request)
    principal = found[0] if found is not None else None
    if not getattr(principal, "is_authenticated", False):
        raise exceptions.NotAuthenticated()
    wait = PrincipalRateThrottle.take(request, principal)
    if wait:
        raise exceptions.Throttled(max(wait, 0.001))
    return principal
