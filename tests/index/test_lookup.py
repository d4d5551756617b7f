"""Prefix lookup (spec 6.2) with estimates per target (6.4)."""

import pytest
from django.test import override_settings
from django.utils import timezone

from kvsp.compat import compat_id_hex
from kvsp.records import LookupAnswer
from placement.models import Instance, InstanceState
from tests.support.answers import assert_answers_as
from tests.support.descriptors import descriptor
from tests.support.fixtures import (
    HOLDER_A,
    HOLDER_B,
    body,
    make_caller,
    make_scope,
    problem_name,
    random_key,
    replica_json,
)
from tests.support.statements import PRINCIPAL_OF_TOKEN, statements_sent

pytestmark = pytest.mark.django_db

COMPAT = "c1" * 32


@pytest.fixture
def holder_b(scope):
    return make_caller("holder-b", scopes=[scope], holders=[HOLDER_B])


def publish(caller, scope, key, holder=HOLDER_A, **options):
    record = replica_json(scope.scope_id_hex, COMPAT, key, holder, **options)
    path = f"/kvsp/replicas/{COMPAT}/{scope.scope_id_hex}/{key}"
    assert caller.put(path, record).status_code in (200, 201)
    return record


def lookup(caller, scope, keys, **extra):
    request = {"scope_id": scope.scope_id_hex, "compat_id": COMPAT, "block_keys": keys, **extra}
    return caller.post("/kvsp/lookup", request)


def test_matched_counts_leading_keys_and_stops_at_the_first_gap(scope, holder_a, holder_b):
    keys = [random_key() for _ in range(6)]
    for key in keys[:2]:
        publish(holder_a, scope, key)
    publish(holder_b, scope, keys[1], HOLDER_B)
    # keys[2] has no replica; keys[3:] do, but a chain broken at 2 cannot use them.
    for key in keys[3:]:
        publish(holder_a, scope, key)
    answer = body(lookup(holder_a, scope, keys))
    assert answer["matched"] == 2
    assert [block["block_key"] for block in answer["blocks"]] == keys[:2]
    assert [len(block["replicas"]) for block in answer["blocks"]] == [1, 2]
    assert "estimates" not in answer


def test_everything_matched(scope, holder_a):
    keys = [random_key() for _ in range(40)]
    for key in keys:
        publish(holder_a, scope, key)
    answer = body(lookup(holder_a, scope, keys))
    assert answer["matched"] == 40
    assert answer["blocks"][39]["replicas"][0]["block_key"] == keys[39]


def test_a_lookup_sends_the_same_statements_however_many_keys_it_asks_for(
    scope, holder_a, lookup_tally_not_due
):
    """The replicas of every key asked for in one statement: a statement per key would make a
    lookup of a long prompt a round trip per block."""

    def statements(count: int) -> list[str]:
        keys = [random_key() for _ in range(count)]
        for key in keys:
            publish(holder_a, scope, key)
        with statements_sent() as sent:
            assert body(lookup(holder_a, scope, keys))["matched"] == count
        return sent

    assert (
        statements(1)
        == statements(64)
        == [
            PRINCIPAL_OF_TOKEN,
            "SELECT index_replica index_holder",
        ]
    )


def test_no_keys_and_no_match(scope, holder_a):
    assert body(lookup(holder_a, scope, []))["matched"] == 0
    assert body(lookup(holder_a, scope, [random_key()])) == {"matched": 0, "blocks": []}


def test_another_compat_id_does_not_match(scope, holder_a):
    key = random_key()
    publish(holder_a, scope, key)
    request = {"scope_id": scope.scope_id_hex, "compat_id": "d2" * 32, "block_keys": [key]}
    assert body(holder_a.post("/kvsp/lookup", request))["matched"] == 0


def test_another_scope_answers_exactly_like_a_miss(scope, holder_a):
    keys = [random_key() for _ in range(3)]
    for key in keys:
        publish(holder_a, scope, key)
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    hidden = lookup(outsider, scope, keys)
    absent = lookup(outsider, scope, [random_key() for _ in range(3)])
    assert hidden.status_code == absent.status_code == 200
    assert hidden.content == absent.content == b'{"matched":0,"blocks":[]}'
    assert body(lookup(holder_a, scope, keys))["matched"] == 3


def test_the_controller_reads_every_scope(scope, holder_a):
    key = random_key()
    publish(holder_a, scope, key)
    controller = make_caller("pc", controller=True)
    assert body(lookup(controller, scope, [key]))["matched"] == 1


