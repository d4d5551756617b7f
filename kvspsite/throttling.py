"""Flood protection: a token bucket per principal (or per address before authentication).

The buckets live in the serving process, so the limit applies per process: an operator sizes
``KVSP_RATE_LIMIT_PER_S`` for one gunicorn worker. A bucket in memory costs nothing on the hot
paths, where a shared store would add a round trip to every request.
"""

from __future__ import annotations

import threading
import time

from django.conf import settings
from rest_framework.throttling import BaseThrottle

_MAX_BUCKETS = 100_000


class PrincipalRateThrottle(BaseThrottle):
    _buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, refilled at)
    _lock = threading.Lock()

    def __init__(self):
        self._wait = 0.0

    def _key(self, request) -> str:
        principal = request.user
        if getattr(principal, "is_authenticated", False) and hasattr(principal, "id"):
            return f"principal:{principal.id}"
        return f"address:{self.get_ident(request)}"

    def allow_request(self, request, view) -> bool:
        rate = settings.KVSP_RATE_LIMIT_PER_S
        if not rate:
            return True
        burst = max(settings.KVSP_RATE_LIMIT_BURST, 1)
        key, now = self._key(request), time.monotonic()
        with self._lock:
            tokens, refilled_at = self._buckets.get(key, (burst, now))
            tokens = min(burst, tokens + (now - refilled_at) * rate)
            if tokens >= 1:
                if len(self._buckets) >= _MAX_BUCKETS and key not in self._buckets:
                    self._buckets.clear()  # bounded memory under a flood of new addresses
                self._buckets[key] = (tokens - 1, now)
                return True
            self._buckets[key] = (tokens, now)
            self._wait = (1 - tokens) / rate
            return False

    def wait(self) -> float:
        return max(self._wait, 0.001)
