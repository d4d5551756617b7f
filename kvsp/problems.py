"""Problem types (RFC 9457) and the one error every part of the core raises.

The spec names three problem types (``kvsp-lease-quota``, ``kvsp-stale-epoch``,
``kvsp-layers-unavailable``); the rest are the ones this implementation needs so that every
error a peer can see has a ``type`` ending in its name and an HTTP status hint.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBLEM_BASE = "https://kvsp.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"


@dataclass(frozen=True, slots=True)
class ProblemType:
    name: str
    status: int
    title: str

    @property
    def uri(self) -> str:
        return PROBLEM_BASE + self.name


_TYPES = (
    # Named by the spec.
    ProblemType("kvsp-lease-quota", 429, "Lease quota exceeded"),
    ProblemType("kvsp-stale-epoch", 409, "Stale epoch"),
    ProblemType("kvsp-layers-unavailable", 404, "Layers unavailable"),
    # Errors the peer caused.
    ProblemType("kvsp-malformed-request", 400, "Malformed request"),
    ProblemType("kvsp-invalid-record", 422, "Invalid record"),
    ProblemType("kvsp-invalid-container", 422, "Invalid KV Block Container"),
    ProblemType("kvsp-digest-mismatch", 422, "Digest mismatch"),
    ProblemType("kvsp-compat-mismatch", 422, "Compatibility ID mismatch"),
    ProblemType("kvsp-unauthenticated", 401, "Authentication required"),
    ProblemType("kvsp-forbidden", 403, "Forbidden"),
    ProblemType("kvsp-not-found", 404, "Not found"),
    ProblemType("kvsp-method-not-allowed", 405, "Method not allowed"),
    ProblemType("kvsp-not-acceptable", 406, "Not acceptable"),
    ProblemType("kvsp-conflict", 409, "Conflict"),
    ProblemType("kvsp-precondition-failed", 412, "Precondition failed"),
    ProblemType("kvsp-payload-too-large", 413, "Payload too large"),
    ProblemType("kvsp-unsupported-media-type", 415, "Unsupported media type"),
    ProblemType("kvsp-invalid-state", 409, "Invalid state transition"),
    ProblemType("kvsp-too-many-requests", 429, "Too many requests"),
    ProblemType("kvsp-unsupported-codec", 406, "Unsupported codec"),
    # Errors we caused or could not avoid.
    ProblemType("kvsp-internal-error", 500, "Internal error"),
    ProblemType("kvsp-unavailable", 503, "Service unavailable"),
    ProblemType("kvsp-upstream-error", 502, "Upstream error"),
)

PROBLEM_TYPES: dict[str, ProblemType] = {t.name: t for t in _TYPES}


class ProtocolError(Exception):
    """A violation of the protocol, carrying the problem type a peer should see.

    ``detail`` is meant for the peer: it says what was wrong and never contains internal state.
    """

    def __init__(self, problem: str, detail: str, *, status: int | None = None):
        if problem not in PROBLEM_TYPES:
            raise ValueError(f"unregistered problem type {problem!r}")
        super().__init__(detail)
        self.problem_type = PROBLEM_TYPES[problem]
        self.detail = detail
        self.status = status if status is not None else self.problem_type.status

    @property
    def problem(self) -> str:
        return self.problem_type.name

    def document(self, instance: str | None = None) -> dict:
        return problem_document(self.problem, self.detail, status=self.status, instance=instance)

    def __repr__(self) -> str:
        return f"ProtocolError({self.problem!r}, {self.detail!r})"


def problem_document(
    problem: str, detail: str, *, status: int | None = None, instance: str | None = None
) -> dict:
    """The RFC 9457 problem details object for a registered problem type."""
    problem_type = PROBLEM_TYPES[problem]
    document = {
        "type": problem_type.uri,
        "title": problem_type.title,
        "status": status if status is not None else problem_type.status,
        "detail": detail,
    }
    if instance is not None:
        document["instance"] = instance
    return document


def problem_name(type_uri: str) -> str | None:
    """The registered name a ``type`` URI ends with, or None for a foreign type."""
    name = type_uri.rsplit("/", 1)[-1].rsplit("#", 1)[-1]
    return name if name in PROBLEM_TYPES else None
