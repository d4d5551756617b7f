"""HTTP between roles: one client configuration, and peers' problem details as exceptions.

Every role talks to the others over the same API a foreign engine or holder would use, with the
bearer token of this process (``KVSP_TOKEN``).
"""

from __future__ import annotations

import functools
import ssl

import httpx
from django.conf import settings

from kvsp.problems import ProtocolError, problem_name

DEFAULT_TIMEOUT = httpx.Timeout(10.0, connect=2.0)


class PeerUnreachable(ConnectionError):
    """The peer could not be reached or did not answer in time: worth retrying later.

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
    """One request; transport failures become PeerUnreachable."""
    try:
        return client.request(method, url, **kwargs)
    except httpx.TransportError as exc:
        raise PeerUnreachable(f"{method} {url}: {exc.__class__.__name__}") from exc


def raise_for_problem(response: httpx.Response) -> httpx.Response:
    """The response when it is a success; a 5xx as PeerUnreachable; else a ProtocolError with
    the peer's problem type when it is one of ours.
    """
    if response.is_success:
        return response
    if response.status_code >= 500:
        raise PeerUnreachable(f"{response.request.url} answered {response.status_code}")
    name, detail = None, response.reason_phrase
    try:
        document = response.json()
        name = problem_name(str(document.get("type", "")))
        detail = str(document.get("detail", detail))
    except ValueError:
        pass
    if name is None:
        name = "kvsp-upstream-error"
    raise ProtocolError(name, f"{response.request.url}: {detail}", status=response.status_code)
