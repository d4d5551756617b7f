"""Delegated tokens (DESIGN.md section 6): the control plane issues them (``POST CP tokens``)
and answers introspection (``POST CP tokens/introspect``); a holder of this project, which
shares the database and KVSP_MASTER_KEY with the control plane, verifies them itself
(``index.authentication.principal_for_delegated_token``).

A token carries one scope, one audience and an expiry (``kvsp.delegation``). It is worth
something only while the principal it was issued to is not revoked and still reads the scope:
both are checked wherever a token is verified, so revoking a principal, or taking a scope from
it, ends its delegated tokens as well.

Who may introspect: the Placement Controller's principal, and principals that are holders (that
list holder URLs or are bound to an instance). A holder learns only of tokens meant for it: a
token whose audience is not one of its URLs is ``{"active": false}`` to it, as is one whose
signature, expiry or principal does not hold.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from django.conf import settings

from common.permissions import may_read_scope
from index import authz
from index.authentication import now_ms, signing_key, verified_delegated_token
from index.models import Scope
from kvsp import delegation
from kvsp.delegation import DelegatedClaims, normal_audience
from kvsp.problems import ProtocolError
from kvsp.records import TokenGrant, TokenIntrospection, TokenRequest

# What a request for a scope the principal may not read is told: the same as for none at all.
NO_SUCH_SCOPE = "no such scope"


def signed_token(claims: DelegatedClaims) -> str:
    return delegation.sign(signing_key(), claims, os.urandom(delegation.NONCE_OCTETS))


def do_issue_token(principal, request: TokenRequest) -> TokenGrant:
    """A delegated token for ``request.scope_id`` at ``request.audience``, living
    ``request.ttl_ms`` capped by KVSP_DELEGATED_TTL_MS; kvsp-not-found for a scope the
    principal may not read, as for one that does not exist."""
    if principal.expires_ms is not None:
        raise ProtocolError("kvsp-forbidden", "a delegated token cannot be delegated further")
    scope_id = bytes.fromhex(request.scope_id)
    readable = may_read_scope(principal, scope_id)
    if not readable or not Scope.objects.filter(scope_id=scope_id).exists():
        raise ProtocolError("kvsp-not-found", NO_SUCH_SCOPE)
    cap = settings.KVSP_DELEGATED_TTL_MS
    ttl_ms = min(request.ttl_ms or cap, cap)
    expires_ms = now_ms() + ttl_ms
    claims = DelegatedClaims(principal.id, scope_id, normal_audience(request.audience), expires_ms)
    expires_at = datetime.fromtimestamp(expires_ms / 1000, UTC)
    return TokenGrant(
        token=signed_token(claims),
        expires_at=expires_at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        ttl_ms=ttl_ms,
    )


def may_introspect(principal) -> bool:
    return bool(principal.controller or principal.holder_urls or principal.instance)


def _own_audiences(principal) -> set[str]:
    urls = set(principal.holder_urls)
    if principal.instance:
        urls |= authz.instance_urls(principal.instance)
    return {normal_audience(url) for url in urls}


def introspect(principal, token: str) -> TokenIntrospection:
    """RFC 7662 in shape: what ``token`` carries, for a holder it is meant for (or the
    controller); ``{"active": false}`` for anything else."""
    if not may_introspect(principal):
        raise ProtocolError(
            "kvsp-forbidden", "only holders and the Placement Controller may introspect tokens"
        )
    verified = verified_delegated_token(token)
    if verified is None:
        return TokenIntrospection(active=False)
    claims, _ = verified
    if not principal.controller and claims.audience not in _own_audiences(principal):
        return TokenIntrospection(active=False)
    return TokenIntrospection(
        active=True,
        scope_id=claims.scope_id.hex(),
        audience=claims.audience,
        exp=claims.expires_ms // 1000,
    )
