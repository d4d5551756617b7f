"""Tenant isolation on a holder: one scope cannot evict another's blocks beyond its quota.

Besides the package's cluster, this module starts two storage nodes (their HTTP servers only)
whose tiers hold exactly two blocks of host and four of disk, six in all:

- ``q1`` has the default quota, an equal share of the node among the scopes holding blocks
  there: three blocks each once both tenants store;
- ``q2`` has a fixed quota of two blocks (``KVSP_SCOPE_QUOTA_OCTETS``).

The tests of each node run in order on its state, like the tier tests. The planning function
is also tested on rows alone, for the rule's edges and its query count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from kvsp.problems import ProtocolError
from tests.node.conftest import BLOCK_OCTETS, Node, extra_node, serving_http
from tests.node.support import container, counted, problem, random_key
from tests.support.waiting import wait_until
from workers import eviction, tiers
from workers.models import StoredBlock

pytestmark = pytest.mark.django_db

NODE_TIERS = {
    "KVSP_TIER_HOST_OCTETS": str(2 * BLOCK_OCTETS),
    "KVSP_TIER_DISK_OCTETS": str(4 * BLOCK_OCTETS),
    "KVSP_TIER_DEVICE_OCTETS": "0",
}


@dataclass
class Tenant:
    scope: str
    reader: str  # the token of a principal of the scope


@pytest.fixture(scope="module")
def quota_nodes(cluster, django_db_blocker, role_env, log_dir):
    run = os.urandom(3).hex()
    settings_of = {"q1": {}, "q2": {"KVSP_SCOPE_QUOTA_OCTETS": str(2 * BLOCK_OCTETS)}}
    scope_ids = [bytes.fromhex(cluster.scope_a), bytes.fromhex(cluster.scope_b)]
    nodes: dict[str, Node] = {}
    with django_db_blocker.unblock():
        for key, extra in settings_of.items():
            nodes[key] = extra_node(
                cluster, role_env, log_dir, f"{key}-{run}", scope_ids, **NODE_TIERS, **extra
            )
    # PUTs, GETs, leases and records are all the HTTP process's: no worker is needed.
    with serving_http(nodes):
        yield nodes


@pytest.fixture(scope="module")
def tenants(cluster):
    return {
        "a": Tenant(cluster.scope_a, cluster.tokens["reader_a"]),
        "b": Tenant(cluster.scope_b, cluster.tokens["reader_b"]),
    }


@pytest.fixture(scope="module")
def q1_keys():
    """The keys the q1 tests store, in order, and the seeds of their containers."""
    return {"a": [random_key() for _ in range(8)], "b": [random_key() for _ in range(6)]}


def put(cluster, node: Node, tenant: Tenant, key: str, seed: int):
    return node.api(tenant.reader).put_block(cluster.compat, tenant.scope, key, container(seed))


def get(cluster, node: Node, tenant: Tenant, key: str):
    return node.api(tenant.reader).get_block(cluster.compat, tenant.scope, key)


def published_at(cluster, node: Node, tenant: Tenant, key: str) -> bool:
    """Whether the IS has a record of the block at ``node``."""
    response = cluster.control("controller").get(f"replicas/{cluster.compat}/{tenant.scope}/{key}")
    replicas = response.json()["replicas"] if response.status_code == 200 else []
    return any(replica["holder"] == node.url for replica in replicas)


def held_keys(node: Node, tenant: Tenant) -> set[str]:
    """The keys of a tenant's blocks on ``node``, from the names of its files."""
    names = [path.name.split(".") for path in node.host_files() + node.disk_files()]
    return {parts[2] for parts in names if len(parts) == 4 and parts[1] == tenant.scope}


def tier_of(node: Node, key: str) -> str | None:
    if any(key in path.name for path in node.host_files()):
        return tiers.HOST
    if any(key in path.name for path in node.disk_files()):
        return tiers.DISK
    return None


# --- Equal shares (q1) --------------------------------------------------------------------------


