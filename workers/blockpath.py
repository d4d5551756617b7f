"""The block GETs and HEADs a loader sends (spec 6.7), answered by the node's server itself.

A loader sends one GET per block, thousands per directive, each for the whole container. What
Django's handler, the node's middleware and a DRF view cost around such a request is several
times what the answer itself costs (a token already verified, one row read and touched, one file
opened), so the node's server (``kvspsite.asgi``) hands exactly these requests to
``LeanBlockRequests``: GET or HEAD of ``/kvsp/blocks/{compat}/{scope}/{block_key}``, no query,
asking for the container (no Accept, ``*/*`` or ``application/kvsp-block``), for a host that
ALLOWED_HOSTS admits, with no setting that would have SecurityMiddleware redirect it or read the
scheme from a proxy's field. Everything else goes to Django.

The answers are Django's to the letter: the same checks (``holder_principal``: a bearer or
delegated token, the auth cache, the failed-auth budget, the principal's rate; the scope, a miss
for a scope the principal may not read), the same read (``serving.representation_for``), the
same problem details (``problem_answer``), the same header fields (those of the representation,
Allow and Vary as DRF adds them, and those SecurityMiddleware adds, taken from it), the same
request metrics, and the same database connection handling as a request's start and end.
``tests/node/test_blocks.py`` compares the two paths' answers field by field.
"""

from __future__ import annotations

import io
import re
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.handlers.wsgi import WSGIRequest
from django.db import close_old_connections
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from django.middleware.security import SecurityMiddleware

from common.api import problem_answer
from common.metrics import REQUEST_SECONDS, REQUESTS
from index.authentication import holder_principal
from workers import serving
from workers.api.views import BLOCK_ACCEPT
from workers.metrics import BLOCKS_SENT

_PATH = re.compile(r"/kvsp/blocks/([0-9a-f]{64})/([0-9a-f]{32})/([0-9a-f]{64})")
_ACCEPTED = frozenset(value.encode("latin-1") for value in BLOCK_ACCEPT if value is not None)
# The Allow field DRF gives every answer of the block view.
_ALLOW = ("Allow", "GET, PUT, HEAD, OPTIONS")
_VARY = ("Vary", "Accept")
# The URL pattern's name, under which the request metrics count the view's requests.
ENDPOINT = "block"
# A body this large or smaller is read in one piece with the row; a larger one is sent a
# ``serving.CHUNK`` at a time.
WHOLE_OCTETS = 4 << 20
_NO_PARAMS: dict[str, str] = {}


@dataclass
class LeanAnswer:
    """An answer: its status, header fields and body, then, for a large block, the rest of the
    body to send a piece at a time (``rest.pieces()``)."""

    status: int
    fields: list[tuple[bytes, bytes]]
    body: bytes = b""
    rest: serving.Representation | None = None


class _Request:
    """What ``holder_principal`` reads of a request: ``META``, and the Authorization field
    (DRF reads it from ``headers``)."""

    __slots__ = ("META", "headers")

    def __init__(self, meta: dict):
        self.META = meta
        authorization = meta.get("HTTP_AUTHORIZATION")
        self.headers = {} if authorization is None else {"authorization": authorization}


class LeanBlockRequests:
    """The node's own path for block GETs and HEADs (module docstring). ``route`` runs on the
    server's event loop and decides; ``answer`` runs in one of the server's request threads."""

    def __init__(self):
        self._security: dict[str, list[tuple[str, str]]] = {}

    def route(self, scope) -> tuple[bytes, bytes, bytes] | None:
        """The block's ids when this path answers the request; None sends it to Django."""
        if scope["method"] not in ("GET", "HEAD") or scope.get("query_string"):
            return None
        match = _PATH.fullmatch(scope["path"])
        if match is None:
            return None
        accept = host = None
        for name, value in scope["headers"]:
            if name == b"accept":
                if accept is not None:
                    return None  # Django joins repeated fields into a value it negotiates
                accept = value
            elif name == b"host":
                if host is not None:
                    return None
                host = value
        if accept is not None and accept not in _ACCEPTED:
            return None
        if host is None or settings.USE_X_FORWARDED_HOST or settings.SECURE_PROXY_SSL_HEADER:
            return None
        if settings.SECURE_SSL_REDIRECT and scope.get("scheme") != "https":
            return None
        domain, _ = split_domain_port(host.decode("latin-1"))
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return None  # Django answers it: 400, as problem details
        compat_id, scope_id, block_key = match.groups()
        return bytes.fromhex(compat_id), bytes.fromhex(scope_id), bytes.fromhex(block_key)

    def answer(self, scope, ids: tuple[bytes, bytes, bytes]) -> LeanAnswer:
        """The answer to a request ``route`` took, as Django would have given it."""
        started = time.perf_counter()
        method = scope["method"]
        close_old_connections()  # what Django does as a request starts
        try:
            answer = self._answer(scope, ids, method)
        finally:
            close_old_connections()  # and as it ends
        answer.fields += [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in (_ALLOW, _VARY, *self._security_fields(scope.get("scheme")))
        ]
        REQUEST_SECONDS.labels(ENDPOINT, method).observe(time.perf_counter() - started)
        REQUESTS.labels(ENDPOINT, method, str(answer.status)).inc()
        return answer

    def _answer(self, scope, ids, method: str) -> LeanAnswer:
        try:
            principal = holder_principal(_Request(_meta(scope)))
            sent = serving.representation_for(principal, _NO_PARAMS, ids)
        except Exception as exc:  # noqa: BLE001 - every error leaves as problem details
            status, fields, body = problem_answer(exc, "BlockView")
            fields.append(("Content-Length", str(len(body))))
            return LeanAnswer(status, _encoded(fields), b"" if method == "HEAD" else body)
        fields = _encoded([*sent.fields(), ("Content-Length", str(sent.length))])
        if method == "HEAD":
            sent.close()
            return LeanAnswer(200, fields)
        BLOCKS_SENT.labels("get").inc()
        if sent.length <= WHOLE_OCTETS:
            return LeanAnswer(200, fields, sent.read())
        return LeanAnswer(200, fields, rest=sent)

    def _security_fields(self, scheme: str | None) -> list[tuple[str, str]]:
        """The fields SecurityMiddleware adds to an answer of this scheme, found by asking it
        once (its settings do not change while the process runs)."""
        scheme = scheme or "http"
        found = self._security.get(scheme)
        if found is None:
            request = WSGIRequest(
                {
                    "REQUEST_METHOD": "GET",
                    "PATH_INFO": "/",
                    "SERVER_NAME": "localhost",
                    "SERVER_PORT": "443" if scheme == "https" else "80",
                    "wsgi.url_scheme": scheme,
                    "wsgi.input": io.BytesIO(),
                }
            )
            response = HttpResponse()
            plain = set(response.headers)
            response = SecurityMiddleware(lambda _: response)(request)
            found = [(name, value) for name, value in response.items() if name not in plain]
            self._security[scheme] = found
        return found


def _meta(scope) -> dict:
    meta = {}
    client = scope.get("client")
    if client:
        meta["REMOTE_ADDR"] = str(client[0])
    for name, value in scope["headers"]:
        if name == b"authorization":
            key = "HTTP_AUTHORIZATION"
        elif name == b"x-forwarded-for":
            key = "HTTP_X_FORWARDED_FOR"
        else:
            continue
        text = value.decode("latin-1")
        meta[key] = f"{meta[key]},{text}" if key in meta else text
    return meta


def _encoded(fields: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in fields]
