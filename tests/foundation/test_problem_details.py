"""Every error on the API is RFC 9457 problem details, never HTML or a traceback."""

import orjson
import pytest
from django.test import Client, override_settings

from index.authentication import new_token
from index.models import Principal

pytestmark = [pytest.mark.urls("tests.foundation.urls"), pytest.mark.django_db]

PROBLEM = "application/problem+json"


def assert_problem(response, status: int, name: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == PROBLEM
    body = orjson.loads(response.content)
    assert body["type"].endswith("/" + name)
    assert body["status"] == status
    assert body["title"] and body["detail"]
    assert b"Traceback" not in response.content and b"<html" not in response.content.lower()
    return body


@pytest.fixture
def client():
    return Client(raise_request_exception=False)


def test_unmatched_api_url_is_a_problem(client):
    assert_problem(client.get("/kvsp/no/such/thing"), 404, "kvsp-not-found")


@override_settings(DEBUG=True)
def test_unmatched_api_url_is_a_problem_even_under_debug(client):
    assert_problem(client.get("/kvsp/no/such/thing"), 404, "kvsp-not-found")


def test_wrong_method_is_a_problem(client):
    assert_problem(client.delete("/kvsp/test/echo"), 405, "kvsp-method-not-allowed")


def test_malformed_json_is_a_problem(client):
    response = client.post("/kvsp/test/echo", b"{not json", content_type="application/json")
    body = assert_problem(response, 400, "kvsp-malformed-request")
    assert "JSON" in body["detail"]


def test_kvsp_json_is_accepted_and_returned(client):
    response = client.post(
        "/kvsp/test/echo",
        b'{"a": [1, 2]}',
        content_type="application/kvsp+json",
        HTTP_ACCEPT="application/kvsp+json",
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "application/kvsp+json"
    assert orjson.loads(response.content) == {"echo": {"a": [1, 2]}}


def test_plain_json_is_accepted_and_returned(client):
    response = client.post(
        "/kvsp/test/echo", b"[1]", content_type="application/json", HTTP_ACCEPT="application/json"
    )
    assert response["Content-Type"] == "application/json"
    assert orjson.loads(response.content) == {"echo": [1]}


def test_unsupported_media_type_is_a_problem(client):
    response = client.post("/kvsp/test/echo", b"a=1", content_type="text/plain")
    assert_problem(response, 415, "kvsp-unsupported-media-type")


def test_unacceptable_accept_is_a_problem(client):
    response = client.post(
        "/kvsp/test/echo", b"[1]", content_type="application/json", HTTP_ACCEPT="image/png"
    )
    assert_problem(response, 406, "kvsp-not-acceptable")


def test_protocol_error_keeps_its_problem_type(client):
    body = assert_problem(client.get("/kvsp/test/stale"), 409, "kvsp-stale-epoch")
    assert body["detail"] == "epoch 3 is lower than 5"


@pytest.mark.parametrize("path", ["/kvsp/test/twice", "/kvsp/test/plain-twice"])
def test_a_tripped_uniqueness_constraint_is_a_conflict_and_changes_nothing(client, path):
    """Inside DRF or outside it (ProblemDetailsMiddleware), one mapping answers alike."""
    from index.models import Scope

    body = assert_problem(client.post(path), 409, "kvsp-conflict")
    assert "changed nothing" in body["detail"] and "twice" not in body["detail"]
    assert not Scope.objects.filter(name="twice").exists()


@pytest.mark.parametrize("path", ["/kvsp/test/crash", "/kvsp/test/plain-crash"])
@pytest.mark.parametrize("debug", [False, True])
def test_uncaught_exception_never_leaks(client, path, debug, caplog):
    with override_settings(DEBUG=debug):
        response = client.get(path)
    assert_problem(response, 500, "kvsp-internal-error")
    assert b"deadbeef" not in response.content
    assert "deadbeef" in caplog.text  # the operator still sees it in the log


def test_missing_token_is_401_with_challenge(client):
    response = client.get("/kvsp/test/private")
    assert_problem(response, 401, "kvsp-unauthenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer kvsp_not-a-real-token", "Bearer", "Bearer a b", "Basic dXNlcjpwYXNz", "Bearer \xff"],
)
def test_bad_credentials_are_401(client, header):
    response = client.get("/kvsp/test/private", HTTP_AUTHORIZATION=header)
    assert_problem(response, 401, "kvsp-unauthenticated")


def test_valid_token_authenticates_and_revoked_does_not(client):
    from django.utils import timezone

    token, digest = new_token()
    principal = Principal.objects.create(name="engine-1", token_hash=digest)
    response = client.get("/kvsp/test/private", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200
    assert orjson.loads(response.content) == {"principal": "engine-1"}

    principal.revoked_at = timezone.now()
    principal.save()
    response = client.get("/kvsp/test/private", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert_problem(response, 401, "kvsp-unauthenticated")


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_oversized_body_is_413(client):
    response = client.post(
        "/kvsp/test/echo", b"[" + b"1," * 2000 + b"1]", content_type="application/json"
    )
    assert_problem(response, 413, "kvsp-payload-too-large")


def test_dashboard_paths_keep_html(client):
    response = client.get("/admin/no/such/page/")
    assert "problem" not in response["Content-Type"]
