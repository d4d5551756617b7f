"""Publishing, refreshing, reading and withdrawing replicas (spec 6.1) and who may do it."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from index.authentication import principal_for_token
from index.models import Replica
from index.services import do_publish_replica
from kvsp.records import ReplicaRecord, Replicas
from tests.support.answers import assert_answers_as
from tests.support.fixtures import (
    HOLDER_A,
    HOLDER_B,
    anonymous,
    body,
    make_caller,
    problem_name,
    random_key,
    replica_json,
)

pytestmark = pytest.mark.django_db

COMPAT = "c0" * 32


def path_of(record):
    return f"/kvsp/replicas/{record['compat_id']}/{record['scope_id']}/{record['block_key']}"


def test_publish_creates_then_refresh_is_idempotent(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    first = holder_a.put(path_of(record), record)
    assert first.status_code == 201, first.content
    assert body(first)["ttl_ms"] == 60_000
    second = holder_a.put(path_of(record), record)
    assert second.status_code == 200
    assert Replica.objects.count() == 1
    listed = holder_a.get(path_of(record))
    assert listed.status_code == 200
    assert_answers_as(Replicas, body(listed))
    (served,) = body(listed)["replicas"]
    assert served["holder"] == HOLDER_A
    assert served["digest"] == record["digest"]
    assert served["layer_digests"] == record["layer_digests"]
    assert 0 < served["ttl_ms"] <= 60_000


def test_refresh_replaces_the_record(scope, holder_a):
    key = random_key()
    holder_a.put(path_of(r := replica_json(scope.scope_id_hex, COMPAT, key)), r)
    moved = replica_json(
        scope.scope_id_hex,
        COMPAT,
        key,
        residency=[{"tier": "device", "layers": [0, 1]}, {"tier": "disk", "layers": [2, 3]}],
    )
    assert holder_a.put(path_of(moved), moved).status_code == 200
    (served,) = body(holder_a.get(path_of(moved)))["replicas"]
    assert served["residency"] == moved["residency"]


def test_two_holders_of_one_block_are_two_replicas(scope, holder_a):
    holder_b = make_caller("holder-b", scopes=[scope], holders=[HOLDER_B])
    key = random_key()
    holder_a.put(path_of(a := replica_json(scope.scope_id_hex, COMPAT, key)), a)
    holder_b.put(path_of(b := replica_json(scope.scope_id_hex, COMPAT, key, HOLDER_B)), b)
    replicas = body(holder_a.get(path_of(a)))["replicas"]
    assert [r["holder"] for r in replicas] == [HOLDER_A, HOLDER_B]


@override_settings(KVSP_MAX_TTL_MS=5_000)
def test_ttl_is_capped(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key(), ttl_ms=3_600_000)
    response = holder_a.put(path_of(record), record)
    assert body(response)["ttl_ms"] == 5_000
    assert Replica.objects.get().ttl_ms == 5_000


def test_expired_records_are_never_returned(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key(), ttl_ms=30)
    a_second_ago = timezone.now() - timedelta(seconds=1)
    publisher = principal_for_token(holder_a.token)
    do_publish_replica(publisher, ReplicaRecord.from_json(record), now=a_second_ago)
    assert problem_name(holder_a.get(path_of(record))) == "kvsp-not-found"
    lookup = holder_a.post(
        "/kvsp/lookup",
        {"scope_id": scope.scope_id_hex, "compat_id": COMPAT, "block_keys": [record["block_key"]]},
    )
    assert body(lookup)["matched"] == 0


def test_unknown_members_are_ignored(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    record["x-vendor-hint"] = {"anything": [1, 2]}
    record["residency"][0]["x-numa-node"] = 3
    response = holder_a.put(path_of(record), record)
    assert response.status_code == 201
    assert "x-vendor-hint" not in body(response)
    assert "x-numa-node" not in body(response)["residency"][0]


@pytest.mark.parametrize("member", ["block_key", "scope_id", "compat_id"])
def test_path_and_body_must_agree(scope, holder_a, member):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    path = path_of(record)
    record[member] = random_key()[: len(record[member])]
    response = holder_a.put(path, record)
    assert response.status_code in (400, 422)
    assert Replica.objects.count() == 0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.pop("digest"),
        lambda r: r.update(digest="sha-256:" + "0" * 64),
        lambda r: r.update(
            residency=[{"tier": "host", "layers": [0, 2]}, {"tier": "disk", "layers": [2, 3]}]
        ),
        lambda r: r.update(ttl_ms=-1),
        lambda r: r.update(codec="raw"),
        lambda r: r.update(holder="not a url"),
    ],
)
def test_invalid_records_are_refused_and_store_nothing(scope, holder_a, mutate):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    mutate(record)
    response = holder_a.put(path_of(record), record)
    assert response.status_code in (400, 403, 422)
    assert response["Content-Type"] == "application/problem+json"
    assert Replica.objects.count() == 0


def test_invalid_refresh_keeps_the_stored_record(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    broken = dict(record, size="large")
    assert holder_a.put(path_of(record), broken).status_code == 422
    assert Replica.objects.get().size == record["size"]


@pytest.mark.parametrize(
    "path",
    [
        "/kvsp/replicas/zz/00/11",
        "/kvsp/replicas/" + "A" * 64 + "/" + "0" * 32 + "/" + "0" * 64,
        "/kvsp/replicas/" + "0" * 64 + "/" + "0" * 31 + "/" + "0" * 64,
    ],
)
def test_malformed_paths_are_problems(holder_a, path):
    response = holder_a.get(path)
    assert response.status_code == 404
    assert problem_name(response) == "kvsp-not-found"


def test_non_object_body_is_a_problem(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    response = holder_a.put(path_of(record), [record])
    assert response.status_code == 400


def test_withdraw(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    response = holder_a.delete(path_of(record) + f"?holder={HOLDER_A}")
    assert response.status_code == 204
    assert problem_name(holder_a.get(path_of(record))) == "kvsp-not-found"
    again = holder_a.delete(path_of(record) + f"?holder={HOLDER_A}")
    assert again.status_code == 404


def test_withdraw_needs_the_holder_parameter(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    assert holder_a.delete(path_of(record)).status_code == 400
    assert Replica.objects.count() == 1


# --- the authorization matrix -------------------------------------------------------------------


def test_publishing_for_another_holder_is_forbidden(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key(), HOLDER_B)
    response = holder_a.put(path_of(record), record)
    assert response.status_code == 403
    assert problem_name(response) == "kvsp-forbidden"
    assert Replica.objects.count() == 0


def test_publishing_into_another_scope_is_forbidden(scope, other_scope, holder_a):
    record = replica_json(other_scope.scope_id_hex, COMPAT, random_key())
    response = holder_a.put(path_of(record), record)
    assert response.status_code == 403
    assert Replica.objects.count() == 0


def test_a_node_publishes_for_its_own_instance_url(scope):
    from placement.services import do_register_instance

    do_register_instance("ii7", "http://ii7.test/kvsp/")
    node = make_caller("node-ii7", scopes=[scope], instance="ii7")
    record = replica_json(scope.scope_id_hex, COMPAT, random_key(), "http://ii7.test/kvsp/")
    assert node.put(path_of(record), record).status_code == 201
    elsewhere = replica_json(scope.scope_id_hex, COMPAT, random_key(), HOLDER_A)
    assert node.put(path_of(elsewhere), elsewhere).status_code == 403


def test_reading_another_scope_looks_like_a_miss(scope, other_scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    outsider = make_caller("outsider", scopes=[other_scope])
    hidden = outsider.get(path_of(record))
    missing = outsider.get(path_of(dict(record, block_key=random_key())))
    assert hidden.status_code == missing.status_code == 404
    assert body(hidden) == body(missing)
    # ...and the same principal sees its own scope (the pair that keeps this test honest).
    assert holder_a.get(path_of(record)).status_code == 200


def test_withdrawing_in_another_scope_looks_like_a_miss(scope, other_scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    outsider = make_caller("outsider", scopes=[other_scope], holders=[HOLDER_A])
    response = outsider.delete(path_of(record) + f"?holder={HOLDER_A}")
    assert response.status_code == 404
    assert Replica.objects.count() == 1


def test_withdrawing_for_another_holder_is_forbidden(scope, holder_a):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    holder_a.put(path_of(record), record)
    same_scope = make_caller("peer", scopes=[scope], holders=[HOLDER_B])
    assert same_scope.delete(path_of(record) + f"?holder={HOLDER_A}").status_code == 403
    assert Replica.objects.count() == 1


@pytest.mark.parametrize("token", ["", "kvsp_wrong", "not-even-a-kvsp-token"])
def test_missing_or_bad_tokens_are_401(scope, token):
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    caller = anonymous()
    caller.token = token
    response = caller.put(path_of(record), record)
    assert response.status_code == 401
    assert Replica.objects.count() == 0


def test_revoked_token_is_401(scope, holder_a):
    from index.models import Principal

    Principal.objects.filter(name="holder-a").update(revoked_at=timezone.now())
    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    assert holder_a.put(path_of(record), record).status_code == 401
