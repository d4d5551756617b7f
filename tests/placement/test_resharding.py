"""Resharding as a two-phase commit (spec 6.9), driven by the PC against instances on loopback."""

from datetime import timedelta

import pytest
from django.utils import timezone

from kvsp.records import ReshardOperationAnswer
from placement import resharding
from placement.models import ReshardOperation, ShardMap
from tests.support.answers import assert_answers_as
from tests.support.fixtures import body, make_caller, make_scope, problem_name, random_key
from tests.support.standin import StandinNode
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def controller():
    return make_caller("pc", controller=True)


@pytest.fixture
def worker(role_env, start_process, controller):
    env = role_env(KVSP_TOKEN=controller.token)
    return start_process("worker", "control-worker", env, queues=["control"])


def shard_map(version, *shards):
    return {
        "map": "ctx-1",
        "version": version,
        "shards": [{"tokens": list(t), "instance": url} for t, url in shards],
    }


def test_grow_commits_when_every_member_acknowledges(controller, worker):
    with StandinNode() as one, StandinNode() as two, StandinNode() as three:
        v4 = shard_map(4, ((0, 32768), one.url), ((32768, 65536), two.url))
        assert controller.put("/kvsp/shardmaps/ctx-1", v4).status_code == 201
        next_shards = shard_map(
            0, ((0, 32768), one.url), ((32768, 49152), two.url), ((49152, 65536), three.url)
        )["shards"]
        response = controller.post(
            "/kvsp/shardmaps/ctx-1/reshard", {"shards": next_shards, "deadline_ms": 5000}
        )
        assert response.status_code == 202
        assert response["Location"].endswith("/kvsp/shardmaps/ctx-1/reshards/5")
        answer = body(response)
        assert (answer["from"], answer["to"], answer["state"]) == (4, 5, "preparing")
        plans = {plan["instance"]: plan for plan in answer["plans"]}
        assert plans[one.url]["retain"] == [[0, 32768]] and plans[one.url]["fetch"] == []
        assert plans[three.url]["fetch"] == [{"tokens": [49152, 65536], "from": two.url}]
        assert plans[two.url]["release"] == [[49152, 65536]]

        wait_until(lambda: ReshardOperation.objects.get().finished_at is not None, "finished")
        for node in (one, two, three):
            received = node.received("POST", "/kvsp/reshard")
            assert received[0]["to"] == 5 and received[0]["instance"] == node.url, received
            assert received[-1] == {"map": "ctx-1", "commit": 5, "attempt": 1}
    operation = ReshardOperation.objects.get()
    assert operation.phase == "committed"
    assert sorted(operation.acknowledged) == sorted([one.url, two.url, three.url])
    current = body(controller.get("/kvsp/shardmaps/ctx-1"))
    assert current["version"] == 5 and len(current["shards"]) == 3
    status = body(controller.get("/kvsp/shardmaps/ctx-1/reshards/5"))
    assert_answers_as(ReshardOperationAnswer, status)
    assert status["state"] == "committed"


def test_a_member_that_never_acknowledges_aborts_it(controller, worker):
    with StandinNode() as one, StandinNode() as slow:
        slow.delays[("POST", "/kvsp/reshard")] = 3.0  # past the deadline, then it answers
        v1 = shard_map(1, ((0, 100), one.url))
        controller.put("/kvsp/shardmaps/ctx-1", v1)
        next_shards = shard_map(0, ((0, 50), one.url), ((50, 100), slow.url))["shards"]
        controller.post(
            "/kvsp/shardmaps/ctx-1/reshard", {"shards": next_shards, "deadline_ms": 500}
        )
        wait_until(lambda: ReshardOperation.objects.get().phase == "aborted", "aborted")
        wait_until(lambda: ReshardOperation.objects.get().finished_at is not None, "told", 60)
        assert one.received("POST", "/kvsp/reshard")[-1] == {
            "map": "ctx-1",
            "abort": 2,
            "attempt": 1,
        }
        assert slow.received("POST", "/kvsp/reshard")[-1] == {
            "map": "ctx-1",
            "abort": 2,
            "attempt": 1,
        }
    operation = ReshardOperation.objects.get()
    assert slow.url in operation.reason
    row = ShardMap.objects.get()
    assert (row.version, len(row.shards)) == (1, 1)  # version 1 stayed authoritative


