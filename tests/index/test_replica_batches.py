"""Batch publication, ``POST CP replicas`` (DESIGN.md section 3): every record judged as its
single PUT (spec 6.1) would judge it, the outcomes in order, a constant number of statements."""

import base64

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from index.models import Holder, Replica
from kvsp.records import ReplicaBatchAnswer, encode_moqt_namespace
from tests.index.test_replicas import COMPAT, path_of
from tests.support.answers import assert_answers_as
from tests.support.fixtures import (
    HOLDER_A,
    HOLDER_B,
    body,
    make_caller,
    problem_name,
    random_key,
    replica_json,
)
from tests.support.statements import PRINCIPAL_OF_TOKEN, statements_sent

pytestmark = pytest.mark.django_db

BATCH = "/kvsp/replicas"


def publish(caller, records):
    response = caller.post(BATCH, {"records": records})
    assert response.status_code == 200, response.content
    assert_answers_as(ReplicaBatchAnswer, body(response))
    return body(response)["results"]


def long_namespace() -> str:
    """A valid moqt_namespace longer than the column that stores it."""
    return encode_moqt_namespace(tuple(bytes([n]) * 255 for n in range(5)))


def refusals(scope, other_scope):
    """Records each refused for another reason, by name."""
    key = random_key
    moqt = replica_json(scope.scope_id_hex, COMPAT, key(), "moqt://relay.test")
    moqt["moqt_namespace"] = long_namespace()
    return {
        "not an object": ["not", "a", "record"],
        "invalid": {**replica_json(scope.scope_id_hex, COMPAT, key()), "codec": "raw"},
        "bad digest": {
            **replica_json(scope.scope_id_hex, COMPAT, key()),
            "digest": "sha-256:" + "0" * 64,
        },
        "another holder": replica_json(scope.scope_id_hex, COMPAT, key(), HOLDER_B),
        "another scope": replica_json(other_scope.scope_id_hex, COMPAT, key()),
        "no such scope": replica_json(random_key()[:32], COMPAT, key()),
        "too long to store": moqt,
    }


def test_a_mixed_batch_answers_each_record_in_order(scope, other_scope):
    holder = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A, "moqt://relay.test"])
    known = replica_json(scope.scope_id_hex, COMPAT, random_key())
    assert holder.put(path_of(known), known).status_code == 201
    fresh = replica_json(scope.scope_id_hex, COMPAT, random_key())
    refused = refusals(scope, other_scope)
    records = [fresh, *refused.values(), known]
    results = publish(holder, records)
    assert [r["status"] for r in results] == [201, 400, 422, 422, 403, 403, 403, 422, 200]
    for record, result in zip(records, results, strict=True):
        expected = record.get("block_key") if isinstance(record, dict) else None
        assert result["block_key"] == expected
    assert [r["problem"] is None for r in results] == [True, *[False] * len(refused), True]
    stored = {bytes(k).hex() for k in Replica.objects.values_list("block_key", flat=True)}
    assert stored == {fresh["block_key"], known["block_key"]}


def test_each_refusal_is_the_answer_of_its_single_put(scope, other_scope):
    holder = make_caller("holder-a", scopes=[scope], holders=[HOLDER_A, "moqt://relay.test"])
    refused = refusals(scope, other_scope)
    results = publish(holder, list(refused.values()))
    assert Replica.objects.count() == 0
    # The last single PUT fails its statement, which ends what this test's transaction can do.
    assert list(refused)[-1] == "too long to store"
    for (reason, record), result in zip(refused.items(), results, strict=True):
        if isinstance(record, dict):
            single = holder.put(path_of(record), record)
        else:
            single = holder.put(path_of(refused["invalid"]), record)
        assert result["status"] == single.status_code, reason
        assert result["problem"] == body(single), reason


def test_another_scopes_record_is_told_what_a_missing_scope_is(scope, other_scope, holder_a):
    """Another tenant's scope answers exactly as a scope that does not exist."""
    theirs = replica_json(other_scope.scope_id_hex, COMPAT, random_key())
    nobodys = replica_json(random_key()[:32], COMPAT, random_key())
    first, second = publish(holder_a, [theirs, nobodys])
    # Valid records, decoded with their batch: each outcome still names its record.
    assert (first["block_key"], first["holder"]) == (theirs["block_key"], theirs["holder"])
    assert first["status"] == second["status"] == 403
    assert first["problem"] == second["problem"]
    assert other_scope.scope_id_hex not in str(first["problem"])


