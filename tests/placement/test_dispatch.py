"""What the PC sends to instances, over real HTTP and a real Celery worker: prefetch directives
(6.5), state changes (6.3), the wake path (6.4), and failure detection by Celery beat.
"""

import httpx
import pytest
from django.utils import timezone

from placement.models import Directive, DirectiveState, Instance
from tests.placement.conftest import HOLDER
from tests.support.fixtures import body, make_caller, make_instance, report, status_record
from tests.support.standin import StandinNode
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def controller_env(role_env):
    controller = make_caller("pc", controller=True)
    return role_env(KVSP_TOKEN=controller.token, KVSP_DIRECTIVE_POLL_S="0.05"), controller


def node_at(standin, name, scope, **figures):
    caller = make_instance(name, standin.url, scopes=[scope])
    links = [{"holder": HOLDER, "mbit_per_s": 100_000, "rtt_us": 10}]
    answer = report(caller, name, status_record(standin.url, links=links, **figures))
    assert answer.status_code == 200
    return caller


def test_directive_is_sent_to_the_chosen_instance_and_followed(
    cluster, controller_env, start_process
):
    env, _ = controller_env
    start_process("worker", "control-worker", env, queues=["control"])
    cluster.publish(4)
    with StandinNode() as node:
        node_at(node, "ii1", cluster.scope)
        answer = body(cluster.place(request_ref="router-req-77"))
        assert answer["directive"].startswith(node.url + "prefetch/")
        (sent,) = node.wait_for("POST", "/kvsp/prefetch")
        wait_until(
            lambda: Directive.objects.get().state == DirectiveState.COMPLETE, "directive complete"
        )
    directive = Directive.objects.get()
    assert answer["directive"].endswith(str(directive.directive))
    assert sent["directive"] == str(directive.directive)
    assert sent["request_ref"] == "router-req-77"
    assert [b["block_key"] for b in sent["blocks"]] == cluster.keys
    assert sent["layer_order"] == "ascending" and sent["deadline_ms"] > 0 and sent["lease_ms"] > 0
    assert directive.loaded == cluster.keys
    assert directive.status_url == f"{node.url}prefetch/{directive.directive}"


@pytest.fixture
def controller_server(cluster, controller_env, start_process):
    """The control plane as its own process, with no Celery worker; 4 blocks published."""
    env, _ = controller_env
    cluster.publish(4)
    return start_process("server", "control", env, workers=1)


