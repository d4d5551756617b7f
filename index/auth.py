"""Bearer tokens of principals (DESIGN.md section 6): issued once, stored hashed.

Authentication runs on every request, so it is one query that returns the principal together
with its scope grants, as a frozen snapshot rather than a model instance.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from django.db import connection

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