def test_a_lone_scope_fills_the_whole_node_evicting_its_own_lru_blocks(
    cluster, quota_nodes, tenants, q1_keys
):
    q1, a = quota_nodes["q1"], tenants["a"]
    keys = q1_keys["a"]
    for seed, key in enumerate(keys, start=700):
        assert put(cluster, q1, a, key, seed).status_code == 201

    # Six blocks fit (two host, four disk); the seventh and eighth took the two oldest.
    assert held_keys(q1, a) == set(keys[2:])
    assert {tier_of(q1, key) for key in keys[6:]} == {tiers.HOST}
    assert {tier_of(q1, key) for key in keys[2:6]} == {tiers.DISK}
    for key in keys[:2]:
        assert not published_at(cluster, q1, a, key)
        assert get(cluster, q1, a, key).status_code == 404
    for key in keys[2:]:
        assert published_at(cluster, q1, a, key)


def test_a_newcomer_reclaims_its_share_and_then_evicts_only_its_own(
    cluster, quota_nodes, tenants, q1_keys
):
    q1, a, b = quota_nodes["q1"], tenants["a"], tenants["b"]
    a_keys, b_keys = q1_keys["a"], q1_keys["b"][:5]
    for count, (seed, key) in enumerate(enumerate(b_keys, start=720), start=1):
        assert put(cluster, q1, b, key, seed).status_code == 201
        # B takes A's least recently used blocks until A is down to its share (three of six),
        # and never further.
        assert held_keys(q1, a) == set(a_keys[2 + min(count, 3) :])
        assert held_keys(q1, b) == set(b_keys[max(count - 3, 0) : count])

    for key in a_keys[2:5]:  # evicted for B: withdrawn
        assert not published_at(cluster, q1, a, key)
        assert get(cluster, q1, a, key).status_code == 404
    for key in a_keys[5:]:  # A's share: kept, moved to disk
        assert published_at(cluster, q1, a, key)
        assert tier_of(q1, key) == tiers.DISK
    for key in b_keys[:2]:  # B's own, evicted once A was at its share
        assert not published_at(cluster, q1, b, key)
    for key in b_keys[2:]:
        assert published_at(cluster, q1, b, key)
    assert [tier_of(q1, key) for key in b_keys[2:]] == [tiers.DISK, tiers.HOST, tiers.HOST]


def test_the_node_counts_its_evictions_by_cause_and_the_octets_it_moved(quota_nodes):
    """So far on q1: A evicted two of its own for room, B three of A's (over its share) and
    then two of its own; what moved from host to disk went in whole blocks."""
    q1 = quota_nodes["q1"]
    expected = {"capacity": 4, "scope_quota": 3}
    # The server writes its counts after a response, at most once a second: each scrape is one.
    wait_until(lambda: counted(q1, "kvsp_evictions", "cause") == expected, "the evictions counted")
    octets = counted(q1, "kvsp_evicted_octets", "cause")
    assert octets == {cause: n * BLOCK_OCTETS for cause, n in expected.items()}
    moved = counted(q1, "kvsp_tier_moved_octets", "to_tier")
    assert set(moved) == {"disk"} and moved["disk"] % BLOCK_OCTETS == 0 and moved["disk"] > 0


def test_a_store_blocked_by_another_scope_at_its_quota_is_refused_and_changes_nothing(
    cluster, quota_nodes, tenants, q1_keys
):
    """B's own blocks are leased, and A holds exactly its share: no block may go."""
    q1, a, b = quota_nodes["q1"], tenants["a"], tenants["b"]
    a_kept, b_kept = q1_keys["a"][5:], q1_keys["b"][2:5]
    extra = q1_keys["b"][5]
    api = q1.api(b.reader)
    lease = api.post(
        "leases",
        json={
            "compat_id": cluster.compat,
            "scope_id": b.scope,
            "block_keys": b_kept,
            "ttl_ms": 30_000,
        },
    )
    assert lease.status_code == 201
    files = {path: path.read_bytes() for path in q1.host_files() + q1.disk_files()}

    refused = put(cluster, q1, b, extra, 730)
    assert refused.status_code == 503 and problem(refused) == "kvsp-unavailable"
    assert {path: path.read_bytes() for path in q1.host_files() + q1.disk_files()} == files
    assert get(cluster, q1, b, extra).status_code == 404
    for tenant, keys in ((a, a_kept), (b, b_kept)):
        for key in keys:
            assert published_at(cluster, q1, tenant, key)
    assert not published_at(cluster, q1, b, extra)

    # Without the lease, B's own least recently used block makes room, and A keeps its share.
    assert api.delete(f"leases/{lease.json()['lease']}").status_code == 204
    assert put(cluster, q1, b, extra, 730).status_code == 201
    assert held_keys(q1, a) == set(a_kept)
    assert held_keys(q1, b) == {*b_kept[1:], extra}
    assert not published_at(cluster, q1, b, b_kept[0])