def test_after_an_abort_the_same_reshard_is_tried_again_and_commits(controller, worker):
    """Version 1 stays authoritative after the abort, so the move to 2 may be tried again: the
    same request makes attempt 2, whose plans and decision carry its number."""
    with StandinNode() as one, StandinNode() as slow:
        slow.delays[("POST", "/kvsp/reshard")] = 3.0
        controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), one.url)))
        request = {
            "shards": shard_map(0, ((0, 50), one.url), ((50, 100), slow.url))["shards"],
            "deadline_ms": 500,
        }
        assert controller.post("/kvsp/shardmaps/ctx-1/reshard", request).status_code == 202
        wait_until(lambda: ReshardOperation.objects.get().finished_at is not None, "told", 60)
        assert ReshardOperation.objects.get().phase == "aborted"
        del slow.delays[("POST", "/kvsp/reshard")]

        again = controller.post("/kvsp/shardmaps/ctx-1/reshard", {**request, "deadline_ms": 5000})
        assert again.status_code == 202, again.content
        assert again["Location"].endswith("/kvsp/shardmaps/ctx-1/reshards/2")
        answer = body(again)
        assert (answer["from"], answer["to"], answer["attempt"]) == (1, 2, 2)
        assert {plan["attempt"] for plan in answer["plans"]} == {2}
        second = ReshardOperation.objects.get(attempt=2)
        wait_until(lambda: ReshardOperation.objects.get(pk=second.pk).finished_at, "finished")
        for node in (one, slow):
            received = node.received("POST", "/kvsp/reshard")
            assert {"map": "ctx-1", "abort": 2, "attempt": 1} in received
            assert received[-1] == {"map": "ctx-1", "commit": 2, "attempt": 2}
            # The plans of attempt 1 may not have left before its deadline passed.
            assert [plan["attempt"] for plan in received if "to" in plan][-1] == 2
    status = body(controller.get("/kvsp/shardmaps/ctx-1/reshards/2"))
    assert (status["attempt"], status["state"]) == (2, "committed")
    assert ShardMap.objects.get().version == 2
    phases = ReshardOperation.objects.order_by("attempt").values_list("attempt", "phase")
    assert list(phases) == [(1, "aborted"), (2, "committed")]


def start_split(controller, one, two, *, deadline_ms: int):
    """Map ctx-1 on ``one`` alone, then start its reshard into halves on ``one`` and ``two``,
    without a worker to drive it."""
    controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), one.url)))
    next_shards = shard_map(0, ((0, 50), one.url), ((50, 100), two.url))["shards"]
    return resharding.do_start_reshard("ctx-1", {"shards": next_shards, "deadline_ms": deadline_ms})


def test_a_pc_restart_between_prepare_and_commit_finishes_the_operation(controller):
    with StandinNode() as one, StandinNode() as two:
        # No worker runs: the PC "crashed" after every member acknowledged, before deciding.
        operation = start_split(controller, one, two, deadline_ms=9000)
        ReshardOperation.objects.filter(pk=operation.pk).update(acknowledged=[one.url, two.url])
        assert resharding.drive(operation.pk) == []
        assert ReshardOperation.objects.get().phase == "committed"
        assert ShardMap.objects.get().version == 2
        assert not one.received("POST", "/kvsp/reshard")[:-1]  # no plan sent again
        # Driving it again (a duplicate task) changes nothing and tells nobody twice.
        assert resharding.drive(operation.pk) == []
        assert len(two.received("POST", "/kvsp/reshard")) == 1


def test_a_pc_restart_after_the_deadline_aborts(controller):
    with StandinNode() as one, StandinNode() as two:
        operation = start_split(controller, one, two, deadline_ms=100)
        ReshardOperation.objects.filter(pk=operation.pk).update(
            acknowledged=[one.url], deadline_at=timezone.now() - timedelta(seconds=1)
        )
        resharding.drive(operation.pk)
        assert not two.received("POST", "/kvsp/reshard")[:-1]  # the plan was never re-sent
        assert two.received("POST", "/kvsp/reshard") == [{"map": "ctx-1", "abort": 2, "attempt": 1}]
    assert ReshardOperation.objects.get().phase == "aborted"
    assert ShardMap.objects.get().version == 1


