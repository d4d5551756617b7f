"""Who may do what, by the rules every app and the node apply alike (spec 6.1, 6.2; DESIGN.md
section 6).

A principal (what token authentication made of a bearer token: ``index.authentication``) reads a
scope it is granted, and the Placement Controller's principal reads every scope; writing into a
scope (publishing, checkpointing, posting output) takes a grant of it, the controller's
included. The requests that steer instances (state changes, prefetch directives, resume,
resharding) are the controller's alone: ``IsController``.

Pure rules over the principal snapshot: nothing here reads the database or imports an app.
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission


def may_read_scope(principal, scope_id: bytes) -> bool:
    """A principal reads the scopes it is granted; the controller reads every scope."""
    return principal.controller or bytes(scope_id) in principal.scope_ids


def has_scope_grant(principal, scope_id: bytes) -> bool:
    """Whether the principal is granted the scope: what writing into it takes."""
    return bytes(scope_id) in principal.scope_ids


class IsController(BasePermission):
    """Only the Placement Controller's principal: 403 ``kvsp-forbidden`` for any other.

    It judges the methods the view handles and no others: a method the view does not handle
    stays a 405, and OPTIONS describes the resource, for every authenticated principal."""

    message = "only the Placement Controller's principal may"

    def has_permission(self, request, view) -> bool:
        method = request.method.lower()
        if method == "options" or not hasattr(view, method):
            return True
        return bool(getattr(request.user, "controller", False))


class IsControllerOrReadOnly(IsController):
    """Reads (GET, HEAD, OPTIONS) for every authenticated principal, whom the view itself judges
    by the scope of what is read; every other method is the controller's alone."""

    def has_permission(self, request, view) -> bool:
        return request.method in SAFE_METHODS or super().has_permission(request, view)
