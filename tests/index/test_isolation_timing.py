"""A lookup cannot tell "exists in another scope" from "does not exist", not even by its time.

Two-sample Kolmogorov-Smirnov over a few hundred interleaved lookups of each kind (interleaving
cancels drift on a shared machine; each pair in a random order, so that anything periodic in the
server, such as a garbage collection every few requests, lands on either kind alike). The bar is
alpha = 0.001, and a rejection must repeat in a second, fresh round before the test fails, so
chance alone fails it once in a million runs.
"""

import random
import time

import pytest

from tests.support.fixtures import HOLDER_A, make_caller, make_scope, random_key, replica_json

pytestmark = pytest.mark.django_db

COMPAT = "c4" * 32
SAMPLES = 300


def ks_statistic(a: list[float], b: list[float]) -> float:
    """The largest gap between the two empirical distribution functions."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    while i < len(a) and j < len(b):
        value = min(a[i], b[j])
        while i < len(a) and a[i] == value:
            i += 1
        while j < len(b) and b[j] == value:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


def critical_value(n: int, m: int, coefficient: float = 1.95) -> float:
    """The KS critical value at alpha = 0.001 (c(alpha) = 1.95)."""
    return coefficient * ((n + m) / (n * m)) ** 0.5


def test_ks_statistic_sees_a_real_difference():
    # The probe is able to tell distributions apart when they differ: the pair that keeps the
    # isolation test honest.
    same = [i / 100 for i in range(300)]
    shifted = [x + 0.5 for x in same]
    assert ks_statistic(same, same) == 0
    assert ks_statistic(same, shifted) > critical_value(300, 300)


def test_lookup_time_does_not_reveal_another_scopes_blocks():
    scope = make_scope("tenant-a")
    owner = make_caller("owner", scopes=[scope], holders=[HOLDER_A])
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    keys = [random_key() for _ in range(32)]
    for key in keys:
        record = replica_json(scope.scope_id_hex, COMPAT, key)
        owner.put(f"/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{key}", record)
    absent = [random_key() for _ in range(32)]

    def timed(block_keys):
        request = {"scope_id": scope.scope_id_hex, "compat_id": COMPAT, "block_keys": block_keys}
        start = time.perf_counter()
        response = outsider.post("/kvsp/lookup", request)
        elapsed = time.perf_counter() - start
        assert response.content == b'{"matched":0,"blocks":[]}'
        return elapsed

    def round_rejects() -> bool:
        existing, missing = [], []
        for _ in range(SAMPLES):
            pair = [(existing, keys), (missing, absent)]
            order.shuffle(pair)
            for samples, block_keys in pair:
                samples.append(timed(block_keys))
        return ks_statistic(existing, missing) > critical_value(SAMPLES, SAMPLES)

    order = random.Random(2)
    for _ in range(20):  # warm up caches and connections
        timed(keys)
        timed(absent)
    assert not (round_rejects() and round_rejects())
    # The owner does see its blocks: the lookups above were of real, published data.
    request = {"scope_id": scope.scope_id_hex, "compat_id": COMPAT, "block_keys": keys}
    assert owner.post("/kvsp/lookup", request).json()["matched"] == 32
