"""Delegated tokens (DESIGN.md section 6): ``POST tokens`` issues a token for one scope within
the caller's grants, one holder and a capped life; ``POST tokens/introspect`` says what it
carries to the holder it is meant for; a holder verifies it against its own URL and the
principal's standing; and the control plane takes none of them for anything."""

from datetime import UTC, datetime

import pytest
from django.test import override_settings
from django.utils import timezone

from index.authentication import now_ms, principal_for_delegated_token
from index.delegation import signed_token
from index.models import Principal
from kvsp.delegation import DelegatedClaims
from placement.services import do_register_instance
from tests.support.fixtures import (
    HOLDER_A,
    HOLDER_B,
    Caller,
    body,
    make_caller,
    make_scope,
    problem_name,
)

pytestmark = pytest.mark.django_db


def issue(caller: Caller, scope_id: str, audience: str = HOLDER_A, **extra):
    return caller.post("/kvsp/tokens", {"scope_id": scope_id, "audience": audience, **extra})


def token_of(caller: Caller, scope_id: str, audience: str = HOLDER_A, **extra) -> str:
    response = issue(caller, scope_id, audience, **extra)
    assert response.status_code == 200, response.content
    return body(response)["token"]


def introspect(caller: Caller, token: str):
    response = caller.post("/kvsp/tokens/introspect", {"token": token})
    assert response.status_code == 200, response.content
    return body(response)


def test_a_token_carries_one_scope_of_the_callers_for_one_holder(scope, other_scope):
    reader = make_caller("reader", scopes=[scope, other_scope])
    before = datetime.now(UTC)
    response = issue(reader, scope.scope_id_hex, ttl_ms=5000)
    assert response.status_code == 200, response.content
    assert response["Cache-Control"] == "no-store"
    grant = body(response)
    assert set(grant) == {"token", "expires_at", "ttl_ms"}
    assert grant["ttl_ms"] == 5000
    assert grant["token"].startswith("kvspd_")
    expires_at = datetime.fromisoformat(grant["expires_at"].replace("Z", "+00:00"))
    assert before.timestamp() + 5 <= expires_at.timestamp() + 0.001

    holder = principal_for_delegated_token(grant["token"], HOLDER_A)
    assert holder.scope_ids == {bytes(scope.scope_id)}
    assert holder.id == Principal.objects.get(name="reader").pk
    assert not holder.controller and not holder.holder_urls and not holder.instance
    assert principal_for_delegated_token(grant["token"], HOLDER_B) is None


def test_an_ungranted_scope_is_answered_as_one_that_does_not_exist(scope, other_scope):
    reader = make_caller("reader", scopes=[scope])
    ungranted = issue(reader, other_scope.scope_id_hex)
    absent = issue(reader, "ab" * 16)
    assert ungranted.status_code == absent.status_code == 404
    assert problem_name(ungranted) == "kvsp-not-found"
    assert body(ungranted) == body(absent)
    # The controller reads every scope, and only scopes that exist.
    controller = make_caller("pc", controller=True)
    assert issue(controller, other_scope.scope_id_hex).status_code == 200
    assert issue(controller, "ab" * 16).status_code == 404


@override_settings(KVSP_DELEGATED_TTL_MS=2000)
def test_the_life_is_capped_and_defaults_to_the_cap(scope):
    reader = make_caller("reader", scopes=[scope])
    assert body(issue(reader, scope.scope_id_hex, ttl_ms=10**9))["ttl_ms"] == 2000
    assert body(issue(reader, scope.scope_id_hex))["ttl_ms"] == 2000
    assert body(issue(reader, scope.scope_id_hex, ttl_ms=1500))["ttl_ms"] == 1500


@pytest.mark.parametrize(
    "change, member",
    [
        ({"ttl_ms": 0}, "ttl_ms"),
        ({"ttl_ms": -5}, "ttl_ms"),
        ({"ttl_ms": 1.5}, "ttl_ms"),
        ({"ttl_ms": "1000"}, "ttl_ms"),
        ({"ttl_ms": True}, "ttl_ms"),
        ({"audience": "ftp://holder-a.test/kvsp/"}, "audience"),
        ({"audience": "holder-a.test/kvsp/"}, "audience"),
        ({"audience": "http://holder-a.test/kvsp"}, "audience"),
        ({"audience": "http://user@holder-a.test/kvsp/"}, "audience"),
        ({"audience": "http://holder-a.test/kvsp/?scope=all"}, "audience"),
        ({"audience": 7}, "audience"),
        ({"scope_id": "AB" * 16}, "scope_id"),
    ],
)
def test_bad_requests_are_problems_naming_the_member(scope, change, member):
    reader = make_caller("reader", scopes=[scope])
    request = {"scope_id": scope.scope_id_hex, "audience": HOLDER_A, **change}
    response = reader.post("/kvsp/tokens", request)
    assert response.status_code == 422, response.content
    assert problem_name(response) == "kvsp-invalid-record"
    assert body(response)["detail"].startswith(member)
    for missing in ("scope_id", "audience"):
        partial = {k: v for k, v in request.items() if k != missing}
        assert reader.post("/kvsp/tokens", partial).status_code == 422
    assert reader.post("/kvsp/tokens", ["not", "an", "object"]).status_code == 422


