"""The operator's actions on the dashboard: each calls the service the API calls, comes back to
the page it was posted from, and says what happened, or what was wrong."""

import pytest

from index.models import Holder, Replica
from placement.models import Instance, ReshardOperation

pytestmark = pytest.mark.django_db


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def state_of(name: str) -> str:
    return Instance.objects.get(name=name).state


def test_drain_from_the_overview_comes_back_with_the_new_state(admin_client, scene):
    response = admin_client.post(
        "/instances/ii1/state", {"state": "draining", "return_to": "/"}, follow=True
    )
    assert response.redirect_chain == [("/", 302)]
    assert messages_of(response) == ["ii1 is draining."]
    assert state_of("ii1") == "draining"
    row = response.content.decode().split('data-instance="ii1"')[1].split("</tr>")[0]
    assert "state-draining" in row and ">Wake</button>" in row and ">Drain</button>" not in row
    assert Instance.objects.get(name="ii1").state_version == 1  # pushed to it by the PC's task


def test_sleep_drains_first_and_wake_activates(admin_client, scene):
    response = admin_client.post("/instances/ii2/state", {"state": "sleeping"}, follow=True)
    assert response.redirect_chain == [("/instances/ii2", 302)]
    assert messages_of(response) == ["ii2 is draining; it sleeps once its sessions are done."]
    assert state_of("ii2") == "draining"
    response = admin_client.post("/instances/ii2/state", {"state": "active"}, follow=True)
    assert messages_of(response) == ["ii2 is active."]
    assert state_of("ii2") == "active"


@pytest.mark.parametrize(
    ("name", "state", "message"),
    [
        ("ii1", "failed", 'ii1: state: must be one of "active", "draining", "sleeping"'),
        ("ii1", "", 'ii1: state: must be one of "active", "draining", "sleeping"'),
        ("ghost", "draining", "ghost: no instance 'ghost' is registered"),
    ],
)
def test_a_state_change_that_cannot_be_is_a_message(admin_client, scene, name, state, message):
    response = admin_client.post(
        f"/instances/{name}/state", {"state": state, "return_to": "/"}, follow=True
    )
    assert messages_of(response) == [message]
    assert state_of("ii1") == "active"


def test_a_failed_instance_cannot_be_drained(admin_client, scene):
    Instance.objects.filter(name="ii1").update(state="failed")
    response = admin_client.post("/instances/ii1/state", {"state": "draining"}, follow=True)
    (message,) = messages_of(response)
    assert "'drain' is not allowed in state 'failed'" in message
    assert "rejoins when it restarts" in response.content.decode()


def test_actions_return_only_to_pages_of_this_site(admin_client, scene):
    response = admin_client.post(
        "/instances/ii1/state", {"state": "draining", "return_to": "https://elsewhere.example/"}
    )
    assert response["Location"] == "/instances/ii1"


def test_actions_need_permission_and_a_post(operator_client, scene):
    assert operator_client.get("/").status_code == 200  # staff may look
    response = operator_client.post("/instances/ii1/state", {"state": "draining"}, follow=True)
    assert messages_of(response) == ["You may not change the state of instances."]
    assert state_of("ii1") == "active"
    holder = Holder.objects.get(url="http://holder.test/kvsp/")
    replica = Replica.objects.filter(holder=holder).first()
    response = operator_client.post(
        f"/holders/{holder.pk}/withdraw", {"replica": [replica.pk]}, follow=True
    )
    assert messages_of(response) == ["You may not withdraw replicas."]
    response = operator_client.post(f"/reshards/{scene.operation_id}/abort", follow=True)
    assert messages_of(response) == ["You may not abort reshards."]
    assert Replica.objects.filter(pk=replica.pk).exists()
    assert ReshardOperation.objects.get().phase == "preparing"
    assert operator_client.get("/instances/ii1/state").status_code == 405


def test_withdraw_chosen_replicas_of_one_holder(admin_client, scene):
    holder = Holder.objects.get(url="http://holder.test/kvsp/")
    chosen = Replica.objects.filter(holder=holder, tier_mask=1).get()
    elsewhere = Replica.objects.exclude(holder=holder).get()
    response = admin_client.post(
        f"/holders/{holder.pk}/withdraw",
        {"replica": [chosen.pk, elsewhere.pk], "return_to": f"/holders/{holder.pk}"},
        follow=True,
    )
    assert messages_of(response) == ["Withdrew 1 replica(s)."]
    assert not Replica.objects.filter(pk=chosen.pk).exists()
    assert Replica.objects.filter(pk=elsewhere.pk).exists()  # another holder's: untouched
    assert response.content.decode().count('name="replica"') == 1


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({}, "Choose the replicas to withdraw first."),
        ({"replica": ["x"]}, "The replicas to withdraw were not given as ids."),
    ],
)
def test_a_withdrawal_without_replicas_is_a_message(admin_client, scene, form, message):
    holder = Holder.objects.get(url="http://holder.test/kvsp/")
    response = admin_client.post(f"/holders/{holder.pk}/withdraw", form, follow=True)
    assert messages_of(response) == [message]
    assert Replica.objects.count() == 3


def test_abort_a_reshard_still_preparing(admin_client, scene):
    path = f"/reshards/{scene.operation_id}/abort"
    response = admin_client.post(path, {"return_to": "/"}, follow=True)
    assert messages_of(response) == ["Reshard ctx-1 v1 → v2 is aborted."]
    operation = ReshardOperation.objects.get()
    assert operation.phase == "aborted" and operation.reason == "aborted by an operator"
    assert ">Abort</button>" not in response.content.decode()
    # An abort repeated is harmless; an abort of a committed reshard is refused.
    again = admin_client.post(path, follow=True)
    assert messages_of(again) == ["Reshard ctx-1 v1 → v2 is aborted."]
    ReshardOperation.objects.update(phase="committed")
    refused = admin_client.post(path, follow=True)
    (message,) = messages_of(refused)
    assert message.startswith("Reshard ctx-1 v1 → v2: reshard: 'abort' is not allowed")
    missing = admin_client.post("/reshards/999999/abort", follow=True)
    assert messages_of(missing) == ["No reshard operation 999999 is known."]
