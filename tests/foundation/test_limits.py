"""Every API route refuses a request without valid credentials, and floods are answered 429."""

import importlib

import pytest
from django.test import Client, override_settings
from django.urls import URLPattern, URLResolver

from tests.support.fixtures import Caller, anonymous, body, make_caller, problem_name

pytestmark = pytest.mark.django_db

SAMPLE_ARGUMENTS = {
    "hex16": "ab" * 16,
    "hex32": "cd" * 32,
    "int": "5",
    "str": "x1",
    "path": "x1",
    "uuid": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
}


def api_routes(urlconf: str):
    """(path, view class) of every route under /kvsp/ except the schema."""

    def walk(patterns, prefix):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                route = prefix + str(pattern.pattern)
                converters = pattern.pattern.converters
                for name in list(converters):
                    kind = {
                        "Hex16Converter": "hex16",
                        "Hex32Converter": "hex32",
                        "IntConverter": "int",
                        "UUIDConverter": "uuid",
                    }.get(type(converters[name]).__name__, "str")
                    route = route.replace(f"<{kind}:{name}>", SAMPLE_ARGUMENTS[kind])
                    route = route.replace(f"<{name}>", SAMPLE_ARGUMENTS["str"])
                yield "/" + route, getattr(pattern.callback, "cls", None)

    module = importlib.import_module(urlconf)
    for path, view in walk(module.urlpatterns, ""):
        if path.startswith("/kvsp/") and path != "/kvsp/schema" and view is not None:
            yield path, view


@pytest.mark.parametrize("urlconf", ["kvspsite.urls_control", "kvspsite.urls_node"])
def test_every_route_refuses_anonymous_and_bad_tokens(urlconf):
    routes = list(api_routes(urlconf))
    if urlconf == "kvspsite.urls_control":
        assert len(routes) >= 15  # the walk found the API, so the loop below means something
    client = Client(raise_request_exception=False)
    # Two forged tokens for every route are more refusals than one address may send before
    # it is answered 429 (test_guessed_tokens_are_answered_429_before_they_are_looked_up).
    with override_settings(ROOT_URLCONF=urlconf, KVSP_AUTH_FAILURES_PER_S=0):
        for path, view in routes:
            for method in ("get", "put", "post", "delete"):
                if not hasattr(view, method):
                    continue
                for header in (
                    {},
                    {"HTTP_AUTHORIZATION": "Bearer kvsp_forged"},
                    {"HTTP_AUTHORIZATION": "Bearer kvspd_forged"},
                ):
                    response = getattr(client, method)(path, **header)
                    assert response.status_code == 401, (method, path, response.content)
                    assert problem_name(response) == "kvsp-unauthenticated"


@override_settings(KVSP_RATE_LIMIT_PER_S=5, KVSP_RATE_LIMIT_BURST=5)
def test_a_flood_is_answered_429_with_retry_after():
    flooder = make_caller("flooder")
    calm = make_caller("calm")
    codes = [flooder.get("/kvsp/instances/").status_code for _ in range(8)]
    assert codes[:5] == [200] * 5
    assert 429 in codes[5:]
    limited = flooder.get("/kvsp/instances/")
    assert limited.status_code == 429
    assert problem_name(limited) == "kvsp-too-many-requests"
    assert int(limited["Retry-After"]) >= 1
    # The bucket is per principal: another one is not slowed down by the flood.
    assert calm.get("/kvsp/instances/").status_code == 200
    assert body(calm.get("/kvsp/instances/")) == {"instances": []}


@override_settings(KVSP_AUTH_FAILURES_PER_S=0.001, KVSP_AUTH_FAILURES_BURST=5)
def test_guessed_tokens_are_answered_429_before_they_are_looked_up(django_assert_num_queries):
    known = make_caller("known")
    assert known.get("/kvsp/instances/").status_code == 200  # this process verifies its token
    newcomer = make_caller("newcomer")
    guesser = Caller("guesser", "kvsp_guessed", Client(raise_request_exception=False))
    assert [guesser.get("/kvsp/instances/").status_code for _ in range(5)] == [401] * 5
    with django_assert_num_queries(0):
        refused = guesser.get("/kvsp/instances/")
    assert refused.status_code == 429
    assert problem_name(refused) == "kvsp-too-many-requests"
    assert int(refused["Retry-After"]) >= 1
    # A client's own X-Forwarded-For does not make it another address; a malformed field is
    # refused alike.
    assert guesser.get("/kvsp/instances/", HTTP_X_FORWARDED_FOR="198.51.100.7").status_code == 429
    assert guesser.get("/kvsp/instances/", HTTP_AUTHORIZATION="Bearer a b").status_code == 429
    # Requests without credentials cost no lookup and stay 401.
    assert anonymous().get("/kvsp/instances/").status_code == 401
    # The principal whose token this process verified is not slowed by guesses from its address.
    assert [known.get("/kvsp/instances/").status_code for _ in range(10)] == [200] * 10
    # A token not verified yet cannot be told from a guess without the lookup: it waits too.
    assert newcomer.get("/kvsp/instances/").status_code == 429
    # Another address has its own budget.
    assert guesser.get("/kvsp/instances/", REMOTE_ADDR="192.0.2.9").status_code == 401
    assert newcomer.get("/kvsp/instances/", REMOTE_ADDR="192.0.2.9").status_code == 200


@override_settings(KVSP_AUTH_FAILURES_PER_S=0.001, KVSP_AUTH_FAILURES_BURST=2)
def test_a_revoked_token_counts_as_a_guess_once_refused(django_assert_num_queries):
    from django.utils import timezone

    from index.models import Principal

    revoked = make_caller("revoked")
    assert revoked.get("/kvsp/instances/").status_code == 200
    Principal.objects.filter(name="revoked").update(revoked_at=timezone.now())
    assert [revoked.get("/kvsp/instances/").status_code for _ in range(2)] == [401, 401]
    with django_assert_num_queries(0):
        assert revoked.get("/kvsp/instances/").status_code == 429


@override_settings(
    KVSP_AUTH_FAILURES_PER_S=0.001, KVSP_AUTH_FAILURES_BURST=2, KVSP_TRUSTED_PROXIES=1
)
def test_behind_a_trusted_proxy_the_client_is_the_address_it_forwards():
    guesser = Caller("guesser", "kvsp_guessed", Client(raise_request_exception=False))
    # The proxy appends the address it saw; what the client wrote before it is not trusted.
    via_proxy = {"HTTP_X_FORWARDED_FOR": "10.9.9.9, 203.0.113.5"}
    assert [guesser.get("/kvsp/instances/", **via_proxy).status_code for _ in range(2)] == [401] * 2
    assert guesser.get("/kvsp/instances/", **via_proxy).status_code == 429
    # Another client that writes the guesser's address itself is told apart by what the proxy
    # appended.
    another = {"HTTP_X_FORWARDED_FOR": "203.0.113.5, 198.51.100.7"}
    assert guesser.get("/kvsp/instances/", **another).status_code == 401
