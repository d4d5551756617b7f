"""Leases on a real node (spec 6.6): create, renew, release, the per-client quota on leased
octets and on TTL, and who may touch a lease."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.node.conftest import BLOCK_OCTETS
from tests.node.support import assert_problems, container, lease_body, problem, random_key
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db


def stored_keys(cluster, node, count: int, seed: int) -> list[str]:
    api = node.api(cluster.tokens["reader_a"])
    keys = [random_key() for _ in range(count)]
    for offset, key in enumerate(keys):
        data = container(seed + offset)
        assert api.put_block(cluster.compat, cluster.scope_a, key, data).status_code == 201
    return keys


def test_create_renew_release(cluster):
    n1 = cluster.node("n1")
    keys = stored_keys(cluster, n1, 2, 100)
    api = n1.api(cluster.tokens["reader_a"])
    before_ms = int(time.time() * 1000)
    created = api.post("leases", json=lease_body(cluster, keys, 4000))
    assert created.status_code == 201, created.text
    grant = created.json()
    assert grant["block_keys"] == keys and grant["ttl_ms"] == 4000
    assert before_ms + 3000 < grant["expires_ms"] < before_ms + 6000
    assert created.headers["location"] == f"{n1.url}leases/{grant['lease']}"

    renewed = api.put(f"leases/{grant['lease']}", json={"ttl_ms": 20000})
    assert renewed.status_code == 200
    assert renewed.json()["ttl_ms"] == 20000
    assert renewed.json()["expires_ms"] > grant["expires_ms"] + 10000

    from workers.models import Lease

    row = Lease.objects.get(lease=grant["lease"])
    assert row.octets == 2 * BLOCK_OCTETS and row.blocks.count() == 2

    assert api.delete(f"leases/{grant['lease']}").status_code == 204
    again = api.delete(f"leases/{grant['lease']}")
    assert again.status_code == 404 and problem(again) == "kvsp-not-found"
    assert not Lease.objects.filter(lease=grant["lease"]).exists()


def test_only_the_lessee_renews_or_releases(cluster):
    n1 = cluster.node("n1")
    keys = stored_keys(cluster, n1, 1, 110)
    grant = n1.api(cluster.tokens["reader_a"]).post("leases", json=lease_body(cluster, keys)).json()
    other = n1.api(cluster.tokens["reader_a2"])
    for response in (
        other.put(f"leases/{grant['lease']}", json={"ttl_ms": 1000}),
        other.delete(f"leases/{grant['lease']}"),
    ):
        assert response.status_code == 404 and problem(response) == "kvsp-not-found"
    unknown = other.put("leases/no-such-lease", json={"ttl_ms": 1000})
    assert unknown.status_code == 404


def test_a_lease_on_a_missing_block_or_another_scope_is_a_miss(cluster):
    n1 = cluster.node("n1")
    keys = stored_keys(cluster, n1, 1, 120)
    missing = n1.api(cluster.tokens["reader_a"]).post(
        "leases", json=lease_body(cluster, keys + [random_key()])
    )
    assert missing.status_code == 404 and problem(missing) == "kvsp-not-found"
    stranger = n1.api(cluster.tokens["reader_b"]).post("leases", json=lease_body(cluster, keys))
    assert stranger.status_code == 404 and problem(stranger) == "kvsp-not-found"
    from workers.models import Lease

    assert not Lease.objects.filter(instance=n1.name, blocks__block_key=bytes.fromhex(keys[0]))


def test_quota_on_ttl_and_on_leased_octets_per_client(cluster):
    """n3's quota is a little over two blocks per principal."""
    n3 = cluster.node("n3")
    keys = stored_keys(cluster, n3, 2, 130)
    api = n3.api(cluster.tokens["reader_a"])
    too_long = api.post("leases", json=lease_body(cluster, keys[:1], ttl_ms=60_001))
    assert too_long.status_code == 429 and problem(too_long) == "kvsp-lease-quota"

    first = api.post("leases", json=lease_body(cluster, keys[:1]))
    assert first.status_code == 201
    both = api.post("leases", json=lease_body(cluster, keys))
    assert both.status_code == 429 and problem(both) == "kvsp-lease-quota"
    second = api.post("leases", json=lease_body(cluster, keys[1:]))
    assert second.status_code == 201
    third = api.post("leases", json=lease_body(cluster, keys[:1]))
    assert third.status_code == 429
    renew_too_long = api.put(f"leases/{first.json()['lease']}", json={"ttl_ms": 60_001})
    assert renew_too_long.status_code == 429 and problem(renew_too_long) == "kvsp-lease-quota"

    # The quota is per principal: another client of the scope has its own.
    other = n3.api(cluster.tokens["reader_a2"]).post("leases", json=lease_body(cluster, keys))
    assert other.status_code == 201
    # Released octets count no more.
    assert api.delete(f"leases/{first.json()['lease']}").status_code == 204
    assert api.post("leases", json=lease_body(cluster, keys[:1])).status_code == 201
    for token in ("reader_a", "reader_a2"):
        release_all(cluster, n3, token)


