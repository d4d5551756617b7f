"""/metrics: what servers count as it happens, and what the database records, read at scrape."""

from datetime import timedelta

import httpx
import pytest
from django.db import OperationalError
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import DatabaseCollector
from placement.models import Directive
from sessions.models import Session


def samples(text: str) -> dict[tuple, float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def scrape(client) -> dict[tuple, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    return samples(response.content.decode())


@pytest.mark.django_db
def test_the_database_figures_of_the_cluster(client, scene):
    Directive.objects.update(state="complete")
    directive = Directive.objects.get()
    Directive.objects.update(finished_at=directive.created_at + timedelta(milliseconds=300))
    Session.objects.update(failovers=2)
    found = scrape(client)

    assert found[("kvsp_database_up", ())] == 1
    assert found[("kvsp_instances", (("state", "active"),))] == 2
    assert found[("kvsp_instances", (("state", "failed"),))] == 0
    assert found[("kvsp_instance_running", (("instance", "ii1"),))] == 3
    assert found[("kvsp_instance_kv_utilization", (("instance", "ii1"),))] == 0.42
    assert found[("kvsp_instance_load", (("instance", "ii1"),))] == 0.5
    assert found[("kvsp_instance_last_report_age_seconds", (("instance", "ii2"),))] >= 0

    assert found[("kvsp_replicas", ())] == 3
    assert found[("kvsp_replica_octets", ())] == 3 * 4096
    for tier, count in (("device", 1), ("host", 1), ("disk", 1), ("other", 0)):
        assert found[("kvsp_tier_replicas", (("tier", tier),))] == count

    assert found[("kvsp_prefetch_directives", (("state", "complete"),))] == 1
    assert found[("kvsp_prefetch_directives", (("state", "pending"),))] == 0
    complete = (("state", "complete"),)
    assert found[("kvsp_prefetch_latency_seconds_count", complete)] == 1
    assert found[("kvsp_prefetch_latency_seconds_sum", complete)] == pytest.approx(0.3)
    assert found[("kvsp_prefetch_latency_seconds_bucket", (("le", "0.25"), *complete))] == 0
    assert found[("kvsp_prefetch_latency_seconds_bucket", (("le", "0.5"), *complete))] == 1

    assert found[("kvsp_sessions", (("state", "running"),))] == 1
    assert found[("kvsp_session_failovers_total", ())] == 2
    assert found[("kvsp_output_streams", ())] == 1
    assert found[("kvsp_leases", (("instance", "ii1"),))] == 1
    assert found[("kvsp_lease_octets", (("instance", "ii1"),))] == 3 * 1024 * 1024
    assert found[("kvsp_shard_maps", ())] == 1
    assert found[("kvsp_reshard_operations", (("phase", "preparing"),))] == 1


@pytest.mark.django_db
def test_requests_and_lookups_are_counted_by_endpoint_name(client, scene):
    before = scrape(client)
    lookup = (("endpoint", "lookup"), ("method", "POST"), ("status", "200"))
    cluster = scene.cluster
    body = {
        "scope_id": cluster.scope.scope_id_hex,
        "compat_id": cluster.compat,
        "block_keys": cluster.keys,
    }
    assert cluster.router.post("/kvsp/lookup", body).status_code == 200
    assert client.get("/kvsp/instances/ii1").status_code == 401  # no token
    after = scrape(client)

    def grew(name, labels):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert grew("kvsp_http_requests_total", lookup) == 1
    instance = (("endpoint", "instance"), ("method", "GET"), ("status", "401"))
    assert grew("kvsp_http_requests_total", instance) == 1
    lookup_timed = (("endpoint", "lookup"), ("method", "POST"))
    assert after[("kvsp_http_request_duration_seconds_count", lookup_timed)] >= 1
    source = (("source", "lookup"),)
    assert grew("kvsp_lookup_block_keys_total", source) == 4
    assert grew("kvsp_lookup_matched_blocks_total", source) == 3
    assert grew("kvsp_lookup_matched_ratio_bucket", (("le", "0.75"), *source)) == 1
    assert grew("kvsp_lookup_matched_ratio_bucket", (("le", "0.5"), *source)) == 0
    # Paths never become labels: an unmatched URL is one series whatever the path.
    client.get("/no/such/path/1")
    client.get("/no/such/path/2")
    labels = {
        dict(key[1]).get("endpoint")
        for key in scrape(client)
        if key[0] == "kvsp_http_requests_total"
    }
    assert "unmatched" in labels and not any("/" in label for label in labels)


@pytest.mark.django_db
def test_metrics_answer_only_get_and_say_when_the_database_is_unreadable(client, monkeypatch):
    response = client.post("/metrics")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/problem+json"

    def unreadable():
        raise OperationalError("the database went away")

    monkeypatch.setattr("placement.selectors.instance_state_counts", unreadable)
    found = scrape(client)
    assert found[("kvsp_database_up", ())] == 0
    assert not any(key[0] == "kvsp_instances" for key in found)


@pytest.mark.django_db
def test_a_node_reports_its_own_leases_only(settings, scene):
    from tests.dashboard.conftest import lease_for

    lease_for(scene.cluster.router.name, "ii2", 1024)
    settings.KVSP_ROLE = "node"
    settings.KVSP_INSTANCE = "ii2"
    text = "".join(
        f"{sample.name}{sample.labels} {sample.value}\n"
        for family in DatabaseCollector().collect()
        for sample in family.samples
    )
    assert "kvsp_lease_octets{'instance': 'ii2'} 1024" in text
    assert "ii1" not in text and "kvsp_instances" not in text


@pytest.mark.django_db(transaction=True)
def test_a_server_with_several_workers_answers_for_all_of_them(role_env, start_process):
    from django.conf import settings

    server = start_process("server", "control-metrics", role_env(), workers=3)
    directory = settings.VAR_DIR / "metrics" / str(server.proc.pid)
    assert directory.is_dir()
    unauthenticated = (("endpoint", "instances"), ("method", "GET"), ("status", "401"))
    with httpx.Client(base_url=server.url) as http:
        for _ in range(30):
            assert http.get("/kvsp/instances/").status_code == 401
        # Whichever worker takes each scrape, it counts the requests of all three.
        for _ in range(6):
            found = samples(http.get("/metrics").text)
            assert found[("kvsp_http_requests_total", unauthenticated)] == 30
    server.stop()
    assert not directory.exists()
