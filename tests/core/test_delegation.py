"""The core of delegated tokens (kvsp.delegation): claims signed and read back, anything else
refused; audiences in their normal form; the client's cache asks once per token lifetime."""

import threading

import pytest

from kvsp import delegation
from kvsp.delegation import DelegatedClaims, DelegatedTokenCache, normal_audience
from kvsp.problems import ProtocolError
from kvsp.records import TokenGrant, TokenIntrospection, TokenRequest

KEY = delegation.signing_key(b"\x01" * 32)
CLAIMS = DelegatedClaims(42, bytes(range(16)), "http://holder-a.test:8000/kvsp/", 1_700_000_000_000)
NONCE = b"\x00" * delegation.NONCE_OCTETS


def test_claims_round_trip_and_each_token_is_distinct():
    token = delegation.sign(KEY, CLAIMS, NONCE)
    assert token.startswith("kvspd_") and delegation.is_delegated(token)
    assert delegation.read(KEY, token) == CLAIMS
    other = delegation.sign(KEY, CLAIMS, b"\x01" * delegation.NONCE_OCTETS)
    assert other != token and delegation.read(KEY, other) == CLAIMS


def test_the_signing_key_is_not_the_master_key_and_depends_on_it():
    master = b"\x01" * 32
    assert KEY != master
    assert delegation.signing_key(b"\x02" * 32) != KEY


def test_anything_but_a_token_signed_with_the_key_is_refused():
    token = delegation.sign(KEY, CLAIMS, NONCE)
    body = token[len("kvspd_") :]
    for index in (0, 5, len(body) // 2, len(body) - 1):
        changed = body[:index] + ("A" if body[index] != "A" else "B") + body[index + 1 :]
        assert delegation.read(KEY, "kvspd_" + changed) is None, index
    assert delegation.read(delegation.signing_key(b"\x02" * 32), token) is None
    assert delegation.read(KEY, token + "A") is None
    assert delegation.read(KEY, token[:-1]) is None
    assert delegation.read(KEY, token[:20] + "!" + token[20:]) is None  # skipped by b64decode
    assert delegation.read(KEY, "kvsp_" + body) is None
    assert delegation.read(KEY, "kvspd_") is None
    assert delegation.read(KEY, "kvspd_" + "A" * 5000) is None


def test_expiry_is_the_readers_to_check():
    assert not CLAIMS.expired(CLAIMS.expires_ms - 1)
    assert CLAIMS.expired(CLAIMS.expires_ms)


@pytest.mark.parametrize(
    "url, normal",
    [
        ("http://holder-a.test/kvsp/", "http://holder-a.test/kvsp/"),
        ("HTTP://Holder-A.Test:80/kvsp/", "http://holder-a.test/kvsp/"),
        ("https://h.test:443/", "https://h.test/"),
        ("https://h.test:80/", "https://h.test:80/"),
        ("http://[::1]:8000/kvsp/", "http://[::1]:8000/kvsp/"),
        ("http://h.test", "http://h.test/"),
        ("http://h.test/KVSP/", "http://h.test/KVSP/"),
    ],
)
def test_audiences_compare_in_their_normal_form(url, normal):
    assert normal_audience(url) == normal


def test_the_records_of_the_endpoints():
    request = TokenRequest.from_json({"scope_id": "ab" * 16, "audience": "http://h.test/kvsp/"})
    assert request.ttl_ms is None and TokenRequest.from_json(request.to_json()) == request
    with pytest.raises(ProtocolError, match="^ttl_ms"):
        TokenRequest.from_json({"scope_id": "ab" * 16, "audience": "http://h/k/", "ttl_ms": 0})
    with pytest.raises(ProtocolError, match="^audience"):
        TokenRequest.from_json({"scope_id": "ab" * 16, "audience": "moqt://h.test/k"})
    grant = TokenGrant(token="kvspd_x", expires_at="2030-01-01T00:00:00.000Z", ttl_ms=5)
    assert TokenGrant.from_json(grant.to_json()) == grant
    with pytest.raises(ProtocolError, match="^token"):
        TokenGrant.from_json({**grant.to_json(), "token": "two words"})
    assert TokenIntrospection.from_json({"active": False}).to_json() == {"active": False}
    active = {"active": True, "scope_id": "ab" * 16, "audience": "http://h/k/", "exp": 7}
    assert TokenIntrospection.from_json(active).to_json() == active
    with pytest.raises(ProtocolError, match="^exp"):
        TokenIntrospection.from_json({**active, "exp": None})


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_asks_once_per_scope_and_audience_until_shortly_before_expiry():
    clock, asked = Clock(), []

    def issue(scope_id, audience):
        asked.append((scope_id, audience))
        return TokenGrant(token=f"kvspd_{len(asked)}", expires_at="-", ttl_ms=60_000)

    cache = DelegatedTokenCache(issue, clock)
    first = cache.token("s1", "http://a/k/")
    assert [cache.token("s1", "http://a/k/") for _ in range(5)] == [first] * 5
    assert cache.token("s2", "http://a/k/") != first
    assert cache.token("s1", "http://b/k/") != first
    assert len(asked) == 3
    # Ten seconds before the end of its minute (a quarter of it, at most ten seconds) a token
    # is asked for again; until then it is used as it is.
    clock.now += 49.9
    assert cache.token("s1", "http://a/k/") == first
    clock.now += 0.2
    renewed = cache.token("s1", "http://a/k/")
    assert renewed != first and len(asked) == 4
    cache.forget("s1", "http://a/k/")
    assert cache.token("s1", "http://a/k/") != renewed and len(asked) == 5


def test_a_short_token_is_renewed_at_three_quarters_of_its_life():
    clock, asked = Clock(), []

    def issue(scope_id, audience):
        asked.append(1)
        return TokenGrant(token=f"kvspd_{len(asked)}", expires_at="-", ttl_ms=2000)

    cache = DelegatedTokenCache(issue, clock)
    cache.token("s", "http://a/k/")
    clock.now += 1.49
    cache.token("s", "http://a/k/")
    clock.now += 0.02
    cache.token("s", "http://a/k/")
    assert len(asked) == 2


def test_threads_that_need_the_same_token_share_one_request_and_errors_are_not_kept():
    clock = Clock()
    asked, release = [], threading.Event()

    def issue(scope_id, audience):
        asked.append(1)
        release.wait(5)
        if len(asked) == 1:
            raise ConnectionError("the control plane is down")
        return TokenGrant(token="kvspd_ok", expires_at="-", ttl_ms=60_000)

    cache = DelegatedTokenCache(issue, clock)
    with pytest.raises(ConnectionError):
        release.set()
        cache.token("s", "http://a/k/")
    release.clear()
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.token("s", "http://a/k/")))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    release.set()
    for thread in threads:
        thread.join()
    assert results == ["kvspd_ok"] * 8
    assert len(asked) == 2
