"""Delegated tokens on real servers (DESIGN.md section 6): a node hands a source only a token for
that scope at that source, which no other holder, no other scope and not the control plane
takes, and which expires; holders take such tokens for blocks and leases of their scope alone;
the vLLM connector's client presents them too, one per scope and holder."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from kvsp.container import decode, encode_with_digests
from kvsp.records import ReplicaRecord
from kvsp_vllm.client import KvspClient, PeerError
from tests.node.support import Api, container, problem, random_key
from tests.node.test_prefetch import directive_body, run_directive
from tests.support.processes import run_manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db


def delegated(cluster, who: str, scope: str, audience: str, **extra) -> dict:
    answer = cluster.control(who).post(
        "tokens", json={"scope_id": scope, "audience": audience, **extra}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def lease_body(cluster, scope: str, keys: list[str]) -> dict:
    return {"compat_id": cluster.compat, "scope_id": scope, "block_keys": keys, "ttl_ms": 5000}


def assert_refused_by_the_control_plane(cluster, token: str) -> None:
    cp = Api(cluster.cp_url, token)
    for response in (
        cp.get(f"scopes/{cluster.scope_a}/key"),
        cp.post(
            "lookup",
            json={"scope_id": cluster.scope_a, "compat_id": cluster.compat, "block_keys": []},
        ),
        cp.post("tokens", json={"scope_id": cluster.scope_a, "audience": cluster.cp_url}),
        cp.post("tokens/introspect", json={"token": token}),
    ):
        assert response.status_code == 401, response.text
        assert problem(response) == "kvsp-unauthenticated"


def test_a_listener_posing_as_a_holder_receives_nothing_it_could_replay(cluster, standin):
    """A principal of scope A publishes records for a listener of its own; a prefetch from it
    hands the listener one delegated token, for scope A at the listener, and nothing else."""
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    listener = standin.holder
    listener.received.clear()
    keys = [random_key() for _ in range(3)]
    for offset, key in enumerate(keys):
        standin.add(key, container(9100 + offset))
    state = run_directive(
        cluster, n1, directive_body(cluster, [(key, [listener.url]) for key in keys])
    )
    assert state["state"] == "complete" and state["loaded"] == keys

    methods = [method for method, _, _ in listener.received]
    assert methods.count("GET") == 3 and "POST" in methods
    presented = {authorization for _, _, authorization in listener.received}
    # One token for every request of the load: one round trip to the control plane for it.
    assert len(presented) == 1
    [authorization] = presented
    scheme, token = authorization.split(" ")
    assert scheme == "Bearer" and token.startswith("kvspd_")
    assert token not in cluster.tokens.values()

    answer = cluster.control().post("tokens/introspect", json={"token": token}).json()
    assert answer["active"] is True
    assert answer["scope_id"] == cluster.scope_a and answer["audience"] == listener.url
    assert answer["exp"] <= time.time() + 61  # the control plane's cap, a minute

    # Replayed at a real holder that holds blocks of scope A: refused, for blocks and leases.
    key, data = random_key(), container(9200)
    own = n2.api(cluster.tokens["reader_a"])
    assert own.put_block(cluster.compat, cluster.scope_a, key, data).status_code == 201
    replay = n2.api(token)
    got = replay.get_block(cluster.compat, cluster.scope_a, key)
    assert got.status_code == 401 and problem(got) == "kvsp-unauthenticated"
    leased = replay.post("leases", json=lease_body(cluster, cluster.scope_a, [key]))
    assert leased.status_code == 401
    stored = replay.put_block(cluster.compat, cluster.scope_a, random_key(), data)
    assert stored.status_code == 401
    # At the node that sent it, which now holds what it loaded: refused as well.
    for holder in (n1, n2):
        for scope in (cluster.scope_a, cluster.scope_b):
            at = holder.api(token).get_block(cluster.compat, scope, keys[0])
            assert at.status_code == 401, (holder.name, scope)
    assert_refused_by_the_control_plane(cluster, token)


def test_a_delegated_token_is_good_for_its_scope_at_its_holder_only(cluster):
    """The node n2's principal holds both scopes; the token it is given for scope A at n1 does
    blocks and leases of scope A at n1, and of scope B nothing a principal without B could."""
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    key_a, key_b, data = random_key(), random_key(), container(9300)
    assert (
        n1.api(cluster.tokens["reader_a"])
        .put_block(cluster.compat, cluster.scope_a, key_a, data)
        .status_code
        == 201
    )
    assert (
        n1.api(cluster.tokens["reader_b"])
        .put_block(cluster.compat, cluster.scope_b, key_b, data)
        .status_code
        == 201
    )
    token = delegated(cluster, "n2", cluster.scope_a, n1.url)["token"]
    bearer = n1.api(token)

    assert bearer.get_block(cluster.compat, cluster.scope_a, key_a).content == data
    lease = bearer.post("leases", json=lease_body(cluster, cluster.scope_a, [key_a]))
    assert lease.status_code == 201, lease.text
    renewed = bearer.put(f"leases/{lease.json()['lease']}", json={"ttl_ms": 4000})
    assert renewed.status_code == 200
    assert bearer.delete(f"leases/{lease.json()['lease']}").status_code == 204
    stored = bearer.put_block(cluster.compat, cluster.scope_a, random_key(), container(9301))
    assert stored.status_code == 201, stored.text

    # Scope B at the same holder: as for a principal without it, a miss and a refusal.
    outsider = n1.api(cluster.tokens["reader_a"])
    other = bearer.get_block(cluster.compat, cluster.scope_b, key_b)
    assert other.status_code == 404 and problem(other) == "kvsp-not-found"
    assert other.json() == outsider.get_block(cluster.compat, cluster.scope_b, key_b).json()
    other_lease = bearer.post("leases", json=lease_body(cluster, cluster.scope_b, [key_b]))
    assert other_lease.status_code == 404
    refused = bearer.put_block(cluster.compat, cluster.scope_b, random_key(), data)
    assert refused.status_code == 403 and problem(refused) == "kvsp-forbidden"
    # A lease of scope B that n2's principal holds at n1 is not the token's to release.
    held = n1.api(cluster.tokens["n2"]).post(
        "leases", json=lease_body(cluster, cluster.scope_b, [key_b])
    )
    assert held.status_code == 201
    assert bearer.delete(f"leases/{held.json()['lease']}").status_code == 404
    assert n1.api(cluster.tokens["n2"]).delete(f"leases/{held.json()['lease']}").status_code == 204

    # Another holder, and everything of the node that is not blocks or leases: refused.
    assert n2.api(token).get_block(cluster.compat, cluster.scope_a, key_a).status_code == 401
    assert bearer.put("state", json={"state": "active"}).status_code == 401
    assert bearer.post("prefetch", json={}).status_code == 401
    assert_refused_by_the_control_plane(cluster, token)


def test_a_delegated_token_expires(cluster):
    n1 = cluster.node("n1")
    key, data = random_key(), container(9400)
    owner = n1.api(cluster.tokens["reader_a"])
    assert owner.put_block(cluster.compat, cluster.scope_a, key, data).status_code == 201
    grant = delegated(cluster, "reader_a", cluster.scope_a, n1.url, ttl_ms=1500)
    assert grant["ttl_ms"] == 1500
    bearer = n1.api(grant["token"])
    # Verified once, the token is remembered by the serving process (KVSP_AUTH_CACHE_S), but
    # never past its expiry.
    assert bearer.get_block(cluster.compat, cluster.scope_a, key).status_code == 200
    expires_at = datetime.fromisoformat(grant["expires_at"].replace("Z", "+00:00")).timestamp()
    time.sleep(max(expires_at - time.time(), 0) + 0.05)
    # The same kept-alive connection: the process that remembered the token refuses it now.
    late = bearer.get_block(cluster.compat, cluster.scope_a, key)
    assert late.status_code == 401 and problem(late) == "kvsp-unauthenticated"
    answer = cluster.control().post("tokens/introspect", json={"token": grant["token"]})
    assert answer.json() == {"active": False}


@pytest.fixture(scope="module")
def revocable(cluster, django_db_blocker):
    """A principal of scope A, committed outside the test's transaction for the servers."""
    from index.services import do_create_principal

    name = f"revocable-{random_key()[:8]}"
    with django_db_blocker.unblock():
        token = do_create_principal(name, scope_ids=[bytes.fromhex(cluster.scope_a)]).token
    return name, token


