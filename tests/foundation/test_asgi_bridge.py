"""The control plane's server (common/asgibridge.py) hands requests to Django as gthread did:
bodies whole or chunked, a body past the limit refused without being read whole, paths and
query strings as sent."""

import httpx
import pytest

from tests.support.fixtures import make_caller, make_scope, random_key

pytestmark = pytest.mark.django_db(transaction=True)

COMPAT = "c0" * 32


@pytest.fixture
def served(role_env, start_process):
    scope = make_scope("tenant-a")
    router = make_caller("router", scopes=[scope])
    server = start_process("server", "bridge", role_env(KVSP_MAX_BODY_OCTETS="4096"), workers=1)
    return server, scope.scope_id_hex, {"Authorization": f"Bearer {router.token}"}


def lookup(scope_hex: str, keys: int) -> dict:
    return {"scope_id": scope_hex, "compat_id": COMPAT, "block_keys": [random_key()] * keys}


def test_bodies_arrive_whole_or_chunked_and_past_the_limit_are_413(served):
    server, scope_hex, headers = served
    url = f"{server.url}/kvsp/lookup"
    with httpx.Client(timeout=10, headers=headers) as client:
        whole = client.post(url, json=lookup(scope_hex, 4))
        assert (whole.status_code, whole.json()["matched"]) == (200, 0)

        body = httpx.Request("POST", url, json=lookup(scope_hex, 4)).content

        def chunks():
            yield body[:10]
            yield body[10:]

        chunked = client.post(url, content=chunks(), headers={"Content-Type": "application/json"})
        assert (chunked.status_code, chunked.json()["matched"]) == (200, 0)

        too_large = client.post(url, json=lookup(scope_hex, 200))
        assert too_large.status_code == 413
        assert too_large.headers["content-type"] == "application/problem+json"
        assert too_large.json()["type"].endswith("/kvsp-payload-too-large")
        # The server is still there for the next request.
        assert client.get(f"{server.url}/healthz").status_code == 200


def test_paths_and_query_strings_reach_django_as_sent(served):
    server, _, headers = served
    with httpx.Client(timeout=10, headers=headers) as client:
        odd = client.get(f"{server.url}/kvsp/sessions/%E2%9C%93/output")
        assert odd.status_code == 400
        assert odd.json()["type"].endswith("/kvsp-malformed-request")
        after = client.get(
            f"{server.url}/kvsp/sessions/00000000-0000-0000-0000-000000000000/output",
            params={"after": "x y"},
        )
        assert after.status_code == 400
        assert "after must be an integer" in after.json()["detail"]