def test_an_operator_abort_while_preparing(controller):
    with StandinNode() as one, StandinNode() as two:
        operation = start_split(controller, one, two, deadline_ms=9000)
        resharding.do_abort_reshard(operation.pk)
        resharding.drive(operation.pk)
        assert two.received("POST", "/kvsp/reshard") == [{"map": "ctx-1", "abort": 2, "attempt": 1}]
    assert ReshardOperation.objects.get().phase == "aborted"


@pytest.mark.django_db
def test_shard_map_rules(controller):
    url = "http://ii1.test/kvsp/"
    v1 = shard_map(1, ((0, 100), url))
    assert controller.put("/kvsp/shardmaps/ctx-1", v1).status_code == 201
    assert controller.put("/kvsp/shardmaps/ctx-1", v1).status_code == 200
    changed = shard_map(1, ((0, 90), url))
    assert problem_name(controller.put("/kvsp/shardmaps/ctx-1", changed)) == "kvsp-conflict"
    gap = shard_map(2, ((0, 50), url), ((60, 100), url))
    assert controller.put("/kvsp/shardmaps/ctx-1", gap).status_code == 422
    assert controller.put("/kvsp/shardmaps/other", v1).status_code == 400
    node = make_caller("node", instance="ii1")
    assert node.put("/kvsp/shardmaps/ctx-1", v1).status_code == 403
    assert controller.get("/kvsp/shardmaps/nope").status_code == 404
    assert body(controller.get("/kvsp/shardmaps/ctx-1"))["version"] == 1
    # Versions are JSON integers up to 2^53 - 1 (kvsp.records), and stored whole.
    last = {**shard_map(2**53 - 1, ((0, 100), url)), "map": "ctx-2"}
    assert controller.put("/kvsp/shardmaps/ctx-2", last).status_code == 201
    assert body(controller.get("/kvsp/shardmaps/ctx-2"))["version"] == 2**53 - 1


@pytest.mark.django_db
def test_reshard_requests_are_validated(controller):
    url = "http://ii1.test/kvsp/"
    controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), url)))
    for request, status in [
        ({"shards": [], "deadline_ms": 100}, 422),
        ({"shards": [{"tokens": [0, 100], "instance": url}]}, 422),
        ({"shards": [{"tokens": [100, 0], "instance": url}], "deadline_ms": 100}, 422),
        ({"shards": "x", "deadline_ms": 100}, 422),
        ([], 400),
    ]:
        response = controller.post("/kvsp/shardmaps/ctx-1/reshard", request)
        assert response.status_code == status, (request, response.content)
    assert not ReshardOperation.objects.exists()
    assert (
        controller.post(
            "/kvsp/shardmaps/none/reshard", {"shards": [], "deadline_ms": 1}
        ).status_code
        == 404
    )


# --- Shard maps with a context: which blocks each plan's ranges are -------------------------


def context(keys, block_tokens=16, **members):
    return {
        "scope_id": "ab" * 16,
        "compat_id": "cd" * 32,
        "block_tokens": block_tokens,
        "block_keys": keys,
        **members,
    }


