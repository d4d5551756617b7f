"""Bearer tokens of principals (DESIGN.md section 6): issued once, stored hashed."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from index.models import Principal

TOKEN_PREFIX = "kvsp_"


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> tuple[str, bytes]:
    """A fresh token and the hash to store; the token itself is shown once and never stored."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


def principal_for_token(token: str) -> Principal | None:
    """The active principal holding ``token``, or None."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    digest = hash_token(token)
    principal = (
        Principal.objects.filter(token_hash=digest, revoked_at__isnull=True)
        .prefetch_related("scopes")
        .first()
    )
    # The index lookup matched on the hash already; compare again in constant time so that no
    # code path compares secret material byte by byte.
    if principal is None or not hmac.compare_digest(bytes(principal.token_hash), digest):
        return None
    return principal
