"""The tier store of a node with tiny tiers (n3: two blocks of host, two of disk, half a block
of device): least recently used blocks move from host to disk and are evicted from disk, never
while leased; the records at the IS follow every move and every eviction; a lost serving copy is
withdrawn even under a lease; the device tier's working copies show in the residency."""

from __future__ import annotations

import pytest

from tests.node.support import (
    SECTION,
    container,
    counted,
    directive_body,
    problem,
    random_key,
    run_directive,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db

HOST_RATE, DISK_RATE = 200_000, 16_000


def records(cluster, key: str) -> list[dict]:
    response = cluster.control("reader_a").get(f"replicas/{cluster.compat}/{cluster.scope_a}/{key}")
    return response.json()["replicas"] if response.status_code == 200 else []


def residency_at(cluster, node, key: str):
    found = [r for r in records(cluster, key) if r["holder"] == node.url]
    return found[0]["residency"] if found else None


def put(cluster, node, key: str, seed: int):
    return node.api(cluster.tokens["reader_a"]).put_block(
        cluster.compat, cluster.scope_a, key, container(seed)
    )


@pytest.fixture(scope="module")
def n3_blocks(cluster):
    """Keys of six fresh blocks the tests put on n3 in order (earlier content is pushed out as
    they arrive), and the lease one test leaves for the next."""
    return {"keys": [random_key() for _ in range(6)], "lease": None}


def test_lru_blocks_move_to_disk_then_leave_with_their_records(cluster, n3_blocks):
    n3 = cluster.node("n3")
    api = n3.api(cluster.tokens["reader_a"])
    b1, b2, b3, b4, b5, _ = n3_blocks["keys"]
    for seed, key in enumerate((b1, b2, b3, b4), start=300):
        assert put(cluster, n3, key, seed).status_code == 201
    for key in (b1, b2):
        assert residency_at(cluster, n3, key) == [
            {"tier": "disk", "layers": [0, 3], "read_mbit_per_s": DISK_RATE}
        ]
    for key in (b3, b4):
        assert residency_at(cluster, n3, key) == [
            {"tier": "host", "layers": [0, 3], "read_mbit_per_s": HOST_RATE}
        ]
    assert len(n3.host_files()) == 2 and len(n3.disk_files()) == 2

    # b1 is read, so b2 is now the least recently used block on disk and goes when b5 pushes
    # b3 down.
    assert api.get_block(cluster.compat, cluster.scope_a, b1).status_code == 200
    assert put(cluster, n3, b5, 304).status_code == 201
    assert residency_at(cluster, n3, b2) is None
    assert api.get_block(cluster.compat, cluster.scope_a, b2).status_code == 404
    assert residency_at(cluster, n3, b1)[0]["tier"] == "disk"
    assert residency_at(cluster, n3, b3)[0]["tier"] == "disk"
    assert residency_at(cluster, n3, b5)[0]["tier"] == "host"
    assert len(n3.host_files()) == 2 and len(n3.disk_files()) == 2


def test_leased_blocks_are_never_evicted(cluster, n3_blocks):
    n3 = cluster.node("n3")
    api = n3.api(cluster.tokens["reader_a"])
    b1, _, b3, b4, _, b6 = n3_blocks["keys"]
    lease = {
        "compat_id": cluster.compat,
        "scope_id": cluster.scope_a,
        "block_keys": [b1, b3],
        "ttl_ms": 30_000,
    }
    created = api.post("leases", json=lease)
    assert created.status_code == 201
    files = n3.host_files() + n3.disk_files()

    # Room for b6 means moving b4 to disk, and disk holds only leased blocks.
    refused = put(cluster, n3, b6, 305)
    assert refused.status_code == 503 and problem(refused) == "kvsp-unavailable"
    assert api.get_block(cluster.compat, cluster.scope_a, b6).status_code == 404
    assert n3.host_files() + n3.disk_files() == files
    for key in (b1, b3):
        assert api.get_block(cluster.compat, cluster.scope_a, key).status_code == 200
    for key in (b1, b3, b4, n3_blocks["keys"][4]):
        assert residency_at(cluster, n3, key) is not None

    # Only b1 stays leased: b3 may go now.
    lease_id = created.json()["lease"]
    assert api.delete(f"leases/{lease_id}").status_code == 204
    kept = api.post("leases", json={**lease, "block_keys": [b1]})
    assert kept.status_code == 201
    assert put(cluster, n3, b6, 305).status_code == 201
    assert residency_at(cluster, n3, b3) is None
    assert residency_at(cluster, n3, b1)[0]["tier"] == "disk"
    assert residency_at(cluster, n3, b4)[0]["tier"] == "disk"
    n3_blocks["lease"] = kept.json()["lease"]


def test_a_lost_copy_is_withdrawn_even_under_a_lease(cluster, n3_blocks):
    n3 = cluster.node("n3")
    api = n3.api(cluster.tokens["reader_a"])
    b1 = n3_blocks["keys"][0]
    lease_id = n3_blocks["lease"]
    [path] = [p for p in n3.disk_files() if b1 in p.name]
    path.unlink()  # the disk lost it
    faults = counted(n3, "kvsp_evictions", "cause").get("fault", 0)

    missing = api.get_block(cluster.compat, cluster.scope_a, b1)
    assert missing.status_code == 404 and problem(missing) == "kvsp-not-found"
    assert residency_at(cluster, n3, b1) is None
    # Counted as a fault; a server writes its counts after a response, at most once a second.
    wait_until(
        lambda: counted(n3, "kvsp_evictions", "cause").get("fault") == faults + 1,
        "the fault counted",
    )
    from workers.models import Lease

    lease = Lease.objects.get(lease=lease_id)
    assert lease.blocks.count() == 0  # the lease stays; the block it named is gone
    assert api.delete(f"leases/{lease_id}").status_code == 204


def test_device_tier_holds_leading_layers_and_the_record_says_so(cluster):
    """Half a block of device tier: a prefetched block keeps layers 0-1 there; the next
    prefetched block takes the room, and the first one's record goes back to host only. Each
    working copy counts as octets moved from the host tier to the device; letting one go
    moves nothing."""
    n1, n3 = cluster.node("n1"), cluster.node("n3")
    keys = [random_key() for _ in range(2)]
    for seed, key in enumerate(keys, start=320):
        assert put(cluster, n1, key, seed).status_code == 201
    moved_before = counted(n3, "kvsp_tier_moved_octets", "to_tier").get("device", 0)

    def prefetch(key):
        state = run_directive(cluster, n3, directive_body(cluster, [(key, [n1.url])]))
        assert state["state"] == "complete"

    prefetch(keys[0])
    split = [
        {"tier": "device", "layers": [0, 1], "read_mbit_per_s": HOST_RATE},
        {"tier": "host", "layers": [2, 3], "read_mbit_per_s": HOST_RATE},
    ]
    assert residency_at(cluster, n3, keys[0]) == split
    prefetch(keys[1])
    assert residency_at(cluster, n3, keys[1]) == split
    assert residency_at(cluster, n3, keys[0]) == [
        {"tier": "host", "layers": [0, 3], "read_mbit_per_s": HOST_RATE}
    ]
    # Two copies of layers 0-1, K and V: four sections each. The worker writes its counts
    # after each task; a scrape reads them.
    copied = 2 * 4 * SECTION
    wait_until(
        lambda: (
            counted(n3, "kvsp_tier_moved_octets", "to_tier").get("device", 0)
            == moved_before + copied
        ),
        "the device copies counted",
    )
    from common.models import CounterTotal

    into_device = CounterTotal.objects.filter(
        name="kvsp_tier_moved_octets", labels__endswith=',"device"]'
    ).values_list("labels", flat=True)
    assert {labels for labels in into_device if f'"{n3.name}"' in labels} == {
        f'["{n3.name}","host","device"]'
    }
