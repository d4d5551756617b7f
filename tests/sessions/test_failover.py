"""Failover (6.8): the PC raises the epoch, resumes elsewhere, and the old epoch is refused."""

import uuid
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from placement.models import Instance
from placement.services import do_mark_expired
from sessions.models import Session
from sessions.services import do_fail_over_instance_sessions, do_fail_over_session
from tests.placement.conftest import HOLDER
from tests.sessions.test_checkpoints_and_output import checkpoint
from tests.support.fixtures import (
    body,
    make_caller,
    make_instance,
    problem_name,
    report,
    status_record,
)
from tests.support.processes import Redis
from tests.support.standin import StandinNode
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LINKS = [{"holder": HOLDER, "mbit_per_s": 100_000, "rtt_us": 10}]


@pytest.fixture
def worker(role_env, start_process):
    controller = make_caller("pc", controller=True)
    env = role_env(KVSP_TOKEN=controller.token)
    return start_process("worker", "control-worker", env, queues=["control"])


def up(node, name, scope, **figures):
    caller = make_instance(name, node.url, scopes=[scope])
    assert report(caller, name, status_record(node.url, links=LINKS, **figures)).status_code == 200
    return caller


def test_a_failed_instances_session_resumes_elsewhere_under_a_new_epoch(cluster, worker):
    cluster.publish(4)
    session = str(uuid.uuid4())
    with StandinNode() as a, StandinNode() as b:
        caller_a = up(a, "a", cluster.scope, ttl_ms=1000)
        up(b, "b", cluster.scope, ttl_ms=60_000)
        document = checkpoint(cluster, session, offset=3)
        assert caller_a.put(f"/kvsp/sessions/{session}/checkpoint", document).status_code == 201
        caller_a.post(
            f"/kvsp/sessions/{session}/output",
            [{"epoch": 1, "index": i, "token": t} for i, t in enumerate(document["generated"])],
        )

        assert do_mark_expired(now=timezone.now() + timedelta(seconds=2))
        (resume,) = b.wait_for("POST", f"/kvsp/sessions/{session}/resume")
        wait_until(lambda: Session.objects.get().resume_sent_at is not None, "resume sent")

        # The paused instance wakes up and keeps going: everything it says is refused.
        zombie = checkpoint(cluster, session, offset=5)
        stale = caller_a.put(f"/kvsp/sessions/{session}/checkpoint", zombie)
        assert problem_name(stale) == "kvsp-stale-epoch"
        late = caller_a.post(
            f"/kvsp/sessions/{session}/output", {"epoch": 1, "index": 3, "token": 1}
        )
        assert problem_name(late) == "kvsp-stale-epoch"
        assert report(caller_a, "a", status_record(a.url, ttl_ms=1000)).status_code == 409
        assert not a.received("POST", f"/kvsp/sessions/{session}/resume")

    assert resume["epoch"] == 2
    assert resume["checkpoint"]["output_offset"] == 3
    assert resume["checkpoint"]["session"] == session
    assert [block["block_key"] for block in resume["blocks"]] == cluster.keys
    assert all(block["sources"] == [HOLDER] for block in resume["blocks"])
    row = Session.objects.get()
    assert (row.epoch, row.instance.name, row.failovers, row.state) == (2, "b", 1, "resuming")

    # The new instance checkpoints under the new epoch and delivers from output_offset on.
    caller_b = make_caller("node-b-2", scopes=[cluster.scope], instance="b")
    resumed = checkpoint(cluster, session, epoch=2, offset=4)
    assert caller_b.put(f"/kvsp/sessions/{session}/checkpoint", resumed).status_code == 200
    answer = caller_b.post(
        f"/kvsp/sessions/{session}/output",
        [
            {"epoch": 2, "index": 2, "token": 999},  # regenerated duplicate: dropped
            {"epoch": 2, "index": 3, "token": 503, "final": True},
        ],
    )
    assert (body(answer)["stored"], body(answer)["duplicates"]) == ([3], [2])
    row.refresh_from_db()
    assert (row.state, row.delivered, row.checkpoint_epoch) == ("completed", 4, 2)
    assert row.resumed_first_token_at is not None


