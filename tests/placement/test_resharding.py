"""Resharding as a two-phase commit (spec 6.9), driven by the PC against instances on loopback."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from placement import resharding
from placement.models import ReshardOperation, ShardMap
from tests.support.fixtures import body, make_caller, problem_name
from tests.support.standin import StandinNode

pytestmark = pytest.mark.django_db(transaction=True)


def wait_until(predicate, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


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
            assert received[0]["to"] == 5 and received[0]["instance"] == node.url
            assert received[-1] == {"map": "ctx-1", "commit": 5}
    operation = ReshardOperation.objects.get()
    assert operation.phase == "committed"
    assert sorted(operation.acknowledged) == sorted([one.url, two.url, three.url])
    current = body(controller.get("/kvsp/shardmaps/ctx-1"))
    assert current["version"] == 5 and len(current["shards"]) == 3
    status = body(controller.get("/kvsp/shardmaps/ctx-1/reshards/5"))
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
        assert one.received("POST", "/kvsp/reshard")[-1] == {"map": "ctx-1", "abort": 2}
        assert slow.received("POST", "/kvsp/reshard")[-1] == {"map": "ctx-1", "abort": 2}
    operation = ReshardOperation.objects.get()
    assert slow.url in operation.reason
    row = ShardMap.objects.get()
    assert (row.version, len(row.shards)) == (1, 1)  # version 1 stayed authoritative


def test_a_pc_restart_between_prepare_and_commit_finishes_the_operation(controller):
    with StandinNode() as one, StandinNode() as two:
        controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), one.url)))
        next_shards = shard_map(0, ((0, 50), one.url), ((50, 100), two.url))["shards"]
        # No worker runs: the PC "crashed" after every member acknowledged, before deciding.
        operation = resharding.do_start_reshard(
            "ctx-1", {"shards": next_shards, "deadline_ms": 9000}
        )
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
        controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), one.url)))
        next_shards = shard_map(0, ((0, 50), one.url), ((50, 100), two.url))["shards"]
        operation = resharding.do_start_reshard(
            "ctx-1", {"shards": next_shards, "deadline_ms": 100}
        )
        ReshardOperation.objects.filter(pk=operation.pk).update(
            acknowledged=[one.url], deadline_at=timezone.now() - timedelta(seconds=1)
        )
        resharding.drive(operation.pk)
        assert not two.received("POST", "/kvsp/reshard")[:-1]  # the plan was never re-sent
        assert two.received("POST", "/kvsp/reshard") == [{"map": "ctx-1", "abort": 2}]
    assert ReshardOperation.objects.get().phase == "aborted"
    assert ShardMap.objects.get().version == 1


def test_an_operator_abort_while_preparing(controller):
    with StandinNode() as one, StandinNode() as two:
        controller.put("/kvsp/shardmaps/ctx-1", shard_map(1, ((0, 100), one.url)))
        next_shards = shard_map(0, ((0, 50), one.url), ((50, 100), two.url))["shards"]
        operation = resharding.do_start_reshard(
            "ctx-1", {"shards": next_shards, "deadline_ms": 9000}
        )
        resharding.do_abort_reshard(operation.pk)
        resharding.drive(operation.pk)
        assert two.received("POST", "/kvsp/reshard") == [{"map": "ctx-1", "abort": 2}]
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