def test_concurrent_lease_requests_never_exceed_the_quota(cluster):
    """Nine requests of one block each, released together through both HTTP processes of
    n3, whose quota holds two blocks per principal: exactly two are granted."""
    n3 = cluster.node("n3")
    keys = stored_keys(cluster, n3, 2, 150)
    api = n3.api(cluster.tokens["reader_a"])
    requests = [keys[index % 2] for index in range(9)]
    start = threading.Barrier(len(requests))

    def request(key: str):
        start.wait()
        return api.post("leases", json=lease_body(cluster, [key]))

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(request, requests))
    granted = [answer for answer in answers if answer.status_code == 201]
    refused = [answer for answer in answers if answer.status_code != 201]
    assert len(granted) == 2, [answer.text for answer in answers]
    assert all(
        answer.status_code == 429 and problem(answer) == "kvsp-lease-quota" for answer in refused
    )
    from index.authentication import principal_for_token
    from workers.models import Lease

    principal = principal_for_token(cluster.tokens["reader_a"])
    leased = Lease.objects.filter(instance=n3.name, principal_id=principal.id)
    assert sum(lease.octets for lease in leased) == 2 * BLOCK_OCTETS
    release_all(cluster, n3, "reader_a")


def test_an_expired_lease_cannot_be_renewed_or_released(cluster):
    n1 = cluster.node("n1")
    keys = stored_keys(cluster, n1, 1, 160)
    api = n1.api(cluster.tokens["reader_a"])
    grant = api.post("leases", json=lease_body(cluster, keys, ttl_ms=300)).json()
    live = api.post("leases", json=lease_body(cluster, keys, ttl_ms=300)).json()
    assert api.put(f"leases/{live['lease']}", json={"ttl_ms": 5000}).status_code == 200
    wait_until(lambda: time.time() * 1000 > grant["expires_ms"] + 50, "the lease's expiry")
    for response in (
        api.put(f"leases/{grant['lease']}", json={"ttl_ms": 5000}),
        api.delete(f"leases/{grant['lease']}"),
    ):
        assert response.status_code == 404 and problem(response) == "kvsp-not-found"
    # The renewed one was not touched by the other's expiry.
    assert api.delete(f"leases/{live['lease']}").status_code == 204


def release_all(cluster, node, token_name: str) -> None:
    from index.authentication import principal_for_token
    from workers.models import Lease

    principal = principal_for_token(cluster.tokens[token_name])
    api = node.api(cluster.tokens[token_name])
    for lease in Lease.objects.filter(instance=node.name, principal_id=principal.id):
        api.delete(f"leases/{lease.lease}")


def test_bad_lease_requests_are_problems(cluster):
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    cases = [
        (
            api.post("leases", content=b"{nope", headers={"Content-Type": "application/json"}),
            400,
            "kvsp-malformed-request",
        ),
        (api.post("leases", json=[1, 2]), 422, "kvsp-invalid-record"),
        (api.post("leases", json={"compat_id": cluster.compat}), 422, "kvsp-invalid-record"),
        (
            api.post("leases", json={**lease_body(cluster, [random_key()]), "ttl_ms": 0}),
            422,
            "kvsp-invalid-record",
        ),
        (api.post("leases", json={**lease_body(cluster, ["XYZ"])}), 422, "kvsp-invalid-record"),
        (api.put("leases/x", json={"ttl_ms": "soon"}), 422, "kvsp-invalid-record"),
        (api.get("leases"), 405, "kvsp-method-not-allowed"),
    ]
    assert_problems(cases)
