"""The loader's block client (``workers.fetch``): GETs over kept-alive connections, each body
read into its container's buffer and verified (spec 6.7), against a real holder on loopback;
and what a holder's failures mean, as the peer client's one policy says (``common.peers``): out
of reach, too slow or 5xx is transient (``PeerUnreachable``, which tasks retry), a refusal with
problem details final (a ``ProtocolError`` of the holder's type, which nothing retries)."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from common.peers import BlockConnections, PeerUnreachable
from common.tasks import RETRYABLE
from kvsp.problems import ProtocolError, problem_document
from kvsp.records import LeaseRequest, ReplicaRecord
from tests.node.support import StandinHolder, container, random_key
from workers import fetch

COMPAT = os.urandom(32).hex()
SCOPE = os.urandom(16).hex()


@pytest.fixture
def holder():
    with StandinHolder() as standin:
        yield standin


def held(holder: StandinHolder, seed: int) -> ReplicaRecord:
    key = random_key()
    holder.blocks[key] = container(seed)
    return ReplicaRecord.from_json(holder.record(COMPAT, SCOPE, key))


def get(connections, holder, record, **options) -> fetch.FetchedBlock:
    return fetch.fetch_block(connections, holder.url, record, max_size=1 << 20, **options)


def test_blocks_come_over_one_kept_alive_connection_verified(holder):
    records = [held(holder, seed) for seed in range(8)]
    with BlockConnections({"Authorization": "Bearer t"}) as connections:
        for record in records:
            fetched = get(connections, holder, record)
            assert bytes(fetched.buffer) == holder.blocks[record.block_key]
            assert [d.hex() for d in fetched.layer_digests] == list(record.layer_digests)
    assert holder.connections == 1
    assert {authorization for _, _, authorization in holder.received} == {"Bearer t"}


def test_a_token_given_per_request_replaces_the_connections_own(holder):
    record = held(holder, 1)
    with BlockConnections({"Authorization": "Bearer own"}) as connections:
        get(connections, holder, record, token="delegated")
    assert holder.received[-1][2] == "Bearer delegated"


def test_a_miss_keeps_the_connection_for_the_next_block(holder):
    record = held(holder, 2)
    del holder.blocks[record.block_key]
    with BlockConnections() as connections:
        with pytest.raises(fetch.SourceMiss):
            get(connections, holder, record)
        holder.blocks[record.block_key] = container(2)
        assert bytes(get(connections, holder, record).buffer) == container(2)
    assert holder.connections == 1


def test_a_connection_the_holder_dropped_while_idle_is_replaced_and_the_get_sent_again(holder):
    holder.drop_idle = True
    records = [held(holder, seed) for seed in range(3)]
    with BlockConnections() as connections:
        for record in records:
            assert bytes(get(connections, holder, record).buffer) == holder.blocks[record.block_key]
    assert holder.connections == 3
    assert [method for method, _, _ in holder.received] == ["GET"] * 3


def test_octets_that_differ_from_the_record_are_refused_and_the_next_block_still_loads(holder):
    damaged, intact = held(holder, 3), held(holder, 4)
    holder.served[damaged.block_key] = container(99)
    with BlockConnections() as connections:
        with pytest.raises(ProtocolError) as refused:
            get(connections, holder, damaged)
        assert refused.value.problem == "kvsp-digest-mismatch"
        assert bytes(get(connections, holder, intact).buffer) == holder.blocks[intact.block_key]


def test_a_block_still_arriving_at_the_deadline_is_given_up(holder):
    record = held(holder, 5)
    holder.trickle_s[record.block_key] = 10.0
    started = time.monotonic()
    with BlockConnections() as connections:
        with pytest.raises(fetch.DeadlineExpired):
            get(connections, holder, record, deadline=time.monotonic() + 0.3)
    # Given up between two pieces of the body, long before its last one.
    assert time.monotonic() - started < 5.0


def test_an_unreachable_holder_is_transient(holder):
    record = held(holder, 6)
    unreachable = "http://127.0.0.1:9/kvsp/"
    elsewhere = ReplicaRecord.from_json({**record.to_json(), "holder": unreachable})
    with BlockConnections() as connections:
        with pytest.raises(PeerUnreachable) as refused:
            fetch.fetch_block(connections, unreachable, elsewhere, max_size=1 << 20)
    assert isinstance(refused.value, RETRYABLE)


def unavailable() -> dict:
    return problem_document("kvsp-unavailable", "the holder is restarting", status=503)


def test_a_holder_answering_503_is_transient_and_keeps_the_connection(holder):
    record = held(holder, 7)
    holder.answers[record.block_key] = [(503, unavailable())]
    with BlockConnections() as connections:
        with pytest.raises(PeerUnreachable) as refused:
            get(connections, holder, record)
        assert isinstance(refused.value, RETRYABLE)
        assert "503" in str(refused.value) and "restarting" in str(refused.value)
        # Asked again, the holder serves it, over the same connection.
        assert bytes(get(connections, holder, record).buffer) == holder.blocks[record.block_key]
    assert holder.gets.count(record.block_key) == 2
    assert holder.connections == 1


def test_any_5xx_is_transient_whatever_its_body(holder):
    record = held(holder, 8)
    holder.answers[record.block_key] = [
        (500, problem_document("kvsp-forbidden", "not a 4xx's problem", status=500)),
        (502, {"not": "problem details"}),
    ]
    with BlockConnections() as connections:
        for _ in range(2):
            with pytest.raises(PeerUnreachable):
                get(connections, holder, record)


def test_a_refusal_with_problem_details_is_final_and_keeps_its_type(holder):
    record = held(holder, 9)
    forbidden = problem_document("kvsp-forbidden", "not for this principal", status=403)
    holder.answers[record.block_key] = [(403, forbidden)]
    with BlockConnections() as connections:
        with pytest.raises(ProtocolError) as refused:
            get(connections, holder, record)
    assert not isinstance(refused.value, RETRYABLE)
    assert (refused.value.problem, refused.value.status) == ("kvsp-forbidden", 403)
    assert "not for this principal" in refused.value.detail


def test_a_4xx_without_problem_details_of_ours_is_a_final_upstream_error(holder):
    record = held(holder, 10)
    holder.answers[record.block_key] = [(418, {"type": "about:blank", "title": "teapot"})]
    with BlockConnections() as connections:
        with pytest.raises(ProtocolError) as refused:
            get(connections, holder, record)
    assert not isinstance(refused.value, RETRYABLE)
    assert refused.value.problem == "kvsp-upstream-error" and "418" in refused.value.detail


def test_a_lease_follows_the_same_policy(holder):
    record = held(holder, 11)
    request = LeaseRequest(
        compat_id=COMPAT, scope_id=SCOPE, block_keys=(record.block_key,), ttl_ms=1000
    )
    with httpx.Client() as client:
        with pytest.raises(PeerUnreachable):
            fetch.take_lease(client, "http://127.0.0.1:9/kvsp/", request)
        lease = fetch.take_lease(client, holder.url, request)
        assert lease.grant.block_keys == (record.block_key,)
        missing = LeaseRequest(
            compat_id=COMPAT, scope_id=SCOPE, block_keys=(random_key(),), ttl_ms=1000
        )
        with pytest.raises(fetch.SourceMiss):
            fetch.take_lease(client, holder.url, missing)