@override_settings(KVSP_MAX_LOOKUP_KEYS=8)
def test_too_many_keys_is_413(scope, holder_a):
    response = lookup(holder_a, scope, [random_key() for _ in range(9)])
    assert response.status_code == 413
    assert problem_name(response) == "kvsp-payload-too-large"


@pytest.mark.parametrize(
    "request_body",
    [
        {},
        {"scope_id": "zz", "compat_id": COMPAT, "block_keys": []},
        {"scope_id": "00" * 16, "compat_id": COMPAT, "block_keys": "abc"},
        {"scope_id": "00" * 16, "compat_id": COMPAT, "block_keys": [1, 2]},
        {"scope_id": "00" * 16, "compat_id": COMPAT, "block_keys": [], "targets": ["ftp://x/"]},
        [],
        "lookup",
    ],
)
def test_malformed_lookups_are_problems(holder_a, request_body):
    response = holder_a.post("/kvsp/lookup", request_body)
    assert response.status_code in (400, 422)
    assert response["Content-Type"] == "application/problem+json"


def report(url, *, links, prefill=10_000.0, name=None):
    name = name or url.split("//")[1].split(".")[0]
    status = {
        "instance": url,
        "epoch": 1,
        "state": "active",
        "running": 0,
        "queued": 0,
        "batch_size": 8,
        "kv_utilization": 0.1,
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": 100.0,
        "links": links,
        "requested_state": None,
        "ttl_ms": 3000,
    }
    now = timezone.now()
    Instance.objects.create(
        name=name,
        url=url,
        state=InstanceState.ACTIVE,
        epoch=1,
        last_status=status,
        last_report_at=now,
        expires_at=now + timezone.timedelta(seconds=3),
        prefill_tokens_per_s=prefill,
    )


def test_estimates_per_target(scope, holder_a):
    small_model = descriptor()
    compat = compat_id_hex(small_model)
    assert holder_a.put(f"/kvsp/compat/{compat}", small_model).status_code == 201
    keys = [random_key() for _ in range(4)]
    for key in keys:
        record = replica_json(scope.scope_id_hex, compat, key, HOLDER_A, size=1_000_000)
        holder_a.put(f"/kvsp/replicas/{compat}/{scope.scope_id_hex}/{key}", record)
    report(
        "http://fast.test/kvsp/", links=[{"holder": HOLDER_A, "mbit_per_s": 100_000, "rtt_us": 10}]
    )
    report("http://slow.test/kvsp/", links=[{"holder": HOLDER_A, "mbit_per_s": 100, "rtt_us": 500}])
    report("http://cut.test/kvsp/", links=[])
    targets = [
        "http://fast.test/kvsp/",
        "http://slow.test/kvsp/",
        "http://cut.test/kvsp/",
        "http://nobody.test/kvsp/",
    ]
    request = {
        "scope_id": scope.scope_id_hex,
        "compat_id": compat,
        "block_keys": keys,
        "targets": targets,
    }
    answer = body(holder_a.post("/kvsp/lookup", request))
    assert_answers_as(LookupAnswer, answer)
    assert answer["matched"] == 4
    estimates = {e["target"]: e for e in answer["estimates"]}
    # 4 MB at 100,000 Mbit/s is 320 us, plus 10 us of round trip.
    assert estimates["http://fast.test/kvsp/"]["fetch_us"] == pytest.approx(330)
    assert estimates["http://slow.test/kvsp/"]["fetch_us"] == pytest.approx(500 + 320_000)
    # 4 blocks of 16 tokens at 10,000 tokens/s.
    assert estimates["http://fast.test/kvsp/"]["recompute_us"] == pytest.approx(6_400)
    unpriced = {u["target"]: u["reason"] for u in answer["unpriced"]}
    assert unpriced == {
        "http://cut.test/kvsp/": "no link to a holder of a matched block",
        "http://nobody.test/kvsp/": "unknown instance",
    }


def test_targets_without_a_registered_descriptor_are_unpriced(scope, holder_a):
    key = random_key()
    publish(holder_a, scope, key)
    answer = body(lookup(holder_a, scope, [key], targets=["http://fast.test/kvsp/"]))
    assert answer["estimates"] == []
    assert "Compatibility Descriptor" in answer["unpriced"][0]["reason"]
