"""The Django admin of the Index Service: scopes, principals (token shown once), replicas."""

import pytest

from index.models import Principal, Replica, Scope
from index.scopekeys import open_scope_key
from kvsp.blockkeys import scope_id
from tests.support.fixtures import (
    HOLDER_A,
    HOLDER_B,
    make_caller,
    make_scope,
    random_key,
    replica_json,
)

pytestmark = pytest.mark.django_db

COMPAT = "c3" * 32


def publish(caller, scope, holder=HOLDER_A, residency=None):
    key = random_key()
    record = replica_json(scope.scope_id_hex, COMPAT, key, holder, residency=residency)
    caller.put(f"/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{key}", record)
    return key


def test_creating_a_scope_in_the_admin_gives_it_a_key(admin_client):
    response = admin_client.post("/admin/index/scope/add/", {"name": "from-admin"})
    assert response.status_code == 302
    scope = Scope.objects.get(name="from-admin")
    key = open_scope_key(scope.scope_id, scope.key_ciphertext)
    assert scope_id(key) == bytes(scope.scope_id)


def test_creating_a_principal_shows_its_token_once(admin_client):
    scope = make_scope("tenant-a")
    response = admin_client.post(
        "/admin/index/principal/add/",
        {"name": "engine-7", "scopes": [scope.pk], "holder_urls": "[]", "instance": ""},
        follow=True,
    )
    assert response.status_code == 200
    messages = [str(m) for m in response.context["messages"]]
    (shown,) = [m for m in messages if "Token for engine-7" in m]
    token = shown.rsplit(" ", 1)[-1]
    from index.authentication import principal_for_token

    principal = principal_for_token(token)
    assert principal.name == "engine-7"
    assert principal.scope_ids == {bytes(scope.scope_id)}
    page = admin_client.get(f"/admin/index/principal/{principal.id}/change/")
    assert token.encode() not in page.content


def test_replicas_filter_by_tier_and_holder_and_withdraw(admin_client):
    scope = make_scope("tenant-a")
    a = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    b = make_caller("holder-b", scopes=[scope], holders=[HOLDER_B])
    on_device = publish(a, scope, residency=[{"tier": "device", "layers": [0, 3]}])
    on_disk = publish(b, scope, HOLDER_B, residency=[{"tier": "disk", "layers": [0, 3]}])
    device_page = admin_client.get("/admin/index/replica/", {"tier": "1"})
    assert on_device[:16].encode() in device_page.content
    assert on_disk[:16].encode() not in device_page.content
    scope_page = admin_client.get("/admin/index/replica/", {"scope": scope.scope_id_hex})
    assert (
        on_device[:16].encode() in scope_page.content
        and on_disk[:16].encode() in scope_page.content
    )

    target = Replica.objects.get(holder__url=HOLDER_B)
    response = admin_client.post(
        "/admin/index/replica/",
        {"action": "withdraw", "_selected_action": [target.pk]},
    )
    assert response.status_code == 302
    assert [r.holder.url for r in Replica.objects.all()] == [HOLDER_A]


def test_revoke_action(admin_client):
    make_caller("engine")
    principal = Principal.objects.get()
    admin_client.post(
        "/admin/index/principal/", {"action": "revoke", "_selected_action": [principal.pk]}
    )
    principal.refresh_from_db()
    assert principal.revoked_at is not None