def place_over_http(server, cluster) -> dict:
    document = {
        "scope_id": cluster.scope.scope_id_hex,
        "compat_id": cluster.compat,
        "tokens": cluster.tokens,
        "request_ref": "router-req-1",
    }
    headers = {"Authorization": f"Bearer {cluster.router.token}"}
    response = httpx.post(
        f"{server.url}/kvsp/placements", json=document, headers=headers, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_the_controller_sends_a_directive_itself_with_no_worker_running(cluster, controller_server):
    with StandinNode() as node:
        node_at(node, "ii1", cluster.scope)
        answer = place_over_http(controller_server, cluster)
        (sent,) = node.wait_for("POST", "/kvsp/prefetch")
        wait_until(lambda: Directive.objects.get().sent_at is not None, "directive sent")
    directive = Directive.objects.get()
    assert answer["directive"] == f"{node.url}prefetch/{directive.directive}"
    assert sent["directive"] == str(directive.directive)
    assert [b["block_key"] for b in sent["blocks"]] == cluster.keys
    assert directive.status_url == f"{node.url}prefetch/{directive.directive}"


def test_a_directive_for_an_instance_that_is_down_is_delivered_once_it_is_back(
    cluster, controller_env, controller_server, start_process
):
    env, _ = controller_env
    with StandinNode() as gone:
        # Its status outlives the wait (beat fails an instance whose record expires).
        node_at(gone, "ii1", cluster.scope, ttl_ms=600_000)
        url, port = gone.url, gone.port
    answer = place_over_http(controller_server, cluster)  # nobody listens at the instance's URL
    assert answer["directive"].startswith(url)
    wait_until(lambda: "not delivered at once" in controller_server.log(), "the attempt failed")
    assert Directive.objects.get().sent_at is None
    with StandinNode(port=port) as node:
        start_process("worker", "control-worker", env, queues=["control"])
        start_process("beat", "beat", env)
        (sent,) = node.wait_for("POST", "/kvsp/prefetch", timeout=60)
        wait_until(
            lambda: Directive.objects.get().state == DirectiveState.COMPLETE, "directive complete"
        )
    assert sent["directive"] == str(Directive.objects.get().directive)
    assert [b["block_key"] for b in sent["blocks"]] == cluster.keys


def test_a_refused_directive_is_recorded_as_failed(cluster, controller_env, start_process):
    env, _ = controller_env
    start_process("worker", "control-worker", env, queues=["control"])
    cluster.publish(4)
    with StandinNode() as node:
        node.answers[("POST", "/kvsp/prefetch")] = (
            409,
            {"type": "https://kvsp.dev/problems/kvsp-invalid-state", "detail": "sleeping"},
        )
        node_at(node, "ii1", cluster.scope)
        cluster.place()
        wait_until(lambda: Directive.objects.get().state == DirectiveState.FAILED, "failed")
    assert "sleeping" in Directive.objects.get().reason


def test_operator_state_change_is_pushed_and_retried(controller_env, start_process, cluster):
    env, controller = controller_env
    start_process("worker", "control-worker", env, queues=["control"])
    with StandinNode() as node:
        node_at(node, "ii1", cluster.scope)
        node.answers[("PUT", "/kvsp/state")] = (503, {"detail": "busy"})
        response = controller.put("/kvsp/instances/ii1/state", {"state": "draining"})
        assert response.status_code == 200
        assert body(response)["state"] == "draining"
        node.wait_for("PUT", "/kvsp/state")
        del node.answers[("PUT", "/kvsp/state")]  # the instance recovers; the PC retries
        wait_until(
            lambda: body(controller.get("/kvsp/instances/ii1"))["state_pushed"], "pushed", 60
        )
        pushed = node.received("PUT", "/kvsp/state")
    assert len(pushed) >= 2 and pushed[-1] == {"state": "draining"}


def test_only_the_controller_changes_states(cluster):
    caller = make_instance("ii1", scopes=[cluster.scope])
    response = caller.put("/kvsp/instances/ii1/state", {"state": "draining"})
    assert response.status_code == 403
    controller = make_caller("pc", controller=True)
    assert controller.put("/kvsp/instances/ii1/state", {"state": "failed"}).status_code == 422
    assert controller.put("/kvsp/instances/nope/state", {"state": "active"}).status_code == 404
    # A sleeping state is reached only by draining first: from failed nothing is allowed.
    refused = controller.put("/kvsp/instances/ii1/state", {"state": "draining"})
    assert refused.status_code == 409
    assert Instance.objects.get().state == "failed"


def test_wake_a_sleeping_instance_when_the_active_ones_are_full(
    cluster, controller_env, start_process
):
    env, _ = controller_env
    start_process("worker", "control-worker", env, queues=["control"])
    cluster.publish(4)
    with StandinNode() as full, StandinNode() as sleeper:
        node_at(full, "full", cluster.scope)
        napper = node_at(sleeper, "sleeper", cluster.scope)
        asleep = status_record(
            sleeper.url,
            links=[{"holder": HOLDER, "mbit_per_s": 100_000, "rtt_us": 10}],
            requested_state="sleeping",
        )
        assert body(report(napper, "sleeper", asleep))["state"] == "draining"
        asleep.update(state="sleeping", requested_state=None)
        assert body(report(napper, "sleeper", asleep))["state"] == "sleeping"
        full_record = status_record(full.url, kv_utilization=0.99)
        report(make_caller("node-full-2", instance="full"), "full", full_record)

        answer = body(cluster.place())
        assert (answer["name"], answer["woke"]) == ("sleeper", True)
        assert answer["directive"].startswith(sleeper.url)
        assert sleeper.wait_for("PUT", "/kvsp/state")[-1] == {"state": "active"}
        sleeper.wait_for("POST", "/kvsp/prefetch")
        assert not full.received("POST", "/kvsp/prefetch")
    assert Instance.objects.get(name="sleeper").state == "active"


def test_beat_marks_an_expired_instance_failed(cluster, controller_env, start_process):
    env, _ = controller_env
    env = {**env, "KVSP_FAILURE_CHECK_S": "0.5"}
    start_process("worker", "control-worker", env, queues=["control"])
    start_process("beat", "beat", env)
    caller = make_instance("ii1", scopes=[cluster.scope])
    report(caller, "ii1", status_record("http://ii1.test/kvsp/", ttl_ms=1000))
    before = timezone.now()
    wait_until(lambda: Instance.objects.get().state == "failed", "failed", 30)
    instance = Instance.objects.get()
    assert instance.failed_at >= before