def test_the_audience_is_compared_in_its_normal_form(scope):
    reader = make_caller("reader", scopes=[scope])
    token = token_of(reader, scope.scope_id_hex, "http://Holder-A.TEST:80/kvsp/")
    assert principal_for_delegated_token(token, "http://holder-a.test/kvsp/") is not None
    assert principal_for_delegated_token(token, "http://holder-a.test:8080/kvsp/") is None
    assert principal_for_delegated_token(token, "http://holder-a.test/other/") is None
    assert principal_for_delegated_token(token, "") is None


def test_introspection_tells_the_holder_it_is_meant_for_and_no_one_else(scope):
    reader = make_caller("reader", scopes=[scope])
    holder_a = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A])
    holder_b = make_caller("holder-b", scopes=[scope], holders=[HOLDER_B])
    do_register_instance("n1", HOLDER_B)
    node = make_caller("node-n1", scopes=[scope], instance="n1")
    controller = make_caller("pc", controller=True)
    grant = body(issue(reader, scope.scope_id_hex, ttl_ms=30_000))
    answer = introspect(holder_a, grant["token"])
    assert answer == {
        "active": True,
        "scope_id": scope.scope_id_hex,
        "audience": HOLDER_A,
        "exp": answer["exp"],
    }
    expires_at = datetime.fromisoformat(grant["expires_at"].replace("Z", "+00:00"))
    assert answer["exp"] == int(expires_at.timestamp())
    assert introspect(controller, grant["token"])["active"] is True
    # Another holder (by its URLs or by its instance's) learns nothing of it.
    assert introspect(holder_b, grant["token"]) == {"active": False}
    assert introspect(node, grant["token"]) == {"active": False}
    token_b = token_of(reader, scope.scope_id_hex, HOLDER_B)
    assert introspect(node, token_b)["active"] is True

    # A principal that is no holder may not ask at all.
    refused = reader.post("/kvsp/tokens/introspect", {"token": grant["token"]})
    assert refused.status_code == 403 and problem_name(refused) == "kvsp-forbidden"


def test_introspection_of_anything_not_valid_is_inactive(scope):
    reader = make_caller("reader", scopes=[scope])
    controller = make_caller("pc", controller=True)
    token = token_of(reader, scope.scope_id_hex)
    flipped = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
    principal = Principal.objects.get(name="reader").pk
    expired = signed_token(
        DelegatedClaims(principal, bytes(scope.scope_id), HOLDER_A, now_ms() - 1)
    )
    for candidate in (flipped, expired, reader.token, "kvspd_", "kvspd_!!", "x" * 300):
        assert introspect(controller, candidate) == {"active": False}, candidate
    assert principal_for_delegated_token(expired, HOLDER_A) is None
    malformed = controller.post("/kvsp/tokens/introspect", {"token": 5})
    assert malformed.status_code == 422 and problem_name(malformed) == "kvsp-invalid-record"


def test_revoking_the_principal_or_its_grant_ends_its_tokens(scope):
    reader = make_caller("reader", scopes=[scope])
    other = make_caller("other", scopes=[scope])
    controller = make_caller("pc", controller=True)
    token = token_of(reader, scope.scope_id_hex)
    others = token_of(other, scope.scope_id_hex)
    assert introspect(controller, token)["active"] is True

    Principal.objects.filter(name="reader").update(revoked_at=timezone.now())
    assert introspect(controller, token) == {"active": False}
    assert principal_for_delegated_token(token, HOLDER_A) is None

    Principal.objects.get(name="other").scopes.clear()
    assert introspect(controller, others) == {"active": False}
    assert principal_for_delegated_token(others, HOLDER_A) is None


def test_the_control_plane_takes_no_delegated_token(scope):
    reader = make_caller("reader", scopes=[scope])
    token = token_of(reader, scope.scope_id_hex)
    bearer = Caller("bearer", token, reader.client)
    for response in (
        bearer.get(f"/kvsp/scopes/{scope.scope_id_hex}/key"),
        bearer.post(
            "/kvsp/lookup",
            {"scope_id": scope.scope_id_hex, "compat_id": "cd" * 32, "block_keys": []},
        ),
        issue(bearer, scope.scope_id_hex),
        bearer.post("/kvsp/tokens/introspect", {"token": token}),
        bearer.get("/kvsp/instances/"),
    ):
        assert response.status_code == 401, response.content
        assert problem_name(response) == "kvsp-unauthenticated"


def test_a_token_signed_under_another_master_key_is_worth_nothing(scope):
    reader = make_caller("reader", scopes=[scope])
    with override_settings(KVSP_MASTER_KEY=b"\x07" * 32):
        foreign = token_of(reader, scope.scope_id_hex)
    assert principal_for_delegated_token(foreign, HOLDER_A) is None
    assert introspect(make_caller("pc", controller=True), foreign) == {"active": False}


def test_the_scope_must_still_exist_for_the_controllers_tokens():
    scope = make_scope("short-lived")
    controller = make_caller("pc", controller=True)
    token = token_of(controller, scope.scope_id_hex)
    assert principal_for_delegated_token(token, HOLDER_A) is not None
    scope.delete()
    assert principal_for_delegated_token(token, HOLDER_A) is None
