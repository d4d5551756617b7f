"""Whatever is wrong with a request to a node, the answer is RFC 9457 problem details with the
right type, never a page or a traceback (DESIGN.md section 3)."""

from __future__ import annotations

import pytest

from tests.node.support import assert_problems, problem, random_key

pytestmark = pytest.mark.django_db


def endpoints(cluster) -> list[tuple[str, str]]:
    block = f"blocks/{cluster.compat}/{cluster.scope_a}/{random_key()}"
    return [
        ("GET", block),
        ("PUT", block),
        ("POST", "leases"),
        ("PUT", "leases/some-lease"),
        ("DELETE", "leases/some-lease"),
        ("POST", "prefetch"),
        ("GET", "prefetch/6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"),
        ("PUT", "state"),
    ]


@pytest.mark.parametrize("token", [None, "kvsp_not-a-token", "Basic abc"])
def test_every_endpoint_needs_a_valid_bearer_token(cluster, token):
    n1 = cluster.node("n1")
    api = n1.api(None)
    headers = {}
    if token is not None:
        headers["Authorization"] = token if " " in token else f"Bearer {token}"
    for method, path in endpoints(cluster):
        response = api.client.request(method, path, headers=headers, json={})
        assert response.status_code == 401, (method, path, response.text)
        assert problem(response) == "kvsp-unauthenticated"
        assert response.headers["www-authenticate"].startswith("Bearer")


def test_unknown_paths_wrong_methods_and_malformed_ids(cluster):
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    cases = [
        (api.get("nothing/here"), 404, "kvsp-not-found"),
        (
            api.get(f"blocks/{cluster.compat.upper()}/{cluster.scope_a}/{random_key()}"),
            404,
            "kvsp-not-found",
        ),
        (api.get(f"blocks/{cluster.compat}/{cluster.scope_a}/abc"), 404, "kvsp-not-found"),
        (
            api.delete(f"blocks/{cluster.compat}/{cluster.scope_a}/{random_key()}"),
            405,
            "kvsp-method-not-allowed",
        ),
        (api.post("state", json={}), 405, "kvsp-method-not-allowed"),
        (api.get("leases/x"), 405, "kvsp-method-not-allowed"),
    ]
    assert_problems(cases)
