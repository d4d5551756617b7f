"""Checkpoints (6.8) and the front end's output stream: epochs, offsets, each index once."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from kvsp.records import DeliveredOutput, SessionAnswer
from sessions.models import OutputToken, Session
from tests.support.answers import assert_answers_as
from tests.support.fixtures import body, make_instance, problem_name, report, status_record

pytestmark = pytest.mark.django_db


def checkpoint(cluster, session, *, epoch=1, offset=0, generated=None, deterministic=True):
    generated = generated if generated is not None else list(range(500, 500 + offset))
    return {
        "session": session,
        "epoch": epoch,
        "compat_id": cluster.compat,
        "scope_id": cluster.scope.scope_id_hex,
        "prompt_blocks": cluster.keys,
        "prompt_tail": cluster.tokens[len(cluster.keys) * 16 :],
        "generated": generated,
        "output_offset": offset,
        "sampler": (
            {"method": "greedy", "params": {}, "seed": 0, "step": offset, "deterministic": True}
            if deterministic
            else {
                "method": "top-p",
                "params": {"p": 0.9},
                "seed": 7,
                "step": offset,
                "deterministic": False,
            }
        ),
    }


@pytest.fixture
def node(cluster):
    caller = make_instance("ii1", scopes=[cluster.scope])
    report(caller, "ii1", status_record("http://ii1.test/kvsp/"))
    return caller


@pytest.fixture
def session_id():
    return str(uuid.uuid4())


def put(caller, session, document):
    return caller.put(f"/kvsp/sessions/{session}/checkpoint", document)


def test_first_checkpoint_creates_the_session(cluster, node, session_id):
    response = put(node, session_id, checkpoint(cluster, session_id, offset=3))
    assert response.status_code == 201
    assert body(response) == {"session": session_id, "epoch": 1, "output_offset": 3}
    session = Session.objects.get()
    assert (session.instance.name, session.epoch, session.state) == ("ii1", 1, "running")


def test_the_highest_offset_of_the_epoch_is_kept(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id, offset=10))
    older = put(node, session_id, checkpoint(cluster, session_id, offset=4))
    assert older.status_code == 200
    assert body(older)["output_offset"] == 10
    assert Session.objects.get().checkpoint["output_offset"] == 10
    newer = put(node, session_id, checkpoint(cluster, session_id, offset=16))
    assert body(newer)["output_offset"] == 16


def test_a_first_checkpoint_must_carry_the_first_epoch(cluster, node, session_id):
    response = put(node, session_id, checkpoint(cluster, session_id, epoch=3))
    assert response.status_code == 409
    assert not Session.objects.exists()


def test_lower_epochs_are_stale_and_higher_ones_unissued(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id, offset=2))
    Session.objects.update(epoch=2)
    stale = put(node, session_id, checkpoint(cluster, session_id, epoch=1, offset=9))
    assert stale.status_code == 409
    assert problem_name(stale) == "kvsp-stale-epoch"
    unissued = put(node, session_id, checkpoint(cluster, session_id, epoch=3, offset=9))
    assert problem_name(unissued) == "kvsp-invalid-state"
    assert Session.objects.get().checkpoint_offset == 2


def test_only_the_serving_instance_checkpoints(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id, offset=2))
    other = make_instance("ii2", scopes=[cluster.scope])
    response = put(other, session_id, checkpoint(cluster, session_id, offset=5))
    assert response.status_code == 403
    assert Session.objects.get().checkpoint_offset == 2


def test_checkpoints_need_the_scope(cluster, session_id):
    outsider = make_instance("ii9")
    response = put(outsider, session_id, checkpoint(cluster, session_id))
    assert response.status_code == 403
    assert not Session.objects.exists()


@pytest.mark.parametrize(
    "change",
    [
        {"output_offset": 99},
        {"sampler": {"method": "greedy"}},
        {"prompt_blocks": ["xyz"]},
        {"session": "not-a-uuid"},
    ],
)
def test_invalid_checkpoints_are_refused(cluster, node, session_id, change):
    response = put(node, session_id, {**checkpoint(cluster, session_id, offset=2), **change})
    assert response.status_code in (400, 422)
    assert not Session.objects.exists()


def test_path_and_body_must_agree(cluster, node, session_id):
    response = put(node, str(uuid.uuid4()), checkpoint(cluster, session_id))
    assert response.status_code == 400


# --- output ------------------------------------------------------------------------------------


def post(caller, session, tokens):
    return caller.post(f"/kvsp/sessions/{session}/output", tokens)


def test_each_index_is_delivered_once(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id))
    first = post(node, session_id, [{"epoch": 1, "index": i, "token": 40 + i} for i in range(3)])
    assert body(first)["stored"] == [0, 1, 2]
    # A resumed deterministic instance regenerates 1 and 2: the front end drops the repeats
    # and keeps what it delivered first.
    again = post(node, session_id, [{"epoch": 1, "index": i, "token": 99} for i in (1, 2, 3)])
    assert (body(again)["stored"], body(again)["duplicates"]) == ([3], [1, 2])
    output = body(node.get(f"/kvsp/sessions/{session_id}/output"))
    assert_answers_as(DeliveredOutput, output)
    tokens = output["tokens"]
    assert [(t["index"], t["token"]) for t in tokens] == [(0, 40), (1, 41), (2, 42), (3, 99)]


def test_a_malformed_post_names_the_token_and_the_rule(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id))
    for tokens, detail in [
        ([], "post 1 to 4096 output tokens"),
        ({"epoch": 1, "index": 0}, "[0].token: required member is missing"),
        ({"epoch": 1, "index": 0, "token": -1}, "[0].token: must be an integer from 0 to"),
        (
            [{"epoch": 1, "index": 0, "token": 5}, {"epoch": 1, "index": 1.5, "token": 5}],
            "[1].index:",
        ),
        ({"epoch": 1, "index": 0, "token": 5, "final": "yes"}, "[0].final: must be true or false"),
    ]:
        refused = post(node, session_id, tokens)
        assert refused.status_code == 400 and problem_name(refused) == "kvsp-malformed-request"
        assert body(refused)["detail"].startswith(detail), body(refused)
    assert not OutputToken.objects.exists()
    # A null "final" counts as absent.
    taken = post(node, session_id, {"epoch": 1, "index": 0, "token": 5, "final": None})
    assert body(taken)["stored"] == [0]
    assert Session.objects.get().final_length is None


def test_tokens_of_a_lower_epoch_are_refused(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id))
    Session.objects.update(epoch=2)
    response = post(node, session_id, {"epoch": 1, "index": 0, "token": 5})
    assert problem_name(response) == "kvsp-stale-epoch"
    assert not OutputToken.objects.exists()


def test_a_nondeterministic_sampler_releases_only_checkpointed_tokens(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id, offset=2, deterministic=False))
    early = post(node, session_id, [{"epoch": 1, "index": i, "token": 7} for i in range(3)])
    assert early.status_code == 409
    assert not OutputToken.objects.exists()
    covered = post(node, session_id, [{"epoch": 1, "index": i, "token": 7} for i in range(2)])
    assert body(covered)["stored"] == [0, 1]


def test_tokens_sent_with_their_checkpoint_are_taken_after_it(cluster, node, session_id):
    document = checkpoint(cluster, session_id, offset=2, deterministic=False)
    tokens = [{"epoch": 1, "index": i, "token": 7 + i} for i in range(2)]
    response = put(node, session_id, {**document, "output": tokens})
    assert response.status_code == 201
    assert body(response) == {
        "session": session_id,
        "epoch": 1,
        "output_offset": 2,
        "output": {
            "session": session_id,
            "epoch": 1,
            "stored": [0, 1],
            "duplicates": [],
            "delivered": 2,
        },
    }
    stored = OutputToken.objects.order_by("index").values_list("index", "token")
    assert list(stored) == [(0, 7), (1, 8)]


def test_a_checkpoint_whose_tokens_are_refused_is_not_kept_either(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id, offset=2, deterministic=False))
    document = checkpoint(cluster, session_id, offset=4, deterministic=False)
    # Index 4 is beyond what the checkpoint covers: the post alone would be refused.
    tokens = [{"epoch": 1, "index": i, "token": 7} for i in range(5)]
    response = put(node, session_id, {**document, "output": tokens})
    assert response.status_code == 409
    assert problem_name(response) == "kvsp-conflict"
    assert Session.objects.get().checkpoint_offset == 2
    assert not OutputToken.objects.exists()
    malformed = put(node, session_id, {**document, "output": [{"index": 2}]})
    assert malformed.status_code == 400
    assert Session.objects.get().checkpoint_offset == 2


def test_the_final_token_completes_the_session(cluster, node, session_id):
    put(node, session_id, checkpoint(cluster, session_id))
    post(node, session_id, [{"epoch": 1, "index": 1, "token": 2, "final": True}])
    assert Session.objects.get().state == "running"  # index 0 is still missing
    post(node, session_id, {"epoch": 1, "index": 0, "token": 1})
    assert Session.objects.get().state == "completed"
    assert body(node.get(f"/kvsp/sessions/{session_id}/output"))["complete"] is True


def test_a_completed_session_takes_tokens_again_and_a_failed_one_takes_none(
    cluster, node, session_id
):
    final = {"epoch": 1, "index": 0, "token": 1, "final": True}
    put(node, session_id, checkpoint(cluster, session_id))
    post(node, session_id, final)
    again = post(node, session_id, final)
    assert (again.status_code, body(again)["duplicates"]) == (200, [0])
    assert Session.objects.get().state == "completed"
    # Nothing leads out of failed: the token that would complete the session is refused, and
    # nothing of its post is kept.
    failed = str(uuid.uuid4())
    put(node, failed, checkpoint(cluster, failed))
    Session.objects.filter(session=failed).update(state="failed")
    refused = post(node, failed, final)
    assert (refused.status_code, problem_name(refused)) == (409, "kvsp-invalid-state")
    assert Session.objects.get(session=failed).state == "failed"
    assert not OutputToken.objects.filter(session__session=failed).exists()


@pytest.mark.parametrize(
    "tokens",
    [[], {"epoch": 1, "index": -1, "token": 1}, {"epoch": 1, "index": 0}, ["x"], "tokens"],
)
def test_malformed_output_is_refused(cluster, node, session_id, tokens):
    put(node, session_id, checkpoint(cluster, session_id))
    assert post(node, session_id, tokens).status_code == 400


def test_sessions_of_another_scope_look_missing(cluster, node, session_id):
    from tests.support.fixtures import make_caller, make_scope

    put(node, session_id, checkpoint(cluster, session_id))
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    hidden = outsider.get(f"/kvsp/sessions/{session_id}")
    absent = outsider.get(f"/kvsp/sessions/{uuid.uuid4()}")
    assert hidden.status_code == absent.status_code == 404
    seen = body(cluster.router.get(f"/kvsp/sessions/{session_id}"))
    assert_answers_as(SessionAnswer, seen)
    assert seen["epoch"] == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_checkpoints_never_regress(cluster, role_env, start_process, session_id):
    node = make_instance("ii1", scopes=[cluster.scope])
    server = start_process("server", "control", role_env(), workers=2)
    headers = {"Authorization": f"Bearer {node.token}"}
    url = f"{server.url}/kvsp/sessions/{session_id}/checkpoint"
    assert httpx.put(url, json=checkpoint(cluster, session_id), headers=headers).status_code == 201

    def send(offset):
        document = checkpoint(cluster, session_id, offset=offset)
        return httpx.put(url, json=document, headers=headers, timeout=30).json()["output_offset"]

    acknowledged = []
    with ThreadPoolExecutor(max_workers=12) as pool:
        acknowledged = list(pool.map(send, [o for o in range(1, 65)]))
    assert Session.objects.get().checkpoint_offset == 64
    assert Session.objects.get().checkpoint["output_offset"] == 64
    # Every acknowledgement covers at least the offset that request carried.
    assert all(ack >= offset for ack, offset in zip(acknowledged, range(1, 65), strict=True))


@pytest.mark.django_db(transaction=True)
def test_output_streams_as_server_sent_events(cluster, role_env, start_process, session_id):
    node = make_instance("ii1", scopes=[cluster.scope])
    server = start_process("server", "control", role_env(), workers=1)
    headers = {"Authorization": f"Bearer {node.token}"}
    base = f"{server.url}/kvsp/sessions/{session_id}"
    httpx.put(f"{base}/checkpoint", json=checkpoint(cluster, session_id), headers=headers)
    httpx.post(f"{base}/output", json={"epoch": 1, "index": 0, "token": 11}, headers=headers)
    events = []
    with httpx.stream(
        "GET",
        f"{base}/output",
        headers={**headers, "Accept": "text/event-stream"},
        timeout=30,
    ) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
                if len(events) == 1:
                    later = [
                        {"epoch": 1, "index": 1, "token": 12},
                        {"epoch": 1, "index": 2, "token": 13, "final": True},
                    ]
                    httpx.post(f"{base}/output", json=later, headers=headers)
                if events[-1] == {}:
                    break
    assert events == [
        {"index": 0, "token": 11, "epoch": 1},
        {"index": 1, "token": 12, "epoch": 1},
        {"index": 2, "token": 13, "epoch": 1},
        {},
    ]
