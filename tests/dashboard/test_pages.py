"""The dashboard's pages and their live JSON, through Django's test client."""

import uuid

import pytest

from dashboard import sections
from index.models import LookupBucket
from tests.dashboard.conftest import II1_URL

pytestmark = pytest.mark.django_db


def test_pages_need_a_staff_login(client, django_user_model, scene):
    session = scene.session
    for path in ("/", "/instances/ii1", f"/sessions/{session}", "/holders/1"):
        response = client.get(path)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/?next=")
    live = client.get("/live/")
    assert live.status_code == 403 and "log in" in live.json()["detail"]

    user = django_user_model.objects.create_user("not-staff", password="x" * 12)
    client.force_login(user)
    assert client.get("/").status_code == 302
    assert client.get("/live/").status_code == 403


def test_the_overview_shows_every_part_of_the_cluster(admin_client, scene):
    page = admin_client.get("/")
    assert page.status_code == 200
    html = page.content.decode()
    for section in sections.OVERVIEW:
        assert f'data-section="{section.name}"' in html
    # Instances with their figures and the actions their state allows.
    assert 'href="/instances/ii1"' in html and 'data-instance="ii2"' in html
    assert "42%" in html  # ii1's KV utilization
    assert ">Drain</button>" in html and ">Sleep</button>" in html
    assert ">Wake</button>" not in html  # both are active
    # Replicas per holder and tier, lookups, the directive, the session, the lease, the reshard.
    assert "http://holder.test/kvsp/" in html and II1_URL in html
    assert "req-dash" in html
    assert scene.session[:6] in html
    assert "3.0\xa0MB" in html  # the lease's octets (filesizeformat keeps number and unit together)
    assert "ctx-1" in html and "v1 → v2" in html and ">Abort</button>" in html


def test_the_live_json_renders_the_same_sections_and_the_charts_series(admin_client, scene):
    answer = admin_client.get("/live/").json()
    assert set(answer["html"]) == {section.name for section in sections.OVERVIEW}
    assert 'data-instance="ii1"' in answer["html"]["instances"]
    charts = {chart.name for section in sections.OVERVIEW for chart in section.charts}
    assert set(answer["series"]) == charts
    hit_ratio = answer["series"]["hit_ratio"]
    assert hit_ratio["unit"] == "ratio"
    start, end = hit_ratio["window"]
    assert end - start == sections.SHORTEST_CHART_WINDOW.total_seconds() * 1000  # a young cluster
    # One lookup of four keys matched three; the placement's lookup matched the same three.
    (blocks, with_match) = hit_ratio["lines"]
    assert [point[1] for point in blocks["points"]] == [0.75]
    assert [point[1] for point in with_match["points"]] == [1.0]
    assert start <= blocks["points"][0][0] <= end
    load = answer["series"]["load"]["lines"]
    assert [line["name"] for line in load] == ["running", "queued"]
    assert load[0]["points"][0][1] == 3.0  # ii1's 3 running and ii2's none


def test_lookups_are_counted_per_minute_from_the_api(scene):
    (bucket,) = LookupBucket.objects.all()
    assert (bucket.lookups, bucket.hits, bucket.block_keys, bucket.matched_blocks) == (2, 2, 8, 6)
    cluster = scene.cluster
    lookup = {
        "scope_id": cluster.scope.scope_id_hex,
        "compat_id": cluster.compat,
        "block_keys": list(reversed(cluster.keys)),  # the first key has no replica
    }
    assert cluster.router.post("/kvsp/lookup", lookup).status_code == 200
    from index import metrics

    metrics.lookup_tally.write()
    bucket = LookupBucket.objects.get()
    assert (bucket.lookups, bucket.hits, bucket.block_keys, bucket.matched_blocks) == (3, 2, 12, 6)


def test_the_instance_page_shows_its_figures_directives_sessions_and_replicas(admin_client, scene):
    html = admin_client.get("/instances/ii1").content.decode()
    assert "Instance ii1" in html and II1_URL in html
    assert "3 running, 1 queued, batch 8" in html
    assert scene.session[:6] in html  # it serves the session
    assert "Its replicas, to withdraw some" in html
    answer = admin_client.get("/live/instances/ii1").json()
    assert set(answer["html"]) == {section.name for section in sections.INSTANCE}
    charts = {"load", "kv_utilization", "rates", "prefetch_latency"}
    charts |= {"why_misses", "cache_tokens", "evictions"}
    assert charts == set(answer["series"])
    rates = {line["name"]: line["points"] for line in answer["series"]["rates"]["lines"]}
    assert rates["prefill"][0][1] == 10_000 and rates["decode"][0][1] == 1_000


def test_the_session_page_lists_tokens_and_its_live_json_sends_only_new_ones(admin_client, scene):
    session = scene.session
    html = admin_client.get(f"/sessions/{session}").content.decode()
    assert 'data-cursor="{&quot;after&quot;: 2}"' in html
    assert html.count('class="token"') == 3
    assert "3 tokens delivered" in html

    tokens = [{"epoch": 1, "index": 3, "token": 777}, {"epoch": 1, "index": 4, "token": 778}]
    assert scene.ii1.post(f"/kvsp/sessions/{session}/output", tokens).status_code == 200
    answer = admin_client.get(f"/live/sessions/{session}", {"after": 2}).json()
    assert answer["cursor"] == {"after": 4}
    appended = answer["append"]["tokens"]
    assert appended.count("<li") == 2 and ">777<" in appended and ">778<" in appended
    assert "5 tokens delivered" in answer["html"]["session"]
    idle = admin_client.get(f"/live/sessions/{session}", {"after": 4}).json()
    assert idle["append"] == {} and idle["cursor"] == {"after": 4}
    bad = admin_client.get(f"/live/sessions/{session}", {"after": "x"})
    assert bad.status_code == 400 and "integer" in bad.json()["detail"]
    for digits in ("२", "+2", " 2"):  # int() reads each of these as 2
        bad = admin_client.get(f"/live/sessions/{session}", {"after": digits})
        assert bad.status_code == 400 and "ASCII decimal digits" in bad.json()["detail"]