def test_revoking_the_principal_ends_its_delegated_tokens_at_holders(cluster, revocable, role_env):
    name, own_token = revocable
    n1 = cluster.node("n1")
    key = random_key()
    assert (
        n1.api(own_token).put_block(cluster.compat, cluster.scope_a, key, container(9500))
    ).status_code == 201
    answer = Api(cluster.cp_url, own_token).post(
        "tokens", json={"scope_id": cluster.scope_a, "audience": n1.url}
    )
    assert answer.status_code == 200, answer.text
    token = answer.json()["token"]
    bearer = n1.api(token)
    assert bearer.get_block(cluster.compat, cluster.scope_a, key).status_code == 200

    revoked = run_manage("kvsp_principal", "revoke", name, env=role_env())
    assert revoked.returncode == 0, revoked.stderr
    # Once the node's memory of the verified token (KVSP_AUTH_CACHE_S, 2 s) has lapsed.
    wait_until(
        lambda: bearer.get_block(cluster.compat, cluster.scope_a, key).status_code == 401,
        "the revoked principal's token refused",
        timeout=15,
    )


def test_the_vllm_client_presents_one_delegated_token_per_scope_and_holder(cluster):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    client = KvspClient(cluster.cp_url, cluster.tokens["reader_a"])
    try:
        token = client.token_for(n1.url, cluster.scope_a)
        assert token.startswith("kvspd_")
        assert client.token_for(n1.url, cluster.scope_a) == token
        assert client.token_for(n2.url, cluster.scope_a) != token
        answer = cluster.control().post("tokens/introspect", json={"token": token}).json()
        assert (answer["scope_id"], answer["audience"]) == (cluster.scope_a, n1.url)
        with pytest.raises(PeerError):
            client.token_for(n1.url, cluster.scope_b)  # not one of the principal's scopes

        key, data = random_key(), container(9600)
        parsed = decode(data)
        encoded = encode_with_digests(
            parsed.codec,
            0,
            parsed.token_count,
            [parsed.layer(index) for index in range(parsed.layer_count)],
        )
        assert client.store_block(n1.url, cluster.compat, cluster.scope_a, key, encoded)
        record = ReplicaRecord.from_json(_record_of(cluster, n1, key))
        layers = []
        client.fetch_block(
            record, max_size=1 << 20, deadline=time.monotonic() + 10, on_layer=layers.append
        )
        assert len(layers) == parsed.layer_count
    finally:
        client.close()


def _record_of(cluster, node, key: str) -> dict:
    def published():
        answer = cluster.control("reader_a").get(
            f"replicas/{cluster.compat}/{cluster.scope_a}/{key}"
        )
        if answer.status_code != 200:
            return None
        return next((r for r in answer.json()["replicas"] if r["holder"] == node.url), None)

    return wait_until(published, "the stored block's record at the IS", timeout=15)
