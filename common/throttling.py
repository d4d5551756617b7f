"""Flood protection: token buckets per principal, and per client address for failed
authentications.

The buckets live in the serving process, so the limits apply per process: an operator sizes
``KVSP_RATE_LIMIT_PER_S`` and ``KVSP_AUTH_FAILURES_PER_S`` for one gunicorn worker. A bucket in
memory costs nothing on the hot paths, where a shared store would add a round trip to every
request.

A request's principal is known only once its token is looked up, so a flood of guessed tokens
would each cost a database query and be answered 401 before any per-principal bucket is asked.
``FAILED_AUTHENTICATIONS`` counts the bearer tokens refused per client address instead: once an
address has spent ``KVSP_AUTH_FAILURES_BURST`` failures (refilled at ``KVSP_AUTH_FAILURES_PER_S``),
a token from it is answered 429 with ``Retry-After`` before it is looked up (token
authentication asks this first: ``index.authentication``), unless this process has verified
that very token before: a principal's own requests are never slowed by
guesses sent from the same address (a shared NAT, a proxy).
"""

from __future__ import annotations

import hashlib
import threading
import time

from django.conf import settings
from rest_framework.exceptions import Throttled
from rest_framework.throttling import BaseThrottle

_MAX_BUCKETS = 100_000
# Tokens whose verification FAILED_AUTHENTICATIONS remembers at most, per process.
_MAX_VERIFIED = 10_000


class TokenBuckets:
    """Token buckets by key (``rate`` tokens a second, at most ``burst``), in this process."""

    def __init__(self):
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, refilled at)
        self._lock = threading.Lock()

    def _tokens(self, key: str, rate: float, burst: int, now: float) -> float:
        tokens, refilled_at = self._buckets.get(key, (burst, now))
        return min(burst, tokens + (now - refilled_at) * rate)

    def take(self, key: str, rate: float, burst: int) -> float:
        """Take a token: 0 when one was there, else the seconds until there is one."""
        now = time.monotonic()
        with self._lock:
            tokens = self._tokens(key, rate, burst, now)
            if tokens >= 1:
                if len(self._buckets) >= _MAX_BUCKETS and key not in self._buckets:
                    self._buckets.clear()  # bounded memory under a flood of new keys
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / rate

    def wait(self, key: str, rate: float, burst: int) -> float:
        """The seconds until the bucket has a token (0: it has one), taking none."""
        with self._lock:
            if key not in self._buckets:
                return 0.0
            tokens = self._tokens(key, rate, burst, time.monotonic())
        return 0.0 if tokens >= 1 else (1 - tokens) / rate

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()


def client_address(request) -> str:
    """The client's address: the peer's, or the one that the ``KVSP_TRUSTED_PROXIES`` proxies
    in front of this server put in X-Forwarded-For (as DRF's ``NUM_PROXIES`` reads it); the
    field is never taken from a client that reached the server directly, which could write
    anything there."""
    meta = getattr(request, "_request", request).META  # DRF's Request wraps Django's
    proxies = settings.KVSP_TRUSTED_PROXIES
    forwarded = meta.get("HTTP_X_FORWARDED_FOR") if proxies else None
    if forwarded:
        addresses = forwarded.split(",")
        return addresses[-min(proxies, len(addresses))].strip()
    return meta.get("REMOTE_ADDR", "")


class PrincipalRateThrottle(BaseThrottle):
    _buckets = TokenBuckets()

    def __init__(self):
        self._wait = 0.0

    @staticmethod
    def _key(request, principal) -> str:
        if getattr(principal, "is_authenticated", False) and hasattr(principal, "id"):
            return f"principal:{principal.id}"
        return f"address:{client_address(request)}"

    @classmethod
    def take(cls, request, principal) -> float:
        """Take a request's token from its principal's bucket: 0 when there was one, else the
        seconds until there is. The lean block path (``workers.api.views``) asks this directly."""
        rate = settings.KVSP_RATE_LIMIT_PER_S
        if not rate:
            return 0.0
        burst = max(settings.KVSP_RATE_LIMIT_BURST, 1)
        return cls._buckets.take(cls._key(request, principal), rate, burst)

    def allow_request(self, request, view) -> bool:
        self._wait = self.take(request, request.user)
        return self._wait == 0.0

    def wait(self) -> float:
        return max(self._wait, 0.001)


class FailedAuthentications:
    """Refused bearer tokens counted per client address, and the tokens this process verified
    (by their digest, never the secret itself), which are never refused for their address's
    failures."""

    def __init__(self):
        self._failures = TokenBuckets()
        self._verified: dict[bytes, None] = {}  # insertion-ordered: the oldest goes first
        self._lock = threading.Lock()

    def check(self, request, token: str) -> None:
        """Raise Throttled (429) when the request's address has spent its failures and this
        process has not verified ``token`` before: it is not looked up."""
        rate = settings.KVSP_AUTH_FAILURES_PER_S
        if not rate:
            return
        wait = self._failures.wait(client_address(request), rate, self._burst())
        if wait and _digest(token) not in self._verified:
            raise Throttled(
                wait,
                "too many failed authentications from this address; retry later",
            )

    def failed(self, request, token: str | None) -> None:
        rate = settings.KVSP_AUTH_FAILURES_PER_S
        if token is not None:
            with self._lock:
                self._verified.pop(_digest(token), None)  # revoked since it was verified
        if rate:
            self._failures.take(client_address(request), rate, self._burst())

    def verified(self, token: str) -> None:
        digest = _digest(token)
        if digest in self._verified:
            return
        with self._lock:
            if len(self._verified) >= _MAX_VERIFIED:
                self._verified.pop(next(iter(self._verified)))
            self._verified[digest] = None

    def clear(self) -> None:
        self._failures.clear()
        with self._lock:
            self._verified.clear()

    @staticmethod
    def _burst() -> int:
        return max(settings.KVSP_AUTH_FAILURES_BURST, 1)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


FAILED_AUTHENTICATIONS = FailedAuthentications()