def test_plans_name_the_blocks_of_their_ranges(controller, worker):
    keys = [random_key() for _ in range(8)]  # 8 blocks of 16 tokens: tokens [0, 128)
    with StandinNode() as one, StandinNode() as two, StandinNode() as three:
        v1 = shard_map(1, ((0, 64), one.url), ((64, 128), two.url))
        v1["context"] = context(keys)
        assert controller.put("/kvsp/shardmaps/ctx-1", v1).status_code == 201
        assert body(controller.get("/kvsp/shardmaps/ctx-1"))["context"] == context(keys)
        next_shards = shard_map(0, ((0, 48), one.url), ((48, 96), three.url), ((96, 128), two.url))[
            "shards"
        ]
        response = controller.post(
            "/kvsp/shardmaps/ctx-1/reshard", {"shards": next_shards, "deadline_ms": 30_000}
        )
        assert response.status_code == 202, response.content
        wait_until(lambda: ReshardOperation.objects.get().finished_at is not None, "finished")
        assert ReshardOperation.objects.get().phase == "committed"
        sent = {
            node.url: next(m for m in node.received("POST", "/kvsp/reshard") if "to" in m)
            for node in (one, two, three)
        }
    identity = {"scope_id": "ab" * 16, "compat_id": "cd" * 32, "block_tokens": 16}
    # one keeps blocks 0-2 and releases block 3; three fetches block 3 from one and blocks 4-5
    # from two; two keeps blocks 6-7 and releases 4-5.
    assert sent[one.url]["retain"] == [[0, 48]] and sent[one.url]["release"] == [[48, 64]]
    assert sent[one.url]["blocks"] == {str(i): keys[i] for i in range(4)}
    assert sent[three.url]["fetch"] == [
        {"tokens": [48, 64], "from": one.url},
        {"tokens": [64, 96], "from": two.url},
    ]
    assert sent[three.url]["blocks"] == {str(i): keys[i] for i in (3, 4, 5)}
    assert sent[two.url]["blocks"] == {str(i): keys[i] for i in (4, 5, 6, 7)}
    for plan in sent.values():
        assert {name: plan[name] for name in identity} == identity
    current = body(controller.get("/kvsp/shardmaps/ctx-1"))
    assert current["version"] == 2 and current["context"] == context(keys)


def test_a_reshard_may_extend_the_context(controller):
    keys = [random_key() for _ in range(6)]
    with StandinNode() as one, StandinNode() as two:
        v1 = shard_map(1, ((0, 64), one.url))
        v1["context"] = context(keys[:4])
        controller.put("/kvsp/shardmaps/ctx-1", v1)
        next_shards = shard_map(0, ((0, 32), one.url), ((32, 96), two.url))["shards"]
        # Past the map's keyed blocks without a longer context: refused.
        refused = controller.post(
            "/kvsp/shardmaps/ctx-1/reshard", {"shards": next_shards, "deadline_ms": 9000}
        )
        assert problem_name(refused) == "kvsp-invalid-record"
        assert "past the 64 tokens" in body(refused)["detail"]
        other = context([random_key()] + keys[1:])
        refused = controller.post(
            "/kvsp/shardmaps/ctx-1/reshard",
            {"shards": next_shards, "deadline_ms": 9000, "context": other},
        )
        assert "must extend the map's context" in body(refused)["detail"]
        assert not ReshardOperation.objects.exists()
        accepted = controller.post(
            "/kvsp/shardmaps/ctx-1/reshard",
            {"shards": next_shards, "deadline_ms": 9000, "context": context(keys)},
        )
        assert accepted.status_code == 202, accepted.content
        plans = {plan["instance"]: plan for plan in body(accepted)["plans"]}
        # Tokens [64, 96) are in no shard of version 1: nobody fetches them, two computes them.
        assert plans[two.url]["fetch"] == [{"tokens": [32, 64], "from": one.url}]
        assert plans[two.url]["blocks"] == {"2": keys[2], "3": keys[3]}
        operation = ReshardOperation.objects.get()
        ReshardOperation.objects.filter(pk=operation.pk).update(acknowledged=[one.url, two.url])
        assert resharding.drive(operation.pk) == []
    assert ShardMap.objects.get().context == context(keys)