def test_a_refused_resume_moves_on_to_another_instance(cluster, worker):
    cluster.publish(4)
    session = str(uuid.uuid4())
    with StandinNode() as a, StandinNode() as b, StandinNode() as c:
        caller_a = up(a, "a", cluster.scope, ttl_ms=1000)
        up(b, "b", cluster.scope, ttl_ms=60_000)  # cheapest: idle
        up(c, "c", cluster.scope, ttl_ms=60_000, queued=2)
        b.answers[("POST", "/kvsp/sessions/")] = (
            409,
            {"type": "https://kvsp.dev/problems/kvsp-invalid-state", "detail": "draining"},
        )
        caller_a.put(f"/kvsp/sessions/{session}/checkpoint", checkpoint(cluster, session))
        do_mark_expired(now=timezone.now() + timedelta(seconds=2))
        b.wait_for("POST", f"/kvsp/sessions/{session}/resume")
        (resume,) = c.wait_for("POST", f"/kvsp/sessions/{session}/resume")
        wait_until(lambda: Session.objects.get().resume_sent_at is not None, "resume sent")
    assert resume["epoch"] == 3  # one epoch per attempt: b never served under 2
    row = Session.objects.get()
    assert (row.instance.name, row.epoch, row.failovers) == ("c", 3, 2)


def test_a_session_never_resumes_on_a_holder_without_an_engine(cluster, worker):
    """The holder would be the cheapest by far: it holds every block of the session, is idle
    and says it serves the session's compat id; but it has no engine to run the session."""
    session = str(uuid.uuid4())
    with StandinNode() as a, StandinNode() as holder, StandinNode() as c:
        caller_a = up(a, "a", cluster.scope, ttl_ms=1000)
        caller_holder = up(
            holder,
            "holder",
            cluster.scope,
            ttl_ms=60_000,
            engine=False,
            compat_ids=[cluster.compat],
            prefill_tokens_per_s=10**9,
        )
        cluster.publish(4, holder=holder.url, caller=caller_holder)
        up(c, "c", cluster.scope, ttl_ms=60_000, queued=2)
        caller_a.put(f"/kvsp/sessions/{session}/checkpoint", checkpoint(cluster, session))
        do_mark_expired(now=timezone.now() + timedelta(seconds=2))
        (resume,) = c.wait_for("POST", f"/kvsp/sessions/{session}/resume")
        wait_until(lambda: Session.objects.get().resume_sent_at is not None, "resume sent")
        assert not holder.received("POST", f"/kvsp/sessions/{session}/resume")
    assert resume["epoch"] == 2
    row = Session.objects.get()
    assert (row.instance.name, row.epoch, row.failovers) == ("c", 2, 1)


def test_with_nowhere_to_go_the_session_waits_with_its_new_epoch(cluster, worker):
    session = str(uuid.uuid4())
    with StandinNode() as a:
        caller_a = up(a, "a", cluster.scope, ttl_ms=1000)
        caller_a.put(f"/kvsp/sessions/{session}/checkpoint", checkpoint(cluster, session))
        do_mark_expired(now=timezone.now() + timedelta(seconds=2))
    row = Session.objects.get()
    assert (row.state, row.epoch, row.instance) == ("resuming", 2, None)
    with StandinNode() as b:
        up(b, "b", cluster.scope, ttl_ms=60_000)
        from sessions.tasks import retry_stalled

        assert retry_stalled() == 1
        (resume,) = b.wait_for("POST", f"/kvsp/sessions/{session}/resume")
    assert resume["epoch"] == 2


def test_a_session_left_on_a_failed_instance_is_moved_by_the_sweep(cluster, worker):
    """The process that failed instance a died before it moved a's sessions: the sweep finds
    the session still with a failed instance and resumes it elsewhere."""
    from sessions.tasks import retry_stalled

    cluster.publish(4)
    session = str(uuid.uuid4())
    with StandinNode() as a, StandinNode() as b:
        caller_a = up(a, "a", cluster.scope, ttl_ms=60_000)
        up(b, "b", cluster.scope, ttl_ms=60_000)
        caller_a.put(f"/kvsp/sessions/{session}/checkpoint", checkpoint(cluster, session))
        Instance.objects.filter(name="a").update(state="failed", failed_at=timezone.now())
        assert retry_stalled() == 1
        (resume,) = b.wait_for("POST", f"/kvsp/sessions/{session}/resume")
        wait_until(lambda: Session.objects.get().resume_sent_at is not None, "accepted")
    assert resume["epoch"] == 2
    row = Session.objects.get()
    assert (row.instance.name, row.epoch, row.failovers) == ("b", 2, 1)