def test_the_holder_page_lists_its_replicas_by_tier(admin_client, scene):
    from index.models import Holder

    holder = Holder.objects.get(url="http://holder.test/kvsp/")
    html = admin_client.get(f"/holders/{holder.pk}").content.decode()
    assert html.count('name="replica"') == 2
    device = admin_client.get(f"/holders/{holder.pk}", {"tier": "device"}).content.decode()
    assert device.count('name="replica"') == 1
    wrong = admin_client.get(f"/holders/{holder.pk}", {"tier": "tape"}).content.decode()
    assert "is not a tier" in wrong and wrong.count('name="replica"') == 2
    answer = admin_client.get(f"/live/holders/{holder.pk}").json()
    assert "in all" in answer["html"]["holder"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/instances/nope", "No instance named &#x27;nope&#x27; is registered."),
        ("/sessions/not-a-uuid", "is not a session id"),
        (f"/sessions/{uuid.UUID(int=7)}", "No session 00000000-0000-0000-0000-000000000007"),
        ("/holders/999999", "No holder 999999 is known."),
    ],
)
def test_what_does_not_exist_is_a_page_that_says_so(admin_client, path, message):
    response = admin_client.get(path)
    assert response.status_code == 404
    assert message in response.content.decode()
    live = admin_client.get("/live" + path)
    assert live.status_code == 404 and live.json()["detail"]


def test_an_empty_cluster_says_what_is_missing(admin_client):
    html = admin_client.get("/").content.decode()
    assert "No instance is registered." in html
    assert "No unexpired replica is published." in html
    assert "No session has checkpointed yet." in html
    assert "No Shard Map is stored." in html
    answer = admin_client.get("/live/").json()
    assert all(line["points"] == [] for line in answer["series"]["hit_ratio"]["lines"])


def test_static_files_are_served_by_the_project(client):
    for name in ("dashboard.js", "chart.js", "dashboard.css", "favicon.svg"):
        response = client.get(f"/static/dashboard/{name}")
        assert response.status_code == 200, name
    assert client.get("/favicon.ico")["Location"] == "/static/dashboard/favicon.svg"


def test_a_chart_spans_from_its_first_point_but_no_more_than_an_hour():
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    page = sections.Page(now, "/")

    def window(*minutes_ago):
        points = [[sections.ms(now - timedelta(minutes=m)), 1.0] for m in minutes_ago]
        start, end = sections.chart_window(page, [{"name": "x", "points": points}])
        assert end == sections.ms(now)
        return (end - start) / 60_000

    assert window() == 5
    assert window(1) == 5
    assert window(20, 1) == 20
    assert window(90, 30) == 60


def test_the_overview_charts_why_misses_where_tokens_come_from_and_evictions(admin_client, scene):
    from common.metrics import tally
    from workers import metrics as node_metrics

    # What ii1's node counted (its worker and server: tests/node drive them for real).
    node_metrics.count_directive_blocks(
        "ii1", {"disk": 2}, {"digest_mismatch": 1, "past_failure": 3}
    )
    node_metrics.count_evictions("ii1", [("capacity", 4096), ("scope_quota", 4096)])
    node_metrics.count_evictions("ii2", [("fault", 4096)])
    tally.write()

    answer = admin_client.get("/live/").json()
    series = answer["series"]

    def lines(chart: str) -> dict:
        return {line["name"]: [p[1] for p in line["points"]] for line in series[chart]["lines"]}

    # The scene's lookup stopped after three of four keys; so did its placement's lookup.
    assert lines("why_misses") == {
        "lookup stop: no_replica": [2],
        "block not loaded: digest_mismatch": [1],
        "block not loaded: past_failure": [3],
    }
    tokens = lines("cache_tokens")
    assert set(tokens) <= {"from cache (own tiers)", "from cache (peers)", "recomputed"}
    assert sum(sum(points) for points in tokens.values()) == len(scene.cluster.tokens)
    assert series["tier_hits"]["unit"] == "ratio"
    # Two lookups of four Block Keys, each matching one block on each of device, host and disk.
    assert lines("tier_hits") == {"device": [0.25], "host": [0.25], "disk": [0.25]}
    assert lines("evictions") == {"ii1: capacity": [1], "ii1: scope_quota": [1], "ii2: fault": [1]}
    assert "digest_mismatch" in answer["html"]["cache"]

    # An instance's page shows its own blocks and evictions, nobody else's.
    own = admin_client.get("/live/instances/ii1").json()["series"]
    assert {line["name"] for line in own["why_misses"]["lines"]} == {
        "block not loaded: digest_mismatch",
        "block not loaded: past_failure",
    }
    assert {line["name"] for line in own["evictions"]["lines"]} == {"capacity", "scope_quota"}
    other = admin_client.get("/live/instances/ii2").json()["series"]
    assert other["why_misses"]["lines"] == []
    assert {line["name"] for line in other["evictions"]["lines"]} == {"fault"}
    # The scene's placement is on the page of the instance it chose, and only there.
    placed = {
        name: sum(sum(p[1] for p in line["points"]) for line in figures["cache_tokens"]["lines"])
        for name, figures in (("ii1", own), ("ii2", other))
    }
    assert sorted(placed.values()) == [0, len(scene.cluster.tokens)]