@pytest.mark.django_db
def test_a_context_is_validated(controller):
    from index.services import do_register_descriptor
    from kvsp.compat import compat_id_hex
    from tests.placement.conftest import DESCRIPTOR

    url = "http://ii1.test/kvsp/"
    keys = [random_key() for _ in range(4)]
    compat = compat_id_hex(DESCRIPTOR)  # block_tokens 16
    do_register_descriptor(DESCRIPTOR, compat)

    def put(ctx, shards=((0, 64),)):
        document = shard_map(1, *((tokens, url) for tokens in shards))
        document["context"] = ctx
        return controller.put("/kvsp/shardmaps/ctx-1", document)

    for ctx, shards, detail in [
        (context(keys, scope_id="AB" * 16), ((0, 64),), "context.scope_id: must be hex16"),
        (context(keys, compat_id="cd" * 31), ((0, 64),), "context.compat_id: must be hex32"),
        (context(keys, block_tokens=0), ((0, 64),), "context.block_tokens: must be an integer"),
        (context([]), ((0, 64),), "context.block_keys: must be an array of 1 to"),
        (context([*keys[:3], "x"]), ((0, 64),), "context.block_keys[3]: must be hex32"),
        (context(keys), ((0, 40), (40, 64)), "shards[0].tokens: must start and end on a block"),
        (context(keys), ((0, 80),), "shards[0].tokens: ends at token 80, past the 64 tokens"),
        (
            context(keys, block_tokens=8, compat_id=compat),
            ((0, 32),),
            "context.block_tokens: is 8; the registered descriptor of compat_id says 16",
        ),
        ("ctx", ((0, 64),), "context: must be an object"),
    ]:
        response = put(ctx, shards)
        assert problem_name(response) == "kvsp-invalid-record", (ctx, response.content)
        assert body(response)["detail"].startswith(detail), body(response)["detail"]
    assert not ShardMap.objects.exists()
    assert put(context(keys, compat_id=compat)).status_code == 201
    assert put(context(keys, compat_id=compat)).status_code == 200  # the same document again
    assert problem_name(put(context(keys[:3] + keys[:1], compat_id=compat))) == "kvsp-conflict"
    assert problem_name(put(None)) == "kvsp-conflict"  # the context is part of the document
    refused = controller.post(
        "/kvsp/shardmaps/ctx-1/reshard",
        {"shards": [{"tokens": [0, 24], "instance": url}], "deadline_ms": 100},
    )
    assert "shards[0].tokens: must start and end on a block boundary" in body(refused)["detail"]


def test_a_map_of_another_scope_answers_exactly_like_a_missing_one(controller):
    """A map's context names its scope's Block Keys and the instances that hold them: a
    principal that may not read the scope is answered, for the map and its reshards, byte for
    byte what it is answered once the map is gone; a principal of the scope reads both."""
    tenant, other = make_scope("tenant-a"), make_scope("tenant-b")
    member = make_caller("member", scopes=[tenant])
    outsider = make_caller("outsider", scopes=[other])
    url = "http://ii1.test/kvsp/"
    keys = [random_key() for _ in range(4)]
    document = shard_map(1, ((0, 64), url))
    document["context"] = context(keys, scope_id=tenant.scope_id_hex)
    assert controller.put("/kvsp/shardmaps/ctx-1", document).status_code == 201
    move = {"shards": [{"tokens": [0, 64], "instance": url}], "deadline_ms": 60_000}
    assert controller.post("/kvsp/shardmaps/ctx-1/reshard", move).status_code == 202

    assert body(member.get("/kvsp/shardmaps/ctx-1"))["context"]["block_keys"] == keys
    assert body(member.get("/kvsp/shardmaps/ctx-1/reshards/2"))["plans"][0]["blocks"]

    def ask(caller):
        return [
            caller.get("/kvsp/shardmaps/ctx-1"),
            caller.get("/kvsp/shardmaps/ctx-1/reshards/2"),
            caller.put("/kvsp/shardmaps/ctx-1", document),
            caller.post("/kvsp/shardmaps/ctx-1/reshard", move),
        ]

    hidden = ask(outsider)
    assert [r.status_code for r in hidden] == [404, 404, 403, 403]
    assert [problem_name(r) for r in hidden[:2]] == ["kvsp-not-found"] * 2
    assert keys[0].encode() not in b"".join(r.content for r in hidden)
    # Changing a map is the Placement Controller's alone, even for a principal of its scope.
    assert [r.status_code for r in ask(member)[2:]] == [403, 403]
    assert ReshardOperation.objects.count() == 1

    ShardMap.objects.all().delete()
    absent = ask(outsider)
    assert [(r.status_code, r.content) for r in hidden] == [
        (r.status_code, r.content) for r in absent
    ]
    assert [r["Content-Type"] for r in hidden] == [r["Content-Type"] for r in absent]


def test_a_map_without_a_context_names_no_scope_and_is_read_by_any_principal(controller):
    url = "http://ii1.test/kvsp/"
    assert controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), url))).status_code == 201
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    assert body(outsider.get("/kvsp/shardmaps/ctx-1"))["shards"][0]["instance"] == url
