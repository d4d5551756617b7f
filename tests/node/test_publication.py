"""A node publishes many Replica Records at once (``workers.control_plane.publish_replicas``):
through the batch form (``POST CP replicas``) in chunks the control plane takes, and one PUT each
(spec 6.1) where the control plane speaks only the spec. Both control planes are gunicorn
servers on loopback; this process plays the node's side."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import httpx
import orjson
import pytest

from kvsp.records import ReplicaRecord
from tests.node.conftest import start_all
from tests.support.fixtures import HOLDER_B, random_key, replica_json
from tests.support.processes import Server
from workers import control_plane

pytestmark = pytest.mark.django_db

COMPAT = "c3" * 32


@dataclass
class Publisher:
    token: str
    scope: str
    holder: str
    batches: Server  # takes at most 3 records per batch
    spec_only: Server  # has no batch route


@pytest.fixture(scope="module")
def publisher(django_db_setup, django_db_blocker, role_env, log_dir):
    from index.models import Holder, Principal, Replica
    from index.services import do_create_principal, do_create_scope

    run = os.urandom(3).hex()
    holder = f"http://publisher-{run}.test/kvsp/"
    with django_db_blocker.unblock():
        scope = do_create_scope(f"publisher-{run}")
        token = do_create_principal(
            f"publisher-{run}", scope_ids=[bytes(scope.scope_id)], holder_urls=[holder]
        ).token
    batches = Server(f"cp-batches-{run}", role_env(KVSP_MAX_BATCH_RECORDS="3"), log_dir, workers=1)
    spec_only = Server(
        f"cp-spec-only-{run}",
        role_env(DJANGO_SETTINGS_MODULE="tests.node.spec_only_settings"),
        log_dir,
        workers=1,
    )
    try:
        start_all([batches, spec_only])
        yield Publisher(token, scope.scope_id_hex, holder, batches, spec_only)
    finally:
        batches.stop()
        spec_only.stop()
        with django_db_blocker.unblock():
            Replica.objects.filter(scope_id=scope.scope_id).delete()
            Principal.objects.filter(name=f"publisher-{run}").delete()
            Holder.objects.filter(url=holder).delete()
            scope.delete()


@pytest.fixture
def node_of(publisher, settings, monkeypatch):
    """Make this process a node publishing to ``server`` with the publisher's token."""

    def use(server: Server) -> None:
        settings.KVSP_CONTROL_URL = f"{server.url}/kvsp/"
        settings.KVSP_TOKEN = publisher.token
        monkeypatch.setattr(control_plane, "_clients", {})
        monkeypatch.setattr(control_plane, "_no_batch_route_until", {})

    return use


def records(publisher: Publisher, count: int) -> list[ReplicaRecord]:
    return [
        ReplicaRecord.from_json(
            replica_json(publisher.scope, COMPAT, random_key(), publisher.holder)
        )
        for _ in range(count)
    ]


def not_ours(publisher: Publisher) -> ReplicaRecord:
    """A record for a holder the publisher may not publish for."""
    return ReplicaRecord.from_json(replica_json(publisher.scope, COMPAT, random_key(), HOLDER_B))


def stored_keys(publisher: Publisher) -> set[str]:
    from index.models import Replica

    rows = Replica.objects.filter(scope_id=bytes.fromhex(publisher.scope))
    return {bytes(key).hex() for key in rows.values_list("block_key", flat=True)}


