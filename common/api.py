"""REST plumbing shared by both roles: media types, parsers and renderers, RFC 9457 problem
details. (Bearer tokens are the Index Service's: ``index.authentication``.)

Every error on the API, wherever it arises (a view, the URL resolver, a parser, the auth layer,
the node's own block path or an uncaught exception), leaves as ``application/problem+json``
whose ``type`` ends with the problem's name, by one mapping (``problem_for_exception``) that
DRF's exception handler, ``ProblemDetailsMiddleware`` and the raw paths all answer with. A 5xx
never echoes internal text.
"""

from __future__ import annotations

import logging
import mmap
import tempfile
from contextlib import suppress
from pathlib import Path

import orjson
from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.db import DataError, IntegrityError, InterfaceError, OperationalError
from django.http import Http404, HttpResponse
from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer
from rest_framework.response import Response

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


class KvspBlockRenderer(KvspJSONRenderer):
    """``application/kvsp-block``: octets or container parts as they are; anything else (the
    problem details of an error) as JSON."""

    media_type = KVSP_BLOCK
    format = "kvsp-block"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, bytes | bytearray | memoryview):
            return bytes(data)
        if isinstance(data, list | tuple):
            return b"".join(data)
        return super().render(data, accepted_media_type, renderer_context)


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


def require_object(value, what: str = "the body") -> dict:
    """``value`` when it is a JSON object; else ``kvsp-malformed-request``: what every request
    whose body (or item of a batch, ``what``) is an object refuses anything else with."""
    if not isinstance(value, dict):
        raise ProtocolError("kvsp-malformed-request", f"{what} must be a JSON object")
    return value


# The database refused a value the record rules admit (a number past what its column holds):
# the request changed nothing, since the statement failed inside its transaction.
OUT_OF_RANGE_DETAIL = "a value of the request is out of the range this implementation stores"
_CONSTRAINT = (
    "the request conflicts with what is stored (perhaps by a concurrent request); it changed "
    "nothing"
)
# What an error is told when its own text may not leave the server, by status.
_SAFE_DETAIL = {
    400: "the request was refused as malformed",
    401: "authentication required",
    403: "not allowed",
    404: "no such resource",
    405: "method not allowed on this resource",
    413: "the request body is too large",
    500: "the server failed to handle the request",
}


def problem_for_exception(exc, where: str = "a view") -> tuple[str, str, int | None, dict]:
    """The problem details an exception is answered with: (problem, detail, status, headers).

    The one mapping: DRF's exception handler, ``ProblemDetailsMiddleware`` (errors outside DRF
    views) and the node's raw block paths (``workers.blockpath``, ``workers.serving``) all
    answer with it, so that every path answers every error alike."""
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
        return "kvsp-not-found", _SAFE_DETAIL[404], None, {}
    if isinstance(exc, RequestDataTooBig):
        return "kvsp-payload-too-large", _SAFE_DETAIL[413], None, {}
    if isinstance(exc, PermissionDenied):
        return "kvsp-forbidden", _SAFE_DETAIL[403], None, {}
    if isinstance(exc, SuspiciousOperation):
        return "kvsp-malformed-request", _SAFE_DETAIL[400], None, {}
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
    return "kvsp-internal-error", _SAFE_DETAIL[500], None, {}


def problem_exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER: every exception a view raises becomes problem details."""
    view = context.get("view")
    problem, detail, status_code, headers = problem_for_exception(
        exc, type(view).__name__ if view else "a view"
    )
    document = problem_document(problem, detail, status=status_code)
    return Response(
        document,
        status=document["status"],
        content_type=PROBLEM_MEDIA_TYPE,
        headers=headers or None,
    )


def _problem_fields(
    problem: str, detail: str, status_code: int | None, headers: dict
) -> tuple[int, list[tuple[str, str]], bytes]:
    document = problem_document(problem, detail, status=status_code)
    fields = {"content-type": ("Content-Type", PROBLEM_MEDIA_TYPE)}
    if document["status"] == status.HTTP_401_UNAUTHORIZED:
        fields["www-authenticate"] = ("WWW-Authenticate", 'Bearer realm="kvsp"')
    for name, value in headers.items():
        fields[name.lower()] = (name, value)
    return document["status"], list(fields.values()), orjson.dumps(document)


def problem_answer(exc, where: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """The answer to ``exc`` (``problem_for_exception``) as a status, header fields and a body,
    for code that answers without DRF: ``ProblemDetailsMiddleware``, and the node's server
    (``workers.blockpath``, ``workers.serving``)."""
    return _problem_fields(*problem_for_exception(exc, where))


def _http_response(answer: tuple[int, list[tuple[str, str]], bytes]) -> HttpResponse:
    status_code, fields, body = answer
    response = HttpResponse(body, status=status_code)
    for name, value in fields:
        response[name] = value
    return response


def is_api_path(path: str) -> bool:
    return path.startswith(API_PREFIXES)


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
            detail = _SAFE_DETAIL.get(code, "request failed")
            return _http_response(_problem_fields(problem_for_status(code), detail, code, {}))
        return response

    def process_exception(self, request, exception):
        if not is_api_path(request.path):
            return None
        return _http_response(problem_answer(exception, request.path))
