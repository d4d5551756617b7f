"""REST plumbing shared by both roles: media types, bearer tokens, RFC 9457 problem details.

Every error on the API, wherever it arises (a view, the URL resolver, a parser, the auth layer or
an uncaught exception), leaves as ``application/problem+json`` whose ``type`` ends with the
problem's name. A 5xx never echoes internal text.
"""

from __future__ import annotations

import logging
import mmap
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

import orjson
from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.db import DataError, IntegrityError, InterfaceError, OperationalError
from django.http import Http404, HttpResponse
from rest_framework import exceptions, status
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer
from rest_framework.response import Response

from common.throttling import FAILED_AUTHENTICATIONS, PrincipalRateThrottle
from kvsp.container import MEDIA_TYPE, Container, decode
from kvsp.problems import PROBLEM_MEDIA_TYPE, ProtocolError, problem_document
from kvsp.reprdigest import ReprDigestHasher

log = logging.getLogger(__name__)

KVSP_JSON = "application/kvsp+json"
KVSP_BLOCK = MEDIA_TYPE
API_PREFIXES = ("/kvsp/", "/metrics")

_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


class KvspJSONRenderer(BaseRenderer):
    media_type = KVSP_JSON
    format = "kvsp+json"
    charset = None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        return orjson.dumps(data, option=_ORJSON_OPTIONS)


class PlainJSONRenderer(KvspJSONRenderer):
    media_type = "application/json"
    format = "json"


class KvspJSONParser(BaseParser):
    media_type = KVSP_JSON

    def parse(self, stream, media_type=None, parser_context=None):
        # DRF hands parsers the raw stream, past Django's own body limit: enforce it here.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if stream is None:
            body = b""
        else:
            body = stream.read() if limit is None else stream.read(limit + 1)
        if limit is not None and len(body) > limit:
            raise ProtocolError(
                "kvsp-payload-too-large", f"the request body is larger than {limit} octets"
            )
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise exceptions.ParseError(f"the body is not valid JSON: {exc}") from exc


class PlainJSONParser(KvspJSONParser):
    media_type = "application/json"


class ReceivedContainer:
    """A KV Block Container received as a request body: written once to a spool file, mapped,
    and decoded by the core as views into the mapping; ``sha256`` is its Repr-Digest."""

    def __init__(self, path: Path, mapping: mmap.mmap, container: Container, sha256: bytes):
        self.path = path
        self.container = container
        self.sha256 = sha256
        self._mapping = mapping

    def release(self) -> None:
        """Unmap the body (views still in use keep it mapped until they are dropped)."""
        self.container = None
        with suppress(BufferError):
            self._mapping.close()