# --- A fixed quota (q2) -------------------------------------------------------------------------


def test_with_a_fixed_quota_a_scope_over_it_evicts_only_its_own(cluster, quota_nodes, tenants):
    q2, a, b = quota_nodes["q2"], tenants["a"], tenants["b"]
    b_keys = [random_key() for _ in range(5)]
    a_keys = [random_key() for _ in range(6)]
    # B's two blocks (its quota) first, so that they are the least recently used on disk.
    for seed, key in enumerate(b_keys[:2], start=740):
        assert put(cluster, q2, b, key, seed).status_code == 201
    for seed, key in enumerate(a_keys[:4], start=750):
        assert put(cluster, q2, a, key, seed).status_code == 201
    assert [tier_of(q2, key) for key in (*b_keys[:2], *a_keys[:2])] == [tiers.DISK] * 4

    # A is over its quota: its stores take its own blocks, though B's are older.
    for seed, key in enumerate(a_keys[4:], start=754):
        assert put(cluster, q2, a, key, seed).status_code == 201
    assert held_keys(q2, b) == set(b_keys[:2])
    assert held_keys(q2, a) == set(a_keys[2:])
    for key in b_keys[:2]:
        assert published_at(cluster, q2, b, key)
    for key in a_keys[:2]:
        assert not published_at(cluster, q2, a, key)

    # B's blocks read again, A's are now the least recently used: B, at its quota, may take
    # them while A holds more than its own, and then only its own.
    for key in b_keys[:2]:
        assert get(cluster, q2, b, key).status_code == 200
    for count, (seed, key) in enumerate(enumerate(b_keys[2:], start=760), start=1):
        assert put(cluster, q2, b, key, seed).status_code == 201
        assert held_keys(q2, a) == set(a_keys[2 + min(count, 2) :])
    assert held_keys(q2, b) == set(b_keys[1:])
    for key in a_keys[2:4]:
        assert not published_at(cluster, q2, a, key)
    for key in a_keys[4:]:
        assert published_at(cluster, q2, a, key)
    assert not published_at(cluster, q2, b, b_keys[0])


# --- The plan on rows alone ---------------------------------------------------------------------

SIZE = 100
COMPAT = b"\x01" * 32
SCOPE_A, SCOPE_B, SCOPE_C = b"\xaa" * 16, b"\xbb" * 16, b"\xcc" * 16
ROWS_TIERS = {"KVSP_TIER_HOST_OCTETS": 2 * SIZE, "KVSP_TIER_DISK_OCTETS": 4 * SIZE}


def stored(instance: str, layout: list[tuple[bytes, str]]) -> list[StoredBlock]:
    """Rows for blocks of SIZE octets, least recently used first."""
    start = timezone.now() - timedelta(hours=1)
    rows = []
    for index, (scope_id, tier) in enumerate(layout):
        at = start + timedelta(seconds=index)
        rows.append(
            StoredBlock(
                instance=instance,
                compat_id=COMPAT,
                scope_id=scope_id,
                block_key=os.urandom(32),
                codec=1,
                size=SIZE,
                token_count=16,
                layer_count=4,
                digest=b"\x00" * 32,
                layer_digests=b"\x00" * 32 * 4,
                repr_sha256=b"\x00" * 32,
                tier=tier,
                stored_at=at,
                last_access=at,
                refresh_due_at=at,
            )
        )
    return StoredBlock.objects.bulk_create(rows)


def full_node(instance: str, disk_scopes, host_scopes) -> list[StoredBlock]:
    return stored(
        instance,
        [(scope, tiers.DISK) for scope in disk_scopes]
        + [(scope, tiers.HOST) for scope in host_scopes],
    )