def test_published_records_are_those_a_single_put_would_store(scope, holder_a):
    records = [replica_json(scope.scope_id_hex, COMPAT, random_key(), layers=8) for _ in range(3)]
    records[1]["residency"] = [
        {"tier": "device", "layers": [0, 3]},
        {"tier": "disk", "layers": [4, 7], "read_mbit_per_s": 900.0},
    ]
    results = publish(holder_a, records)
    assert [r["status"] for r in results] == [201, 201, 201]
    assert {r["ttl_ms"] for r in results} == {60_000}
    for record in records:
        (served,) = body(holder_a.get(path_of(record)))["replicas"]
        assert {k: v for k, v in served.items() if k != "ttl_ms"} == {
            k: v for k, v in record.items() if k != "ttl_ms"
        }
    again = publish(holder_a, records)
    assert [r["status"] for r in again] == [200, 200, 200]
    assert Replica.objects.count() == 3
    assert set(Replica.objects.values_list("refresh_count", flat=True)) == {1}


def test_a_replica_named_twice_ends_as_its_last_record(scope, holder_a):
    key = random_key()
    first = replica_json(scope.scope_id_hex, COMPAT, key)
    last = replica_json(
        scope.scope_id_hex, COMPAT, key, residency=[{"tier": "disk", "layers": [0, 3]}]
    )
    broken = {**replica_json(scope.scope_id_hex, COMPAT, key), "size": -1}
    results = publish(holder_a, [first, last, broken])
    assert [r["status"] for r in results] == [201, 200, 422]
    (served,) = body(holder_a.get(path_of(first)))["replicas"]
    assert served["residency"] == last["residency"]


@override_settings(KVSP_MAX_TTL_MS=5_000)
def test_ttl_is_capped_per_record(scope, holder_a):
    long = replica_json(scope.scope_id_hex, COMPAT, random_key(), ttl_ms=3_600_000)
    short = replica_json(scope.scope_id_hex, COMPAT, random_key(), ttl_ms=1_000)
    results = publish(holder_a, [long, short])
    assert [r["ttl_ms"] for r in results] == [5_000, 1_000]
    assert sorted(Replica.objects.values_list("ttl_ms", flat=True)) == [1_000, 5_000]


def test_a_holders_first_records_intern_it(scope):
    holder = make_caller("holder-ab", scopes=[scope], holders=[HOLDER_A, HOLDER_B])
    records = [
        replica_json(scope.scope_id_hex, COMPAT, random_key(), url)
        for url in (HOLDER_A, HOLDER_B, HOLDER_A)
    ]
    assert [r["status"] for r in publish(holder, records)] == [201, 201, 201]
    assert sorted(Holder.objects.values_list("url", flat=True)) == [HOLDER_A, HOLDER_B]
    assert [r["holder"] for r in publish(holder, records)] == [HOLDER_A, HOLDER_B, HOLDER_A]


def test_a_node_publishes_for_its_own_instance_url(scope):
    from placement.services import do_register_instance

    do_register_instance("ii7", "http://ii7.test/kvsp/")
    node = make_caller("node-ii7", scopes=[scope], instance="ii7")
    own = replica_json(scope.scope_id_hex, COMPAT, random_key(), "http://ii7.test/kvsp/")
    elsewhere = replica_json(scope.scope_id_hex, COMPAT, random_key(), HOLDER_A)
    assert [r["status"] for r in publish(node, [own, elsewhere])] == [201, 403]


def test_statements_do_not_grow_with_the_batch(scope, holder_a):
    def statements(count: int) -> list[str]:
        records = [replica_json(scope.scope_id_hex, COMPAT, random_key()) for _ in range(count)]
        with statements_sent() as sent:
            results = publish(holder_a, records)
        assert {r["status"] for r in results} == {201}
        return sent

    statements(1)  # the holder's first record interns it
    assert (
        statements(2)
        == statements(64)
        == statements(512)
        == [
            PRINCIPAL_OF_TOKEN,
            "SAVEPOINT",
            "WITH INSERT, SELECT index_replica index_holder",
            "RELEASE SAVEPOINT",
        ]
    )


@pytest.mark.parametrize(
    ("document", "status", "problem"),
    [
        ([], 400, "kvsp-malformed-request"),
        ({"records": {"0": {}}}, 400, "kvsp-malformed-request"),
        ({"entries": []}, 400, "kvsp-malformed-request"),
    ],
)
def test_a_malformed_body_is_refused_whole(holder_a, document, status, problem):
    response = holder_a.post(BATCH, document)
    assert response.status_code == status
    assert problem_name(response) == problem
    assert Replica.objects.count() == 0


@override_settings(KVSP_MAX_BATCH_RECORDS=3)
def test_more_records_than_allowed_are_refused_whole(scope, holder_a):
    records = [replica_json(scope.scope_id_hex, COMPAT, random_key()) for _ in range(4)]
    response = holder_a.post(BATCH, {"records": records})
    assert response.status_code == 413
    assert problem_name(response) == "kvsp-payload-too-large"
    assert Replica.objects.count() == 0
    assert [r["status"] for r in publish(holder_a, records[:3])] == [201] * 3


def test_an_empty_batch_answers_no_results(holder_a):
    assert publish(holder_a, []) == []


def test_a_batch_needs_a_token(scope):
    from tests.support.fixtures import anonymous

    record = replica_json(scope.scope_id_hex, COMPAT, random_key())
    response = anonymous().post(BATCH, {"records": [record]})
    assert response.status_code == 401
    assert Replica.objects.count() == 0