class KvspBlockParser(BaseParser):
    """``application/kvsp-block`` (spec 4.3): the body streams into a spool file, chosen by the
    view's ``block_spool()`` when it has one, and is decoded in place (no copy in memory)."""

    media_type = KVSP_BLOCK
    chunk = 1 << 20

    def parse(self, stream, media_type=None, parser_context=None):
        view = (parser_context or {}).get("view")
        make_spool = getattr(view, "block_spool", None)
        spool = make_spool() if make_spool else tempfile.NamedTemporaryFile(delete=False)
        limit = settings.KVSP_MAX_BLOCK_OCTETS
        hasher = ReprDigestHasher()
        try:
            while stream is not None and (chunk := stream.read(self.chunk)):
                if hasher.size + len(chunk) > limit:
                    raise ProtocolError(
                        "kvsp-payload-too-large", f"a block body is at most {limit} octets"
                    )
                hasher.update(chunk)
                spool.write(chunk)
            spool.flush()
            if hasher.size == 0:
                raise ProtocolError("kvsp-invalid-container", "the body is empty")
            mapping = mmap.mmap(spool.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                container = decode(mapping, max_size=limit)
            except BaseException:
                # The error's frames may still hold views of the mapping; it goes with them.
                with suppress(BufferError):
                    mapping.close()
                raise
        except BaseException:
            spool.close()
            Path(spool.name).unlink(missing_ok=True)
            raise
        spool.close()
        return ReceivedContainer(Path(spool.name), mapping, container, hasher.digest())


class KvspBlockRenderer(BaseRenderer):
    """``application/kvsp-block``: octets or container parts as they are; anything else (the
    problem details of an error) as JSON."""

    media_type = KVSP_BLOCK
    format = "kvsp-block"
    charset = None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        if isinstance(data, bytes | bytearray | memoryview):
            return bytes(data)
        if isinstance(data, list | tuple):
            return b"".join(data)
        return orjson.dumps(data, option=_ORJSON_OPTIONS)


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
        from index.auth import principal_for_token

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
        from kvsp.delegation import is_delegated

        if is_delegated(token):
            from index.delegation import principal_for_delegated_token

            return principal_for_delegated_token(token, settings.KVSP_PUBLIC_URL)
        return super().principal_for(token)


# Tokens remembered by CachedBearerTokenAuthentication at most, per process.
_MAX_VERIFIED = 10_000

_HOLDER_AUTHENTICATION = HolderAuthentication()


def holder_principal(request):
    """The principal of a block request on the node server's own path (``workers.blockpath``),
    checked as DRF checks a view with ``HolderAuthentication``, ``IsAuthenticated`` and
    ``PrincipalRateThrottle``: the same exceptions (401, 429 for the failed-auth budget and for
    the principal's rate), for ``problem_answer`` to answer alike. ``request`` needs only
    ``META``."""
    found = _HOLDER_AUTHENTICATION.authenticate(request)
    principal = found[0] if found is not None else None
    if not getattr(principal, "is_authenticated", False):
        raise exceptions.NotAuthenticated()
    wait = PrincipalRateThrottle.take(request, principal)
    if wait:
        raise exceptions.Throttled(max(wait, 0.001))
    return principal


# DRF exceptions map to our problem names by class; anything else by its status code.
_PROBLEM_FOR_DRF = (
    (exceptions.NotAuthenticated, "kvsp-unauthenticated"),
    (exceptions.AuthenticationFailed, "kvsp-unauthenticated"),
    (exceptions.PermissionDenied, "kvsp-forbidden"),
    (exceptions.NotFound, "kvsp-not-found"),
    (exceptions.MethodNotAllowed, "kvsp-method-not-allowed"),
    (exceptions.NotAcceptable, "kvsp-not-acceptable"),
    (exceptions.UnsupportedMediaType, "kvsp-unsupported-media-type"),
    (exceptions.Throttled, "kvsp-too-many-requests"),
    (exceptions.ParseError, "kvsp-malformed-request"),
    (exceptions.ValidationError, "kvsp-malformed-request"),
)

PROBLEM_FOR_STATUS = {
    400: "kvsp-malformed-request",
    401: "kvsp-unauthenticated",
    403: "kvsp-forbidden",
    404: "kvsp-not-found",
    405: "kvsp-method-not-allowed",
    406: "kvsp-not-acceptable",
    409: "kvsp-conflict",
    412: "kvsp-precondition-failed",
    413: "kvsp-payload-too-large",
    415: "kvsp-unsupported-media-type",
    429: "kvsp-too-many-requests",
    502: "kvsp-upstream-error",
    503: "kvsp-unavailable",
}


def problem_for_status(status_code: int) -> str:
    if status_code in PROBLEM_FOR_STATUS:
        return PROBLEM_FOR_STATUS[status_code]
    return "kvsp-internal-error" if status_code >= 500 else "kvsp-malformed-request"


def _flatten_validation_detail(detail, path: str = "") -> list[str]:
    if isinstance(detail, dict):
        lines = []
        for key, value in detail.items():
            lines += _flatten_validation_detail(value, f"{path}.{key}" if path else str(key))
        return lines
    if isinstance(detail, list):
        lines = []
        for item in detail:
            lines += _flatten_validation_detail(item, path)
        return lines
    return [f"{path}: {detail}" if path else str(detail)]


def problem_response(
    problem: str, detail: str, *, status_code: int | None = None, headers=None
) -> Response:
    document = problem_document(problem, detail, status=status_code)
    return Response(
        document, status=document["status"], content_type=PROBLEM_MEDIA_TYPE, headers=headers
    )


def problem_for_exception(exc, where: str = "a view") -> tuple[str, str, int | None, dict]:
    """The problem details an exception is answered with: (problem, detail, status, headers).

    What DRF's exception handler and the lean block path (``workers.api.views``) share, so that
    both answer every error alike."""
    if isinstance(exc, ProtocolError):
        return exc.problem, exc.detail, exc.status, {}
    if isinstance(exc, (OperationalError, InterfaceError)):
        log.warning("database unavailable: %s", exc)
        return "kvsp-unavailable", "the database is unavailable; retry", None, {"Retry-After": "1"}
    if isinstance(exc, DataError):
        return "kvsp-invalid-record", OUT_OF_RANGE_DETAIL, None, {}
    if isinstance(exc, IntegrityError):
        # A uniqueness rule the request's own checks missed (a concurrent request made the
        # same row first, say): the statement failed inside the transaction, nothing changed.
        log.warning("a request tripped a database constraint: %s", exc)
        return "kvsp-conflict", _CONSTRAINT, None, {}
    if isinstance(exc, Http404):
        return "kvsp-not-found", "no such resource", None, {}
    if isinstance(exc, RequestDataTooBig):
        return "kvsp-payload-too-large", "the request body is too large", None, {}
    if isinstance(exc, PermissionDenied):
        return "kvsp-forbidden", "not allowed", None, {}
    if isinstance(exc, SuspiciousOperation):
        return "kvsp-malformed-request", "the request was refused as malformed", None, {}
    if isinstance(exc, exceptions.APIException):
        problem = next(
            (name for cls, name in _PROBLEM_FOR_DRF if isinstance(exc, cls)),
            problem_for_status(exc.status_code),
        )
        if isinstance(exc, exceptions.ValidationError):
            detail = "; ".join(_flatten_validation_detail(exc.detail))
        else:
            detail = str(exc.detail)
        headers = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            headers["Retry-After"] = str(int(exc.wait))
        return problem, detail, exc.status_code, headers
    log.exception("uncaught error in %s", where)
    return "kvsp-internal-error", "the server failed to handle the request", None, {}


def problem_exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER: every exception a view raises becomes problem details."""
    view = context.get("view")
    problem, detail, status_code, headers = problem_for_exception(
        exc, type(view).__name__ if view else "a view"
    )
    return problem_response(problem, detail, status_code=status_code, headers=headers or None)


def problem_answer(exc, where: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """``problem_exception_handler``'s answer to ``exc`` as a status, header fields and a body,
    for code that answers without DRF (``problem_http_response_for``, and the node's server,
    ``workers.blockpath``)."""
    problem, detail, status_code, headers = problem_for_exception(exc, where)
    document = problem_document(problem, detail, status=status_code)
    fields = {"content-type": ("Content-Type", PROBLEM_MEDIA_TYPE)}
    if document["status"] == status.HTTP_401_UNAUTHORIZED:
        fields["www-authenticate"] = ("WWW-Authenticate", 'Bearer realm="kvsp"')
    for name, value in headers.items():
        fields[name.lower()] = (name, value)
    return document["status"], list(fields.values()), orjson.dumps(document)


def problem_http_response_for(exc, where: str) -> HttpResponse:
    """``problem_exception_handler`` for code outside DRF views: a plain Django response."""
    status_code, fields, body = problem_answer(exc, where)
    response = HttpResponse(body, status=status_code)
    for name, value in fields:
        response[name] = value
    return response


def problem_http_response(problem: str, detail: str, status_code: int | None = None):
    """A plain Django response with problem details, for code outside DRF views."""
    document = problem_document(problem, detail, status=status_code)
    response = HttpResponse(
        orjson.dumps(document), status=document["status"], content_type=PROBLEM_MEDIA_TYPE
    )
    if document["status"] == status.HTTP_401_UNAUTHORIZED:
        response["WWW-Authenticate"] = 'Bearer realm="kvsp"'
    return response


def is_api_path(path: str) -> bool:
    return path.startswith(API_PREFIXES)


# The database refused a value the record rules admit (a number past what its column holds):
# the request changed nothing, since the statement failed inside its transaction.
OUT_OF_RANGE_DETAIL = "a value of the request is out of the range this implementation stores"
_CONSTRAINT = (
    "the request conflicts with what is stored (perhaps by a concurrent request); it changed "
    "nothing"
)
_SAFE_DETAIL = {
    400: "the request was refused as malformed",
    401: "authentication required",
    403: "not allowed",
    404: "no such resource",
    405: "method not allowed on this resource",
    413: "the request body is too large",
    500: "the server failed to handle the request",
}


class ProblemDetailsMiddleware:
    """Turns any non-problem error response on an API path into problem details.

    Django answers unmatched URLs, disallowed hosts, CSRF failures and crashes outside DRF with
    HTML pages (technical ones under DEBUG); on the API those become problem details instead.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            response.status_code >= 400
            and is_api_path(request.path)
            and response.get("Content-Type", "").split(";")[0].strip() != PROBLEM_MEDIA_TYPE
        ):
            code = response.status_code
            return problem_http_response(
                problem_for_status(code), _SAFE_DETAIL.get(code, "request failed"), code
            )
        return response

    def process_exception(self, request, exception):
        if not is_api_path(request.path):
            return None
        if isinstance(exception, ProtocolError):
            return problem_http_response(exception.problem, exception.detail, exception.status)
        if isinstance(exception, Http404):
            return problem_http_response("kvsp-not-found", "no such resource")
        if isinstance(exception, (OperationalError, InterfaceError)):
            log.warning("database unavailable: %s", exception)
            response = problem_http_response("kvsp-unavailable", "the database is unavailable")
            response["Retry-After"] = "1"
            return response
        if isinstance(exception, DataError):
            return problem_http_response("kvsp-invalid-record", OUT_OF_RANGE_DETAIL)
        log.exception("uncaught error on %s", request.path)
        return problem_http_response("kvsp-internal-error", _SAFE_DETAIL[500])


# The OpenAPI description registers the bearer scheme when imported.
import common.openapi  # noqa: E402, F401
