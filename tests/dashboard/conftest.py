"""A cluster with something in every section of the dashboard, built through the API and the
services: instances that report, replicas in three tiers at two holders, lookups, a placement
with its directive, a session with tokens, a Shard Map with a reshard under way, a lease."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.utils import timezone

from index import metrics
from index.authentication import principal_for_token
from index.models import Principal
from placement import resharding
from sessions import streams
from tests.placement.conftest import HOLDER, cluster  # noqa: F401 - the constructed cluster
from tests.support.fixtures import make_caller, make_instance, replica_json, report, status_record

II1_URL = "http://ii1.test/kvsp/"
II2_URL = "http://ii2.test/kvsp/"
LINKS = [{"holder": HOLDER, "mbit_per_s": 100_000, "rtt_us": 10}]


def checkpoint_document(built, session: str, *, offset: int, generated: list[int]) -> dict:
    """A checkpoint (6.8) of a session on the prompt of a constructed cluster."""
    return {
        "session": session,
        "epoch": 1,
        "compat_id": built.compat,
        "scope_id": built.scope.scope_id_hex,
        "prompt_blocks": built.keys,
        "prompt_tail": built.tokens[len(built.keys) * 16 :],
        "generated": generated,
        "output_offset": offset,
        "sampler": {
            "method": "greedy",
            "params": {},
            "seed": 0,
            "step": offset,
            "deterministic": True,
        },
    }


@dataclass
class Scene:
    cluster: object
    ii1: object  # the caller that speaks for instance ii1
    ii2: object
    session: str
    operation_id: int


def publish(caller, built, key: str, holder: str, tier: str, *, layers: int = 4) -> None:
    """Publish a replica of one of the constructed cluster's blocks, all in one tier."""
    record = replica_json(
        built.scope.scope_id_hex,
        built.compat,
        key,
        holder,
        layers=layers,
        residency=[{"tier": tier, "layers": [0, layers - 1]}],
    )
    path = f"/kvsp/replicas/{built.compat}/{built.scope.scope_id_hex}/{key}"
    assert caller.put(path, record).status_code in (200, 201)


def lease_for(principal_name: str, instance: str, octets: int):
    from workers.models import Lease

    now = timezone.now()
    return Lease.objects.create(
        lease=secrets.token_hex(16),
        instance=instance,
        principal=Principal.objects.get(name=principal_name),
        compat_id=b"\x01" * 32,
        scope_id=b"\x02" * 16,
        block_keys=b"\x03" * 64,
        octets=octets,
        ttl_ms=30_000,
        expires_at=now + timedelta(seconds=30),
        created_at=now,
    )


@pytest.fixture
def scene(cluster):  # noqa: F811 - the fixture imported above
    ii1 = make_instance("ii1", II1_URL, scopes=[cluster.scope])
    ii2 = make_instance("ii2", II2_URL, scopes=[cluster.scope])
    figures = {"running": 3, "queued": 1, "batch_size": 8, "kv_utilization": 0.42}
    assert report(ii1, "ii1", status_record(II1_URL, links=LINKS, **figures)).status_code == 200
    assert report(ii2, "ii2", status_record(II2_URL, links=LINKS, ttl_ms=60_000)).status_code == 200

    # Two blocks at the shared holder (device, host), one at ii1 on disk.
    publish(cluster.holder, cluster, cluster.keys[0], HOLDER, "device")
    publish(cluster.holder, cluster, cluster.keys[1], HOLDER, "host")
    publish(ii1, cluster, cluster.keys[2], II1_URL, "disk")

    # One lookup that matches two of four blocks; one placement that sends a directive.
    lookup = {
        "scope_id": cluster.scope.scope_id_hex,
        "compat_id": cluster.compat,
        "block_keys": cluster.keys,
    }
    assert cluster.router.post("/kvsp/lookup", lookup).status_code == 200
    assert cluster.place(request_ref="req-dash").status_code == 200

    session = str(uuid.uuid4())
    generated = [500, 501, 502]
    document = checkpoint_document(cluster, session, offset=3, generated=generated)
    assert ii1.put(f"/kvsp/sessions/{session}/checkpoint", document).status_code == 201
    tokens = [{"epoch": 1, "index": i, "token": t} for i, t in enumerate(generated)]
    assert ii1.post(f"/kvsp/sessions/{session}/output", tokens).status_code == 200
    streams.do_open_stream(principal_for_token(cluster.router.token), uuid.UUID(session))

    shards = [
        {"tokens": [0, 4096], "instance": II1_URL},
        {"tokens": [4096, 8192], "instance": II2_URL},
    ]
    resharding.do_put_shard_map("ctx-1", {"map": "ctx-1", "version": 1, "shards": shards})
    moved = [
        {"tokens": [0, 2048], "instance": II1_URL},
        {"tokens": [2048, 8192], "instance": II2_URL},
    ]
    operation = resharding.do_start_reshard("ctx-1", {"shards": moved, "deadline_ms": 60_000})

    lease_for(cluster.router.name, "ii1", 3 * 1024 * 1024)
    metrics.lookup_tally.write()
    return Scene(cluster, ii1, ii2, session, operation.pk)


@pytest.fixture
def operator_client(client, django_user_model):
    """A logged-in staff member with no permissions at all: may look, may not act."""
    user = django_user_model.objects.create_user("watcher", password="watching-only", is_staff=True)
    client.force_login(user)
    return client


@pytest.fixture
def controller():
    return make_caller("pc", controller=True)
