"""HTTP between roles: the one client for peers, and one policy for what their failures mean.

Every role talks to the others over the same API a foreign engine or holder would use. Messages
(records, leases, directives, checkpoints, status) go through ``peer_client``, an httpx client
with the bearer token of this process (``KVSP_TOKEN``), sent with ``call``. A loader's block
GETs, hundreds a second, go through ``BlockConnections``: kept-alive connections of the
standard library's client, which costs a fraction of httpx's CPU per request and hands a body
over as the socket delivers it. Both use the process's one TLS context, and both answer a
failure the same way:

- the peer cannot be reached, the connection breaks (before or during the answer), or the
  peer does not answer in time: ``PeerUnreachable``;
- the peer answers 5xx (it is overloaded, restarting, or waiting on a peer of its own):
  ``PeerUnreachable``, whatever the body says;
- the peer answers 4xx with problem details of ours (RFC 9457, a type ``kvsp.problems``
  registers): a ``ProtocolError`` of that type, with the peer's status and detail;
- any other answer that is not a success, or an answer that breaks HTTP (a redirect loop, a
  bad content encoding): ``ProtocolError("kvsp-upstream-error")``.

``PeerUnreachable`` is transient: it is a ConnectionError, so a task declared with
``common.tasks.kvsp_task`` runs again later (``RETRYABLE``), and a caller with other places to
go (the loader's next source) goes there. A ``ProtocolError`` is final: the same request would
be refused the same way, and no task retries it. What a particular answer means beyond this
(a 404 of a block is a miss, 6.1; a 412 of a PUT is a replica already there, 6.7) is the
caller's to say before it hands the answer here.
"""

from __future__ import annotations

import functools
import http.client
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import orjson
from django.conf import settings

from kvsp.problems import ProtocolError, problem_name

DEFAULT_TIMEOUT = httpx.Timeout(10.0, connect=2.0)


class PeerUnreachable(ConnectionError):
    """The peer could not be reached, did not answer in time, or answered 5xx: worth trying
    again later.

    A ConnectionError, so that ``kvsp_task`` retries it.
    """


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context, the one httpx would build for each client: building it
    reads and parses the CA bundle, 36-165 ms on two busy cores, which every directive's loader
    and each directive sender's first send paid before their first request."""
    return httpx.create_ssl_context()