def test_the_namespace_limit_is_the_columns(scope):
    """The length refused as too long to store is the one the column holds: one shorter is
    stored (the pair that keeps the refusal above honest)."""
    fields = (b"a" * 255, b"b" * 40, b"", b"", b"")
    namespace = encode_moqt_namespace(fields)
    limit = Replica._meta.get_field("moqt_namespace").max_length
    assert len(namespace) <= limit < len(long_namespace())
    holder = make_caller("relay", scopes=[scope], holders=["moqt://relay.test"])
    record = replica_json(scope.scope_id_hex, COMPAT, random_key(), "moqt://relay.test")
    record["moqt_namespace"] = namespace
    assert base64.urlsafe_b64decode(namespace + "=" * (-len(namespace) % 4))
    assert [r["status"] for r in publish(holder, [record])] == [201]


# --- batch withdrawal ---------------------------------------------------------------------------

WITHDRAWALS = "/kvsp/replicas/withdrawals"


def identity(record, holder=None) -> dict:
    names = ("compat_id", "scope_id", "block_key")
    return {**{name: record[name] for name in names}, "holder": holder or record["holder"]}


def withdraw(caller, identities):
    response = caller.post(WITHDRAWALS, {"replicas": identities})
    assert response.status_code == 200, response.content
    assert_answers_as(ReplicaBatchAnswer, body(response))
    return body(response)["results"]


def test_a_batch_withdraws_each_replica_as_its_delete(scope, other_scope, holder_a):
    ours = [replica_json(scope.scope_id_hex, COMPAT, random_key()) for _ in range(3)]
    publish(holder_a, ours)
    theirs = replica_json(other_scope.scope_id_hex, COMPAT, random_key())
    publish(make_caller("holder-b", scopes=[other_scope], holders=[HOLDER_A]), [theirs])
    unknown = replica_json(scope.scope_id_hex, COMPAT, random_key())
    asked = [
        identity(ours[0]),
        identity(ours[0]),  # named twice: the first withdraws it
        identity(ours[1], HOLDER_B),  # a holder this principal does not act for
        identity(unknown),
        identity(theirs),  # another tenant's replica: as if it did not exist
        {**identity(ours[2]), "block_key": "not hex"},
        identity(ours[2]),
    ]
    results = withdraw(holder_a, asked)
    assert [r["status"] for r in results] == [204, 404, 403, 404, 404, 400, 204]
    assert [r["holder"] for r in results[:3]] == [HOLDER_A, HOLDER_A, HOLDER_B]
    assert results[3]["problem"] == results[4]["problem"]
    remaining = {bytes(k).hex() for k in Replica.objects.values_list("block_key", flat=True)}
    assert remaining == {ours[1]["block_key"], theirs["block_key"]}
    # Each refusal is the answer of the single DELETE.
    for index in (2, 3, 4):
        single = holder_a.delete(path_of(asked[index]) + f"?holder={asked[index]['holder']}")
        assert (results[index]["status"], results[index]["problem"]) == (
            single.status_code,
            body(single),
        )


def test_withdrawal_statements_do_not_grow_with_the_batch(scope, holder_a):
    def statements(count: int) -> int:
        records = [replica_json(scope.scope_id_hex, COMPAT, random_key()) for _ in range(count)]
        publish(holder_a, records)
        with CaptureQueriesContext(connection) as queries:
            results = withdraw(holder_a, [identity(record) for record in records])
        assert {r["status"] for r in results} == {204}
        return len(queries)

    # Authentication, and the batch's delete.
    assert statements(2) == statements(64) == statements(512) == 2
    assert Replica.objects.count() == 0


@pytest.mark.parametrize("document", [[], {"replicas": "all"}, {"records": []}])
def test_a_malformed_withdrawal_body_is_refused_whole(holder_a, document):
    response = holder_a.post(WITHDRAWALS, document)
    assert response.status_code == 400
    assert problem_name(response) == "kvsp-malformed-request"


def test_a_holder_no_database_holds_is_refused_alone(scope):
    """A NUL in a holder fails any statement that names it: it is that item's refusal, and the
    batch's statement for the others still runs (a principal bound to an instance, whose holders
    are looked up in the database)."""
    from placement.services import do_register_instance

    do_register_instance("ii8", "http://ii8.test/kvsp/")
    node = make_caller("node-ii8", scopes=[scope], instance="ii8")
    own = replica_json(scope.scope_id_hex, COMPAT, random_key(), "http://ii8.test/kvsp/")
    broken = replica_json(scope.scope_id_hex, COMPAT, random_key(), "http://ii8\x00.test/kvsp/")
    assert [r["status"] for r in publish(node, [broken, own])] == [422, 201]
    results = withdraw(node, [identity(own, "http://ii8\x00.test/kvsp/"), identity(own)])
    assert [r["status"] for r in results] == [422, 204]
