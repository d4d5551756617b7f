"""Instance status reports (spec 6.3): epochs, the answer's state, the sleep policy."""

import random
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from django.test import override_settings
from django.utils import timezone

from kvsp.problems import ProtocolError
from kvsp.states import DirectiveEvent
from placement.delivery import finish_directive
from placement.models import Directive, Instance, StatusSample
from placement.services import do_change_state, do_mark_expired
from tests.support.fixtures import (
    body,
    make_caller,
    make_instance,
    problem_name,
    report,
    status_record,
)

pytestmark = pytest.mark.django_db

URL = "http://ii1.test/kvsp/"


@pytest.fixture
def ii1():
    return make_instance("ii1", URL)


def test_first_report_makes_an_instance_active(ii1):
    assert Instance.objects.get().state == "failed"  # never reported yet
    response = report(ii1, "ii1", status_record(URL, epoch=1000, running=3, queued=1))
    assert response.status_code == 200
    assert body(response) == {"state": "active"}
    instance = Instance.objects.get()
    assert (instance.state, instance.epoch, instance.running, instance.queued) == (
        "active",
        1000,
        3,
        1,
    )
    assert instance.expires_at > timezone.now()
    assert StatusSample.objects.filter(instance=instance).count() == 1


def test_a_lower_epoch_is_discarded_and_changes_nothing(ii1):
    report(ii1, "ii1", status_record(URL, epoch=5, running=7))
    response = report(ii1, "ii1", status_record(URL, epoch=4, running=1))
    assert response.status_code == 409
    assert problem_name(response) == "kvsp-stale-epoch"
    instance = Instance.objects.get()
    assert (instance.epoch, instance.running) == (5, 7)


# The refused statement runs in autocommit, as in production: no test transaction around it.
@pytest.mark.django_db(transaction=True)
def test_a_figure_past_what_the_database_stores_is_refused_and_changes_nothing(ii1):
    report(ii1, "ii1", status_record(URL, epoch=5, running=7))
    response = report(ii1, "ii1", status_record(URL, epoch=6, running=2**40))
    assert response.status_code == 422, response.content
    assert problem_name(response) == "kvsp-invalid-record"
    instance = Instance.objects.get()
    assert (instance.epoch, instance.running) == (5, 7)


def test_a_higher_epoch_is_a_restart(ii1):
    report(ii1, "ii1", status_record(URL, epoch=5))
    assert body(report(ii1, "ii1", status_record(URL, epoch=9))) == {"state": "active"}
    instance = Instance.objects.get()
    assert (instance.epoch, instance.restarts) == (9, 1)


def test_expiry_fails_an_instance_and_its_old_epoch_cannot_come_back(ii1):
    report(ii1, "ii1", status_record(URL, epoch=5, ttl_ms=1000))
    assert do_mark_expired(now=timezone.now() + timedelta(seconds=2)) == [Instance.objects.get().pk]
    assert Instance.objects.get().state == "failed"
    late = report(ii1, "ii1", status_record(URL, epoch=5))
    assert late.status_code == 409
    assert Instance.objects.get().state == "failed"
    assert body(report(ii1, "ii1", status_record(URL, epoch=6))) == {"state": "active"}


def test_a_failed_instance_is_not_woken_by_an_operator(ii1):
    # Only a new incarnation comes back from failed (the lifecycle table): nothing is pushed.
    with pytest.raises(ProtocolError) as caught:
        do_change_state("ii1", "active")
    assert caught.value.problem == "kvsp-invalid-state"
    assert "'activate' is not allowed in state 'failed'" in caught.value.detail
    instance = Instance.objects.get()
    assert (instance.state, instance.state_version) == ("failed", 0)


def test_an_operator_may_ask_only_for_a_state_an_instance_can_be_asked_to_take(ii1):
    report(ii1, "ii1", status_record(URL, epoch=1))
    controller = make_caller("pc", controller=True)
    for state in ["failed", "asleep", None, 3]:
        refused = controller.put("/kvsp/instances/ii1/state", {"state": state})
        assert refused.status_code == 422 and problem_name(refused) == "kvsp-invalid-record"
        assert body(refused)["detail"] == 'state: must be one of "active", "draining", "sleeping"'
    missing = controller.put("/kvsp/instances/ii1/state", {})
    assert body(missing)["detail"] == "state: required member is missing"
    assert Instance.objects.get().state_version == 0
    assert body(controller.put("/kvsp/instances/ii1/state", {"state": "draining"}))["state"] == (
        "draining"
    )