def peer_client(*, token: str | None = None, timeout=DEFAULT_TIMEOUT) -> httpx.Client:
    token = settings.KVSP_TOKEN if token is None else token
    headers = {"Accept": "application/kvsp+json, application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(headers=headers, timeout=timeout, verify=tls_context())


def call(client: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
    """One request; a transport failure or timeout is PeerUnreachable, an answer that breaks
    HTTP a ProtocolError (the policy in the module docstring)."""
    try:
        return client.request(method, url, **kwargs)
    except httpx.TransportError as exc:
        raise unreachable(exc, f"{method} {url}") from exc
    except httpx.RequestError as exc:
        raise ProtocolError(
            "kvsp-upstream-error", f"{method} {url}: {exc.__class__.__name__}"
        ) from exc


def raise_for_problem(response: httpx.Response) -> httpx.Response:
    """The response when it is a success; else what its failure means (``refusal``)."""
    if response.is_success:
        return response
    raise refusal(
        response.status_code,
        problem_details(response.content),
        str(response.request.url),
        response.reason_phrase,
    )


def unreachable(exc: BaseException, what: str) -> PeerUnreachable:
    """A transport failure of the request ``what``."""
    return PeerUnreachable(f"{what}: {exc.__class__.__name__}")


def refusal(
    status: int, document: object, what: str, reason: str = ""
) -> PeerUnreachable | ProtocolError:
    """What a peer's answer of ``status`` to ``what``, not a success, means: PeerUnreachable
    for a 5xx; the peer's own problem for 4xx problem details of ours (``document``, as parsed);
    else kvsp-upstream-error."""
    details = document if isinstance(document, dict) else {}
    said = str(details.get("detail") or "")
    answered = f"{status} {said or reason}".rstrip()
    if status >= 500:
        return PeerUnreachable(f"{what}: {answered}")
    name = problem_name(str(details.get("type", "")))
    if name is None:
        return ProtocolError("kvsp-upstream-error", f"{what}: {answered}")
    return ProtocolError(
        name, f"{what}: {said or answered}", status=status if 400 <= status < 500 else None
    )


def problem_details(body: bytes) -> object:
    """The body of an answer that is not a success, parsed as JSON; None when it is not."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


class BlockConnections:
    """Kept-alive HTTP/1.1 connections for block requests, shared by any number of threads:
    each request takes an idle connection to its origin (or opens one) and gives it back once
    the body is read to its end.

    The standard library's client rather than httpx for the loader's hundreds of requests per
    second: it costs a fraction of httpx's CPU per request, which on a node's few cores is time
    taken from the requests in flight beside it, and it hands a body over as the socket
    delivers it, with none of httpx's re-chunking. Failures follow the module's policy: a
    transport failure while the request is sent or its answer read (inside the ``with``) is
    PeerUnreachable; the status is the caller's to judge (``refusal``).
    """

    def __init__(self, headers: dict[str, str] | None = None):
        self.headers = dict(headers or {})
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> BlockConnections:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def get(self, url: str, headers: dict[str, str], timeout: float):
        """GET ``url``; the response, whose body the caller reads with ``readinto``. The
        connection goes back to the idle ones only when its response was read to the end."""
        return self.request("GET", url, headers, timeout)

    @contextmanager
    def request(
        self, method: str, url: str, headers: dict[str, str], timeout: float, body=None
    ) -> Iterator[BlockResponse]:
        """``method`` on ``url`` with ``body``, as ``get``: only for requests that are safe to
        send again (a GET, or a POST that only reads, such as a batch of blocks)."""
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ProtocolError("kvsp-upstream-error", f"not an http(s) URL: {url}")
        origin = (parts.scheme, parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme])
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        fields = {**self.headers, **headers}
        connection, reused = self._take(origin, timeout)
        response = None
        try:
            try:
                connection.request(method, target, body=body, headers=fields)
                raw = connection.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                # The origin closed the idle connection meanwhile: the request is safe to send
                # again.
                connection.close()
                connection, _ = self._take(origin, timeout, fresh=True)
                connection.request(method, target, body=body, headers=fields)
                raw = connection.getresponse()
            response = BlockResponse(raw)
            yield response
        except PeerUnreachable:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise unreachable(exc, f"{method} {url}") from exc
        finally:
            if response is not None and response.reusable:
                self._give_back(origin, connection)
            else:
                connection.close()

    def _take(
        self, origin: tuple[str, str, int], timeout: float, *, fresh: bool = False
    ) -> tuple[http.client.HTTPConnection, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(origin)
                connection = idle.pop() if idle else None
            if connection is not None:
                connection.timeout = timeout
                if connection.sock is not None:
                    connection.sock.settimeout(timeout)
                return connection, True
        scheme, host, port = origin
        if scheme == "https":
            return http.client.HTTPSConnection(
                host, port, timeout=timeout, context=tls_context()
            ), False
        return http.client.HTTPConnection(host, port, timeout=timeout), False

    def _give_back(self, origin: tuple[str, str, int], connection) -> None:
        with self._lock:
            self._idle.setdefault(origin, []).append(connection)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class BlockResponse:
    """What ``BlockConnections.request`` answers: the status, the fields, and the body."""

    def __init__(self, raw: http.client.HTTPResponse):
        self._raw = raw
        self._abandoned = False
        self.status_code = raw.status
        self.reason_phrase = raw.reason
        self.headers = raw.headers

    @property
    def reusable(self) -> bool:
        """The body was read to its end and the origin keeps the connection open."""
        return self._raw.isclosed() and not self._raw.will_close and not self._abandoned

    def readinto(self, target: memoryview) -> int:
        """Read the body into ``target`` until it is full or the body ends; the octets read.
        Past what the client buffered, the socket writes into ``target`` itself."""
        return self._raw.readinto(target)

    def readline(self, limit: int) -> bytes:
        """One line of the body, with its line end, of at most ``limit`` octets."""
        return self._raw.readline(limit)

    def read_all(self, limit: int = 1 << 16) -> bytes:
        """The (short) body of an answer that is not a block, at most ``limit`` octets."""
        data = self._raw.read(limit)
        if not self._raw.isclosed():
            self._abandoned = True  # octets are left unread: the connection is not reused
        return data

    def refusal(self, what: str) -> PeerUnreachable | ProtocolError:
        """What this answer, not a success, means (``refusal``), its short body read."""
        return refusal(self.status_code, problem_details(self.read_all()), what, self.reason_phrase)