@override_settings(**ROWS_TIERS, KVSP_SCOPE_QUOTA_OCTETS=0)
def test_the_plan_spares_a_scope_at_its_share_and_takes_the_storing_scopes_own():
    # Three blocks each, A's the least recently used on disk.
    rows = full_node("rows1", [SCOPE_A, SCOPE_B, SCOPE_A, SCOPE_A], [SCOPE_B, SCOPE_B])
    now = timezone.now()

    plan = eviction.plan_room_on_node("rows1", SCOPE_B, SIZE, now)
    assert (plan.tier, plan.demote, plan.evict) == (tiers.HOST, [rows[4]], [rows[1]])
    plan = eviction.plan_room_on_node("rows1", SCOPE_A, SIZE, now)
    assert (plan.tier, plan.demote, plan.evict) == (tiers.HOST, [rows[4]], [rows[0]])
    # A third scope's share is two blocks: it may take one of A's, the least recently used.
    plan = eviction.plan_room_on_node("rows1", SCOPE_C, SIZE, now)
    assert (plan.tier, plan.demote, plan.evict) == (tiers.HOST, [rows[4]], [rows[0]])
    # Too large for the host tier: disk directly, under the same rule.
    plan = eviction.plan_room_on_node("rows1", SCOPE_A, 3 * SIZE, now)
    assert (plan.tier, plan.demote, plan.evict) == (tiers.DISK, [], [rows[0], rows[2], rows[3]])


@override_settings(**ROWS_TIERS, KVSP_SCOPE_QUOTA_OCTETS=0)
def test_the_plan_refuses_what_only_other_scopes_within_their_share_could_make_room_for():
    rows = full_node("rows2", [SCOPE_A, SCOPE_A, SCOPE_A, SCOPE_B], [SCOPE_B, SCOPE_B])
    now = timezone.now()
    # A newcomer's share is two blocks: A and B may each lose one, no more.
    with pytest.raises(ProtocolError) as refused:
        eviction.plan_room_on_node("rows2", SCOPE_C, 3 * SIZE, now)
    assert refused.value.problem_type.name == "kvsp-unavailable"
    plan = eviction.plan_room_on_node("rows2", SCOPE_C, 2 * SIZE, now)
    assert (plan.tier, plan.evict) == (tiers.HOST, [rows[0], rows[3]])
    assert plan.demote == [rows[4], rows[5]]
    assert StoredBlock.objects.filter(instance="rows2").count() == 6  # a plan changes nothing


@override_settings(**ROWS_TIERS, KVSP_SCOPE_QUOTA_OCTETS=6 * SIZE)
def test_with_a_quota_of_the_whole_node_a_full_scope_keeps_everything():
    rows = full_node("rows3", [SCOPE_A] * 4, [SCOPE_A] * 2)
    now = timezone.now()
    with pytest.raises(ProtocolError):
        eviction.plan_room_on_node("rows3", SCOPE_B, SIZE, now)
    plan = eviction.plan_room_on_node("rows3", SCOPE_A, SIZE, now)
    assert (plan.demote, plan.evict) == ([rows[4]], [rows[0]])


@override_settings(**ROWS_TIERS, KVSP_SCOPE_QUOTA_OCTETS=0)
def test_pending_blocks_count_toward_their_scope_and_are_never_taken():
    from workers.models import ReshardMove

    # B holds four blocks, two of them pending for a reshard move: one over its share.
    rows = full_node("rows4", [SCOPE_B, SCOPE_B, SCOPE_B, SCOPE_A], [SCOPE_B, SCOPE_A])
    move = ReshardMove.objects.create(
        instance="rows4", map="m", to_version=2, received_at=timezone.now()
    )
    StoredBlock.objects.filter(pk__in=[rows[0].pk, rows[4].pk]).update(pending_move=move)
    plan = eviction.plan_room_on_node("rows4", SCOPE_A, SIZE, timezone.now())
    assert (plan.tier, plan.demote, plan.evict) == (tiers.HOST, [rows[4]], [rows[1]])


def test_the_plan_weighs_the_scopes_in_one_query_however_many_blocks():
    def queries(instance: str, count: int) -> int:
        scopes = [SCOPE_A, SCOPE_B, SCOPE_C]
        full_node(instance, [scopes[i % 3] for i in range(count)], [SCOPE_A, SCOPE_B])
        with (
            override_settings(
                KVSP_TIER_HOST_OCTETS=2 * SIZE,
                KVSP_TIER_DISK_OCTETS=count * SIZE,
                KVSP_SCOPE_QUOTA_OCTETS=0,
            ),
            CaptureQueriesContext(connection) as captured,
        ):
            eviction.plan_room_on_node(instance, SCOPE_C, SIZE, timezone.now())
        grouped = [q for q in captured.captured_queries if "GROUP BY" in q["sql"]]
        assert len(grouped) == 1
        return len(captured.captured_queries)

    assert queries("rows5", 6) == queries("rows6", 60)