def directive_of(instance: Instance, **fields) -> Directive:
    return Directive.objects.create(
        instance=instance,
        scope_id=bytes(16),
        compat_id=bytes(32),
        deadline_ms=1000,
        lease_ms=1000,
        **fields,
    )


def test_draining_fails_the_pending_directives_and_no_directive_ends_twice(ii1):
    report(ii1, "ii1", status_record(URL, epoch=1))
    instance = Instance.objects.get()
    pending = directive_of(instance)
    complete = directive_of(instance, state="complete", loaded=["ab" * 32])
    do_change_state("ii1", "draining")
    pending.refresh_from_db()
    complete.refresh_from_db()
    assert (pending.state, pending.reason) == ("failed", "the instance is draining")
    assert (complete.state, complete.reason, complete.loaded) == ("complete", "", ["ab" * 32])
    # An instance's late answer about a directive that ended here changes nothing either.
    finish_directive(pending.pk, DirectiveEvent.ALL_LOADED, loaded=["ab" * 32])
    pending.refresh_from_db()
    assert (pending.state, pending.loaded) == ("failed", [])


def test_liveness_is_judged_on_the_controllers_clock(ii1):
    report(ii1, "ii1", status_record(URL, epoch=5, ttl_ms=60_000))
    assert do_mark_expired(now=timezone.now() + timedelta(seconds=30)) == []
    assert do_mark_expired(now=timezone.now() + timedelta(seconds=61)) != []


def test_only_the_instances_principal_may_report(ii1):
    make_instance("ii2")
    other = make_caller("someone", instance="ii2")
    assert report(other, "ii1", status_record(URL)).status_code == 403
    controller = make_caller("pc", controller=True)
    assert report(controller, "ii1", status_record(URL)).status_code == 403
    assert Instance.objects.get(name="ii1").epoch is None


def test_the_record_must_name_the_registered_url(ii1):
    response = report(ii1, "ii1", status_record("http://elsewhere.test/kvsp/"))
    assert response.status_code == 422
    assert Instance.objects.get().epoch is None


def test_unregistered_instance_is_404():
    ghost = make_caller("ghost", instance="ghost")
    assert report(ghost, "ghost", status_record("http://ghost.test/kvsp/")).status_code == 404


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": -1},
        {"state": "dozing"},
        {"kv_utilization": 1.5},
        {"requested_state": "active"},
        {"links": [{"holder": "x", "mbit_per_s": 1, "rtt_us": 1}]},
        {"links": [{"holder": 'http://evil.test/"><svg/onload=x>/', "mbit_per_s": 1, "rtt_us": 1}]},
        {"ttl_ms": 0},
    ],
)
def test_invalid_records_are_refused(ii1, change):
    response = report(ii1, "ii1", status_record(URL, **change))
    assert response.status_code == 422
    assert response["Content-Type"] == "application/problem+json"
    assert Instance.objects.get().epoch is None


def test_unknown_members_are_ignored(ii1):
    record = status_record(URL, epoch=3)
    record["x-gpu-temperature"] = 71
    assert report(ii1, "ii1", record).status_code == 200


# --- sleep (spec 6.3) --------------------------------------------------------------------------


def test_sleep_is_accepted_when_another_instance_stays_active(ii1):
    ii2 = make_instance("ii2")
    report(ii2, "ii2", status_record("http://ii2.test/kvsp/", epoch=1))
    report(ii1, "ii1", status_record(URL, epoch=1))
    answer = report(ii1, "ii1", status_record(URL, epoch=1, requested_state="sleeping"))
    assert body(answer) == {"state": "draining"}
    # Draining, it finishes its sessions and reports sleeping: the PC records it.
    answer = report(ii1, "ii1", status_record(URL, epoch=1, state="sleeping"))
    assert body(answer) == {"state": "sleeping"}
    # A sleeping instance stays asleep whatever it reports, until the PC wakes it.
    answer = report(ii1, "ii1", status_record(URL, epoch=1, state="active"))
    assert body(answer) == {"state": "sleeping"}