def test_only_a_session_under_way_fails_over_and_one_without_a_checkpoint_fails():
    instance = Instance.objects.create(name="a", url="http://a.test/kvsp/")
    rows = {
        state: Session.objects.create(
            session=uuid.uuid4(),
            scope_id=bytes(16),
            compat_id=bytes(32),
            instance=instance,
            epoch=1,
            state=state,
        )
        for state in ("running", "resuming", "completed", "failed")
    }
    # Nothing to resume from: the sessions under way fail, and none moves.
    assert do_fail_over_instance_sessions(instance.pk) == []
    states = {state: Session.objects.get(pk=row.pk).state for state, row in rows.items()}
    assert states == {
        "running": "failed",
        "resuming": "failed",
        "completed": "completed",
        "failed": "failed",
    }
    # A session that ended is not failed over (SESSION_STATES): its epoch stays.
    for row in rows.values():
        assert not do_fail_over_session(row.pk, failed_instance_id=instance.pk)
    assert set(Session.objects.values_list("epoch", "failovers")) == {(1, 0)}


@pytest.fixture
def broker(log_dir):
    """A broker of this test's own, to lose and bring back."""
    redis = Redis("redis", log_dir).start()
    yield redis
    redis.stop()


def test_a_resume_lost_with_the_broker_is_sent_by_the_sweep(
    cluster, role_env, start_process, broker
):
    """The broker is down when a restart of instance a fails its session over to b, and b
    cannot take the resume yet (503): the resume goes to b at once all the same (it needs no
    queue), the report is still answered, the resume stays owed on the session's row, and once
    the broker is back (empty) the sweep sends it again; b accepts it and the session goes on
    to its end."""
    cluster.publish(4)
    session = str(uuid.uuid4())
    controller = make_caller("pc", controller=True)
    env = role_env(
        KVSP_TOKEN=controller.token, CELERY_BROKER_URL=broker.url, KVSP_RESUME_RESEND_S="1"
    )
    server = start_process("server", "control", env, workers=1)
    start_process("worker", "control-worker", env, queues=["control"])
    start_process("beat", "beat", env)
    with StandinNode() as a, StandinNode() as b:
        caller_a = up(a, "a", cluster.scope, ttl_ms=60_000)
        up(b, "b", cluster.scope, ttl_ms=60_000)
        assert (
            caller_a.put(
                f"/kvsp/sessions/{session}/checkpoint", checkpoint(cluster, session, offset=3)
            ).status_code
            == 201
        )

        broker.stop()
        unavailable = {"type": "about:blank", "title": "Service Unavailable", "status": 503}
        b.answers[("POST", "/kvsp/sessions/")] = (503, unavailable)
        restarted = httpx.put(
            f"{server.url}/kvsp/instances/a/status",
            json=status_record(a.url, epoch=2, links=LINKS, ttl_ms=60_000),
            headers={"Authorization": f"Bearer {caller_a.token}"},
            timeout=60,
        )
        assert restarted.status_code == 200, restarted.text
        row = Session.objects.get()
        assert (row.state, row.instance.name, row.epoch) == ("resuming", "b", 2)
        b.wait_for("POST", f"/kvsp/sessions/{session}/resume", timeout=30)
        wait_until(lambda: Session.objects.get().resume_attempts == 1, "the attempt counted", 30)
        assert Session.objects.get().resume_sent_at is None

        del b.answers[("POST", "/kvsp/sessions/")]
        broker.start()
        resume = b.wait_for("POST", f"/kvsp/sessions/{session}/resume", count=2, timeout=90)[-1]
        wait_until(lambda: Session.objects.get().resume_sent_at is not None, "accepted", 30)
    assert resume["epoch"] == 2 and resume["checkpoint"]["output_offset"] == 3
    assert [block["block_key"] for block in resume["blocks"]] == cluster.keys

    caller_b = make_caller("node-b-2", scopes=[cluster.scope], instance="b")
    resumed = checkpoint(cluster, session, epoch=2, offset=4)
    assert caller_b.put(f"/kvsp/sessions/{session}/checkpoint", resumed).status_code == 200
    tokens = [{"epoch": 2, "index": i, "token": 500 + i} for i in range(4)]
    tokens[-1]["final"] = True
    assert caller_b.post(f"/kvsp/sessions/{session}/output", tokens).status_code == 200
    assert Session.objects.get().state == "completed"


def test_placement_starts_the_failover_task_by_its_name():
    """Placement may not import sessions (DESIGN.md section 2): it names the task."""
    from placement.services import FAIL_OVER_INSTANCE_SESSIONS
    from sessions.tasks import fail_over_instance

    assert fail_over_instance.name == FAIL_OVER_INSTANCE_SESSIONS
