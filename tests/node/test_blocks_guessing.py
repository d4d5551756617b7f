"""Guessed tokens at a holder: past ``KVSP_AUTH_FAILURES_BURST`` refused tokens, an address's
block and lease requests are answered 429 before their token is looked up, while the tokens
the serving process has verified keep working, with the auth cache of block and lease requests
(``KVSP_AUTH_CACHE_S``) and without it.

Each node here is a server of its own (one HTTP process, so that one budget is counted), with a
budget of five failures that refills too slowly to matter during a test: the package's nodes
keep the default budget, which the other tests' refused tokens stay far below.
"""

from __future__ import annotations

import os

import pytest

from tests.node.conftest import Node, extra_node, serving_http
from tests.node.support import container, problem, random_key

pytestmark = pytest.mark.django_db

BURST = 5


@pytest.fixture(scope="module")
def guarded_nodes(cluster, django_db_blocker, role_env, log_dir):
    run = os.urandom(3).hex()
    nodes: dict[str, Node] = {}
    with django_db_blocker.unblock():
        for cache_s in ("0", "2"):
            nodes[cache_s] = extra_node(
                cluster,
                role_env,
                log_dir,
                f"guarded-{cache_s}-{run}",
                [bytes.fromhex(cluster.scope_a)],
                KVSP_AUTH_CACHE_S=cache_s,
                KVSP_AUTH_FAILURES_PER_S="0.001",
                KVSP_AUTH_FAILURES_BURST=str(BURST),
            )
    with serving_http(nodes):
        yield nodes


@pytest.mark.parametrize("auth_cache_s", ["0", "2"])
def test_guessed_tokens_get_429_and_verified_tokens_keep_reading(
    cluster, guarded_nodes, auth_cache_s
):
    node = guarded_nodes[auth_cache_s]
    key = random_key()
    stored = node.api(node.token).put_block(cluster.compat, cluster.scope_a, key, container(7))
    assert stored.status_code == 201, stored.text
    reader = node.api(cluster.tokens["reader_a"])
    lease = {"compat_id": cluster.compat, "scope_id": cluster.scope_a, "block_keys": [key]}
    assert reader.get_block(cluster.compat, cluster.scope_a, key).status_code == 200

    guesser = node.api(f"kvsp_guessed-{random_key()[:16]}")
    # Forged delegated tokens count alike.
    forger = node.api(f"kvspd_{random_key()}")
    guesses = [
        caller.get_block(cluster.compat, cluster.scope_a, key)
        for caller in (guesser, forger, guesser, forger, guesser)
    ]
    assert [(r.status_code, problem(r)) for r in guesses] == [(401, "kvsp-unauthenticated")] * 5
    for refused in (
        guesser.get_block(cluster.compat, cluster.scope_a, key),
        guesser.post("leases", json={**lease, "ttl_ms": 1000}),
        # X-Forwarded-For is the client's own writing: it does not make another address.
        guesser.get(
            f"blocks/{cluster.compat}/{cluster.scope_a}/{key}",
            headers={"X-Forwarded-For": "198.51.100.7"},
        ),
    ):
        assert refused.status_code == 429, refused.text
        assert problem(refused) == "kvsp-too-many-requests"
        assert int(refused.headers["retry-after"]) >= 1

    # The tokens this process verified before are not slowed by the guesses from their address.
    reads = [reader.get_block(cluster.compat, cluster.scope_a, key) for _ in range(20)]
    assert [r.status_code for r in reads] == [200] * 20
    assert reads[-1].content == container(7)
    granted = reader.post("leases", json={**lease, "ttl_ms": 1000})
    assert granted.status_code == 201, granted.text
    assert node.api(node.token).get_block(cluster.compat, cluster.scope_a, key).status_code == 200
    # A token it has not verified yet cannot be told from a guess without the lookup: it waits.
    newcomer = node.api(cluster.tokens["reader_a2"])
    assert newcomer.get_block(cluster.compat, cluster.scope_a, key).status_code == 429