def test_sleep_is_refused_for_the_last_active_instance(ii1):
    report(ii1, "ii1", status_record(URL, epoch=1))
    answer = report(ii1, "ii1", status_record(URL, epoch=1, requested_state="sleeping"))
    assert body(answer) == {"state": "active"}


@override_settings(KVSP_SLEEP_MAX_RUNNING=2)
def test_sleep_is_refused_under_load(ii1):
    ii2 = make_instance("ii2")
    report(ii2, "ii2", status_record("http://ii2.test/kvsp/", epoch=1))
    busy = status_record(URL, epoch=1, running=3, requested_state="sleeping")
    assert body(report(ii1, "ii1", busy)) == {"state": "active"}
    light = status_record(URL, epoch=1, running=2, requested_state="sleeping")
    assert body(report(ii1, "ii1", light)) == {"state": "draining"}


# --- concurrency on Postgres, through a real server --------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_out_of_order_reports_keep_the_highest_epoch(role_env, start_process):
    caller = make_instance("ii1", URL)
    server = start_process("server", "control", role_env(), workers=2)
    epochs = list(range(1, 121))
    random.Random(7).shuffle(epochs)
    headers = {"Authorization": f"Bearer {caller.token}"}

    def send(epoch):
        response = httpx.put(
            f"{server.url}/kvsp/instances/ii1/status",
            json=status_record(URL, epoch=epoch, running=epoch),
            headers=headers,
            timeout=30,
        )
        return response.status_code

    with ThreadPoolExecutor(max_workers=12) as pool:
        codes = list(pool.map(send, epochs))
    assert set(codes) <= {200, 409}
    instance = Instance.objects.get()
    assert instance.epoch == 120
    # The figures are those of the highest epoch: a stale record never overwrote them.
    assert instance.running == 120
    assert instance.restarts == codes.count(200) - 1


def test_heartbeats_update_figures_and_sample_every_interval(ii1):
    from index.authentication import principal_for_token
    from placement.services import do_report_status

    principal = principal_for_token(ii1.token)
    start = timezone.now()
    for second in range(25):
        answer = do_report_status(
            principal,
            "ii1",
            status_record(URL, epoch=1, running=second),
            now=start + timedelta(seconds=second),
        )
        assert answer.state == "active"
    instance = Instance.objects.get()
    assert instance.running == 24
    assert instance.expires_at == start + timedelta(seconds=24, milliseconds=3000)
    # One sample per KVSP_STATUS_SAMPLE_S (10 s): at 0, 10 and 20 seconds.
    assert [s.running for s in StatusSample.objects.order_by("at")] == [0, 10, 20]


# --- mass failure --------------------------------------------------------------------------------


def fleet(count, *, ttl_ms=1000):
    callers = []
    for n in range(count):
        name = f"f{n:02d}"
        caller = make_instance(name)
        report(caller, name, status_record(f"http://{name}.test/kvsp/", ttl_ms=ttl_ms))
        callers.append(caller)
    return callers


def test_a_controller_that_looks_cut_off_fails_nobody_over():
    fleet(5)
    later = timezone.now() + timedelta(seconds=5)
    assert do_mark_expired(now=later) == []  # all 5 of 5 expired together
    assert not Instance.objects.filter(state="failed").exists()


def test_a_minority_expiring_is_failed_over():
    fleet(5)
    Instance.objects.filter(name__in=["f00", "f01"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    Instance.objects.exclude(name__in=["f00", "f01"]).update(
        expires_at=timezone.now() + timedelta(minutes=5)
    )
    assert len(do_mark_expired()) == 2
    assert set(Instance.objects.filter(state="failed").values_list("name", flat=True)) == {
        "f00",
        "f01",
    }


@override_settings(KVSP_FAILOVER_MAX_PER_CHECK=2, KVSP_FAILOVER_CUT_OFF_FRACTION=1.01)
def test_failover_is_paced_oldest_first():
    fleet(6)
    now = timezone.now()
    for n in range(5):
        Instance.objects.filter(name=f"f{n:02d}").update(expires_at=now - timedelta(seconds=10 - n))
    first = do_mark_expired(now=now)
    assert [Instance.objects.get(pk=pk).name for pk in first] == ["f00", "f01"]
    assert len(do_mark_expired(now=now)) == 2
    assert len(do_mark_expired(now=now)) == 1
    assert Instance.objects.get(name="f05").state == "active"