def answered(server: Server) -> dict[tuple[str, str, str], int]:
    """Requests the server answered, by (endpoint, method, status), from its /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = re.compile(r"^kvsp_http_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)
    counts = {}
    for labels, value in pattern.findall(text):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found["endpoint"] != "metrics":  # the scrapes themselves
            counts[(found["endpoint"], found["method"], found["status"])] = int(float(value))
    return counts


def grew(before: dict, after: dict) -> dict:
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}


def assert_refused_as_not_ours(outcome) -> None:
    assert not outcome.published
    assert outcome.error.problem == "kvsp-forbidden"
    assert outcome.error.status == 403
    assert HOLDER_B in outcome.error.detail


def test_records_go_in_batches_the_control_plane_takes(publisher, node_of):
    node_of(publisher.batches)
    ours = records(publisher, 7)
    sent = [*ours, not_ours(publisher)]
    before = answered(publisher.batches)
    outcomes = control_plane.publish_replicas(sent)

    assert [o.record for o in outcomes] == sent
    assert [o.ttl_ms for o in outcomes[:7]] == [60_000] * 7
    assert_refused_as_not_ours(outcomes[-1])
    assert {r.block_key for r in ours} <= stored_keys(publisher)
    # Eight records are refused whole as too many (413), then two halves of four, then the
    # four pairs are taken; not one single PUT.
    assert grew(before, answered(publisher.batches)) == {
        ("replicas", "POST", "413"): 3,
        ("replicas", "POST", "200"): 4,
    }


def test_a_batch_stays_within_the_body_limit(publisher, node_of, settings):
    node_of(publisher.batches)
    ours = records(publisher, 3)
    one = max(len(orjson.dumps(r.to_json())) + 1 for r in ours)
    # Room for one record in a body besides {"records": [...]}, not for two.
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 + one + one // 2
    before = answered(publisher.batches)
    outcomes = control_plane.publish_replicas(ours)
    assert all(o.published for o in outcomes)
    assert {r.block_key for r in ours} <= stored_keys(publisher)
    assert grew(before, answered(publisher.batches)) == {("replicas", "POST", "200"): 3}


def test_a_control_plane_without_the_batch_route_gets_single_puts(publisher, node_of):
    node_of(publisher.spec_only)
    ours = records(publisher, 5)
    before = answered(publisher.spec_only)
    outcomes = control_plane.publish_replicas([*ours, not_ours(publisher)])

    assert [o.ttl_ms for o in outcomes[:5]] == [60_000] * 5
    assert_refused_as_not_ours(outcomes[-1])
    assert {r.block_key for r in ours} <= stored_keys(publisher)
    assert grew(before, answered(publisher.spec_only)) == {
        ("unmatched", "POST", "404"): 1,
        ("replica", "PUT", "201"): 5,
        ("replica", "PUT", "403"): 1,
    }
    # Such a control plane is remembered: the next records go as PUTs at once.
    before = answered(publisher.spec_only)
    later = records(publisher, 2)
    assert all(o.published for o in control_plane.publish_replicas(later))
    assert grew(before, answered(publisher.spec_only)) == {("replica", "PUT", "201"): 2}


def test_a_control_plane_out_of_reach_is_every_records_outcome(publisher, settings):
    settings.KVSP_CONTROL_URL = "http://127.0.0.1:9/kvsp/"
    settings.KVSP_TOKEN = publisher.token
    outcomes = control_plane.publish_replicas(records(publisher, 3))
    assert len(outcomes) == 3
    assert all(isinstance(o.error, control_plane.PeerUnreachable) for o in outcomes)


def ids_of(record: ReplicaRecord) -> tuple[bytes, bytes, bytes]:
    return (record.compat_id_bytes, record.scope_id_bytes, record.block_key_bytes)


@pytest.mark.parametrize("which", ["batches", "spec_only"])
def test_withdrawals_go_together_or_one_by_one(publisher, node_of, settings, which):
    server = getattr(publisher, which)
    node_of(server)
    settings.KVSP_PUBLIC_URL = publisher.holder
    ours = records(publisher, 2)
    assert all(o.published for o in control_plane.publish_replicas(ours))
    unknown = records(publisher, 1)[0]  # never published: nothing to withdraw, which is fine
    before = answered(server)
    errors = control_plane.withdraw_replicas([*map(ids_of, ours), ids_of(unknown)])
    assert errors == [None] * 3
    assert not {r.block_key for r in ours} & stored_keys(publisher)
    if which == "batches":
        expected = {("replica-withdrawals", "POST", "200"): 1}
    else:
        expected = {
            ("unmatched", "POST", "404"): 1,
            ("replica", "DELETE", "204"): 2,
            ("replica", "DELETE", "404"): 1,
        }
    assert grew(before, answered(server)) == expected


def test_a_withdrawal_the_control_plane_refuses_is_that_replicas_error(
    publisher, node_of, settings
):
    node_of(publisher.batches)
    settings.KVSP_PUBLIC_URL = HOLDER_B  # a holder the publisher does not act for
    errors = control_plane.withdraw_replicas([ids_of(r) for r in records(publisher, 2)])
    assert [(e.problem, e.status) for e in errors] == [("kvsp-forbidden", 403)] * 2
