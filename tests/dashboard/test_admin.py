"""The Django admin of every model: lists with their filters and searches, protocol state
read-only, and the operator's actions through the same services as the API."""

import pytest
from django.contrib import admin

from index.models import Replica
from placement.models import Directive, Instance, ReshardOperation
from sessions.models import OutputToken, Session

pytestmark = pytest.mark.django_db

# Every model of the control plane's apps, with a search that finds something in the scene.
SEARCHES = {
    "index.scope": "tenant-a",
    "index.principal": "router",
    "index.holder": "holder.test",
    "index.replica": "holder.test",
    "index.compatdescriptor": "test-llama",
    "index.lookupbucket": None,
    "placement.instance": "ii1",
    "placement.statussample": None,
    "placement.directive": "req-dash",
    "placement.shardmap": "ctx-1",
    "placement.reshardoperation": "ctx-1",
    "kvsp_sessions.session": "ii1",
    "kvsp_sessions.outputtoken": None,
    "kvsp_sessions.openstream": None,
}


def test_every_model_of_the_control_plane_is_in_the_admin():
    registered = {model._meta.label_lower for model in admin.site._registry}
    assert set(SEARCHES) <= registered


@pytest.mark.parametrize("label", sorted(SEARCHES))
def test_each_list_each_search_and_each_row_render(admin_client, scene, label):
    app, model = label.split(".")
    changelist = f"/admin/{app}/{model}/"
    page = admin_client.get(changelist)
    assert page.status_code == 200
    rows = page.context["cl"].result_count
    assert rows >= 1
    if SEARCHES[label]:
        found = admin_client.get(changelist, {"q": SEARCHES[label]})
        assert found.context["cl"].result_count >= 1
    first = page.context["cl"].result_list[0]
    assert admin_client.get(f"{changelist}{first.pk}/change/").status_code == 200


def test_binary_ids_are_searched_by_their_hex(admin_client, scene):
    key = scene.cluster.keys[0]
    found = admin_client.get("/admin/index/replica/", {"q": key}).context["cl"]
    assert [replica.block_key_hex for replica in found.result_list] == [key]
    scope = scene.cluster.scope.scope_id_hex
    assert admin_client.get("/admin/index/replica/", {"q": scope}).context["cl"].result_count == 3
    assert admin_client.get("/admin/index/scope/", {"q": scope}).context["cl"].result_count == 1
    compat = scene.cluster.compat
    assert (
        admin_client.get("/admin/index/compatdescriptor/", {"q": compat}).context["cl"].result_count
        == 1
    )
    directive = str(Directive.objects.get().directive)
    assert (
        admin_client.get("/admin/placement/directive/", {"q": directive}).context["cl"].result_count
        == 1
    )
    session = scene.session
    assert (
        admin_client.get("/admin/kvsp_sessions/session/", {"q": session}).context["cl"].result_count
        == 1
    )


def test_filters_narrow_the_lists(admin_client, scene):
    def count(path, **query):
        return admin_client.get(path, query).context["cl"].result_count

    assert count("/admin/index/replica/", tier="4") == 1  # disk
    assert count("/admin/index/replica/", expiry="unexpired") == 3
    assert count("/admin/index/replica/", expiry="expired") == 0
    assert count("/admin/placement/instance/", record="live") == 2
    assert count("/admin/placement/reshardoperation/", phase="preparing") == 1
    assert count("/admin/kvsp_sessions/session/", failed_over="yes") == 0


def test_protocol_state_is_read_only(admin_client, scene):
    instance = Instance.objects.get(name="ii1")
    page = admin_client.get(f"/admin/placement/instance/{instance.pk}/change/")
    form_fields = set(page.context["adminform"].form.fields)
    assert form_fields == {"compat_ids"}  # name and URL are its identity; the rest is protocol
    admin_client.post(
        f"/admin/placement/instance/{instance.pk}/change/",
        {"compat_ids": "[]", "name": "renamed", "state": "sleeping", "epoch": "1"},
    )
    instance.refresh_from_db()
    assert (instance.name, instance.state) == ("ii1", "active")
    # Replicas, directives, sessions, tokens, shard maps and reshards: no add, no change.
    for path in (
        "/admin/index/replica/add/",
        "/admin/placement/directive/add/",
        "/admin/placement/shardmap/add/",
        "/admin/placement/reshardoperation/add/",
        "/admin/kvsp_sessions/session/add/",
        "/admin/kvsp_sessions/outputtoken/add/",
    ):
        assert admin_client.get(path).status_code == 403, path
    session = Session.objects.get()
    page = admin_client.get(f"/admin/kvsp_sessions/session/{session.pk}/change/")
    assert 'name="_save"' not in page.content.decode()
    assert f'href="/sessions/{session.session}"' in page.content.decode()  # view on dashboard
    assert OutputToken.objects.filter(session=session).count() == 3


def test_registering_an_instance_checks_its_name_and_url(admin_client):
    bad = admin_client.post(
        "/admin/placement/instance/add/",
        {"name": "Bad Name", "url": "ftp://x", "compat_ids": '["zz"]'},
    )
    errors = bad.context["adminform"].form.errors
    assert "use 1-100 of a-z" in errors["name"][0]
    assert "is not an http(s) base URL" in errors["url"][0]
    assert "64 lowercase hex digits" in errors["compat_ids"][0]
    good = admin_client.post(
        "/admin/placement/instance/add/",
        {"name": "ii9", "url": "http://ii9.test/kvsp/", "compat_ids": "[]"},
    )
    assert good.status_code == 302
    assert Instance.objects.get(name="ii9").state == "failed"  # until its first report


def test_admin_actions_use_the_services(admin_client, scene):
    instance = Instance.objects.get(name="ii1")
    admin_client.post(
        "/admin/placement/instance/",
        {"action": "make_draining", "_selected_action": [instance.pk]},
    )
    instance.refresh_from_db()
    assert (instance.state, instance.state_version) == ("draining", 1)

    operation = ReshardOperation.objects.get()
    admin_client.post(
        "/admin/placement/reshardoperation/",
        {"action": "abort", "_selected_action": [operation.pk]},
    )
    operation.refresh_from_db()
    assert operation.phase == "aborted"
    again = admin_client.post(
        "/admin/placement/reshardoperation/",
        {"action": "abort", "_selected_action": [operation.pk]},
        follow=True,
    )
    texts = [str(m) for m in again.context["messages"]]
    assert any("only a reshard still preparing can be aborted" in text for text in texts)

    replica = Replica.objects.filter(tier_mask=4).get()
    admin_client.post(
        "/admin/index/replica/", {"action": "withdraw", "_selected_action": [replica.pk]}
    )
    assert not Replica.objects.filter(pk=replica.pk).exists()
