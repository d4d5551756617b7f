"""Prefetch directives on real nodes (spec 6.5): from a peer, with a lease at the source and
every digest verified; a source that sends wrong octets or lacks the block is passed over; no
working source fails the directive, unless a source failed only for now (5xx), which the task
asks again; the deadline makes it partial."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvsp.problems import problem_document
from tests.node.support import (
    assert_problems,
    blocks_sent,
    container,
    counted,
    directive_body,
    problem,
    put_chain,
    random_key,
    run_directive,
    sha256,
    store,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db


def holders_of(cluster, key: str) -> set[str]:
    response = cluster.control("reader_a").get(f"replicas/{cluster.compat}/{cluster.scope_a}/{key}")
    return (
        {r["holder"] for r in response.json()["replicas"]} if response.status_code == 200 else set()
    )


def test_publish_lookup_and_prefetch_from_a_peer(cluster):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    chain = put_chain(cluster, n1, 4, 500)
    keys = [key for key, _ in chain]
    lookup = cluster.control("controller").post(
        "lookup",
        json={"scope_id": cluster.scope_a, "compat_id": cluster.compat, "block_keys": keys},
    )
    assert lookup.json()["matched"] == 4
    assert all(b["replicas"][0]["holder"] == n1.url for b in lookup.json()["blocks"])

    body = directive_body(cluster, [(key, [n1.url]) for key in keys])
    state = run_directive(cluster, n2, body)
    assert state == {
        "directive": body["directive"],
        "state": "complete",
        "loaded": keys,
        "reason": None,
    }
    reader = n2.api(cluster.tokens["reader_a"])
    for key, data in chain:
        got = reader.get_block(cluster.compat, cluster.scope_a, key)
        assert got.content == data
        assert holders_of(cluster, key) == {n1.url, n2.url}
    # n2's worker keeps working copies on its device tier (CPU here) and says so.
    [record] = [
        r
        for r in cluster.control("reader_a")
        .get(f"replicas/{cluster.compat}/{cluster.scope_a}/{keys[0]}")
        .json()["replicas"]
        if r["holder"] == n2.url
    ]
    assert record["residency"] == [{"tier": "device", "layers": [0, 3], "read_mbit_per_s": 200_000}]

    # The same directive again is the same directive; another body under its id is a conflict.
    controller = n2.api(cluster.tokens["controller"])
    again = controller.post("prefetch", json=body)
    assert again.status_code == 202 and again.json()["state"] == "complete"
    clash = controller.post("prefetch", json={**body, "deadline_ms": 99})
    assert clash.status_code == 409 and problem(clash) == "kvsp-conflict"

    # The link n2 measured to n1 goes into its status reports.
    from placement.models import Instance
    from workers.models import MeasuredLink

    link = MeasuredLink.objects.get(instance=n2.name, holder=n1.url)
    assert link.mbit_per_s > 0 and link.rtt_us > 0

    def reported():
        status = Instance.objects.get(name=n2.name).last_status or {}
        return [entry for entry in status.get("links", []) if entry["holder"] == n1.url]

    assert wait_until(reported, "the measured link in a status report", timeout=10)


def test_the_measured_link_is_the_link_not_the_pipeline(cluster, standin):
    # The stand-in is a 4 Mbit/s link; n1 loads from it on several connections at once and
    # verifies, stores and publishes each block meanwhile: its figure is still the link's.
    from workers.models import MeasuredLink

    n1 = cluster.node("n1")
    keys = [random_key() for _ in range(12)]
    for seed, key in enumerate(keys, start=600):
        standin.add(key, container(seed))
    standin.holder.pace_mbit_per_s = 4.0
    try:
        body = directive_body(cluster, [(key, [standin.holder.url]) for key in keys])
        state = run_directive(cluster, n1, body)
    finally:
        standin.holder.pace_mbit_per_s = 0.0
    assert state["state"] == "complete"
    link = MeasuredLink.objects.get(instance=n1.name, holder=standin.holder.url)
    assert 0.6 * 4.0 <= link.mbit_per_s <= 1.3 * 4.0


def stored_and_wrong_at_the_standin(cluster, standin, node, seed: int) -> tuple[str, bytes]:
    """A block stored on ``node`` that the stand-in holds too but sends as other layers, under
    a Repr-Digest that matches what it sends: only the layer digests of its record give it
    away."""
    key, data = random_key(), container(seed)
    standin.add(key, data)
    standin.holder.served[key] = container(seed + 1)
    store(cluster, node, key, data)
    return key, data


def test_wrong_octets_at_a_source_are_refused_and_the_next_source_used(cluster, standin):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    key, data = stored_and_wrong_at_the_standin(cluster, standin, n1, 510)

    state = run_directive(
        cluster, n2, directive_body(cluster, [(key, [standin.holder.url, n1.url])])
    )
    assert state["state"] == "complete" and state["loaded"] == [key]
    assert key in standin.holder.gets
    got = n2.api(cluster.tokens["reader_a"]).get_block(cluster.compat, cluster.scope_a, key)
    assert got.content == data
    assert not [p for p in n2.host_files() if p.name.startswith(".incoming-")]


def test_only_wrong_sources_fail_the_directive_and_nothing_is_stored(cluster, standin):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    key, data = stored_and_wrong_at_the_standin(cluster, standin, n1, 520)
    # n1's copy is damaged after it was stored: it sends the damaged octets under the
    # Repr-Digest of the original.
    [path] = [p for p in n1.host_files() if key in p.name]
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(damaged)

    state = run_directive(
        cluster, n2, directive_body(cluster, [(key, [n1.url, standin.holder.url])])
    )
    assert state["state"] == "failed" and state["loaded"] == []
    assert "digest" in state["reason"] and n1.url in state["reason"]
    assert standin.holder.url in state["reason"]
    assert (
        n2.api(cluster.tokens["reader_a"])
        .get_block(cluster.compat, cluster.scope_a, key)
        .status_code
        == 404
    )
    assert n2.url not in holders_of(cluster, key)
    assert not [p for p in n2.host_files() if key in p.name or p.name.startswith(".incoming-")]

    # With a good source after the damaged one, the good one is used.
    standin.holder.served.pop(key)
    state = run_directive(
        cluster, n2, directive_body(cluster, [(key, [n1.url, standin.holder.url])])
    )
    assert state["state"] == "complete"
    got = n2.api(cluster.tokens["reader_a"]).get_block(cluster.compat, cluster.scope_a, key)
    assert got.content == data and sha256(got.content) == sha256(data)


def test_a_miss_at_a_source_moves_on_and_no_source_fails(cluster):
    n1, n2, n3 = cluster.node("n1"), cluster.node("n2"), cluster.node("n3")
    [(key, data)] = put_chain(cluster, n1, 1, 530)
    state = run_directive(cluster, n2, directive_body(cluster, [(key, [n3.url, n1.url])]))
    assert state["state"] == "complete" and state["loaded"] == [key]

    nobody = random_key()
    state = run_directive(cluster, n2, directive_body(cluster, [(nobody, [n3.url, n1.url])]))
    assert state["state"] == "failed" and state["loaded"] == []
    assert nobody in state["reason"]


def test_a_source_answering_503_is_asked_again_by_the_directives_task(cluster, standin):
    """A 5xx is transient (``common.peers``): the directive stays pending and its task runs
    again, and the block comes from the source once it serves again."""
    n1 = cluster.node("n1")
    key = random_key()
    standin.add(key, container(570))
    unavailable = problem_document("kvsp-unavailable", "restarting", status=503)
    standin.holder.answers[key] = [(503, unavailable)]
    body = directive_body(cluster, [(key, [standin.holder.url])])
    state = run_directive(cluster, n1, body)
    assert state["state"] == "complete" and state["loaded"] == [key]
    assert standin.holder.gets.count(key) == 2
    got = n1.api(cluster.tokens["reader_a"]).get_block(cluster.compat, cluster.scope_a, key)
    assert got.content == standin.holder.blocks[key]


def test_a_source_refusing_with_problem_details_fails_the_directive_at_once(cluster, standin):
    """A 4xx with problem details is final: no task runs the directive again."""
    n1 = cluster.node("n1")
    key = random_key()
    standin.add(key, container(571))
    forbidden = problem_document("kvsp-forbidden", "not for this principal", status=403)
    standin.holder.answers[key] = [(403, forbidden)]
    state = run_directive(cluster, n1, directive_body(cluster, [(key, [standin.holder.url])]))
    assert state["state"] == "failed" and state["loaded"] == []
    assert "not for this principal" in state["reason"]
    assert standin.holder.gets.count(key) == 1


def test_the_node_counts_the_blocks_its_worker_did_not_load_by_why(cluster, standin):
    """Directives run in the node's Celery worker; its counts show in the node's /metrics."""
    n1, n2, n3 = cluster.node("n1"), cluster.node("n2"), cluster.node("n3")
    before = counted(n2, "kvsp_directive_block_failures", "reason")

    def added() -> dict:
        now = counted(n2, "kvsp_directive_block_failures", "reason")
        return {why: n - before.get(why, 0) for why, n in now.items() if n != before.get(why, 0)}

    # A block nobody holds, then two that come after it: a miss, and what follows it.
    [(key, _)] = put_chain(cluster, n1, 1, 545)
    nobody = random_key()
    blocks = [(nobody, [n3.url, n1.url]), (key, [n1.url]), (random_key(), [n1.url])]
    state = run_directive(cluster, n2, directive_body(cluster, blocks))
    assert state["state"] == "failed" and nobody not in state["loaded"]
    # The fetchers work ahead: what was not loaded after the failure was never asked for.
    expected = {"not_found": 1, "past_failure": 2 - len(state["loaded"])}
    expected = {why: n for why, n in expected.items() if n}
    wait_until(lambda: added() == expected, "the failures counted")

    # Octets that fail their digests at the only source.
    bad, data = random_key(), container(546)
    standin.add(bad, data)
    standin.holder.served[bad] = container(547)
    body = directive_body(cluster, [(bad, [standin.holder.url])])
    assert run_directive(cluster, n2, body)["state"] == "failed"
    expected["digest_mismatch"] = 1
    wait_until(lambda: added() == expected, "the digest mismatch counted")

    # A block loaded counts by the tier it was in at the source that served it: n1's host.
    loaded = counted(n2, "kvsp_directive_loaded_blocks", "tier").get("host", 0)
    [(fresh, _)] = put_chain(cluster, n1, 1, 548)
    body = directive_body(cluster, [(fresh, [n1.url])])
    assert run_directive(cluster, n2, body)["state"] == "complete"
    wait_until(
        lambda: counted(n2, "kvsp_directive_loaded_blocks", "tier").get("host") == loaded + 1,
        "the loaded block counted",
    )


def test_a_failed_block_stops_the_prefix_where_it_is(cluster):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    chain = put_chain(cluster, n1, 2, 540)
    blocks = [(chain[0][0], [n1.url]), (random_key(), [n1.url]), (chain[1][0], [n1.url])]
    state = run_directive(cluster, n2, directive_body(cluster, blocks))
    assert state["state"] == "failed"
    assert state["loaded"][0] == chain[0][0]
    assert blocks[1][0] in state["reason"]


def test_the_blocks_a_source_holds_come_in_batches(cluster):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    chain = put_chain(cluster, n1, 6, 570)
    keys = [key for key, _ in chain]
    before = blocks_sent(n1)
    state = run_directive(cluster, n2, directive_body(cluster, [(key, [n1.url]) for key in keys]))
    assert state["state"] == "complete" and state["loaded"] == keys
    after = blocks_sent(n1)
    assert (after["batch"] - before["batch"], after["get"] - before["get"]) == (6, 0)
    reader = n2.api(cluster.tokens["reader_a"])
    for key, data in chain:
        assert reader.get_block(cluster.compat, cluster.scope_a, key).content == data
        assert holders_of(cluster, key) == {n1.url, n2.url}


def test_a_block_refused_in_a_batch_comes_from_the_next_source_the_rest_from_the_batch(
    cluster, standin
):
    n1, n2 = cluster.node("n1"), cluster.node("n2")
    chain = put_chain(cluster, n1, 4, 580)
    keys = [key for key, _ in chain]
    damaged_key, data = chain[1]
    [path] = [p for p in n1.host_files() if damaged_key in p.name]
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(damaged)
    standin.add(damaged_key, data)
    gets_before = len(standin.holder.gets)

    blocks = [(key, [n1.url, standin.holder.url]) for key in keys]
    state = run_directive(cluster, n2, directive_body(cluster, blocks))
    assert state["state"] == "complete" and state["loaded"] == keys
    assert standin.holder.gets[gets_before:] == [damaged_key]
    reader = n2.api(cluster.tokens["reader_a"])
    for key, original in chain:
        assert reader.get_block(cluster.compat, cluster.scope_a, key).content == original


def test_a_holder_that_speaks_only_the_spec_is_asked_block_by_block(cluster, standin):
    n1 = cluster.node("n1")
    keys = [random_key() for _ in range(5)]
    for seed, key in enumerate(keys, start=590):
        standin.add(key, container(seed))
    batches_before, gets_before = standin.holder.batches, len(standin.holder.gets)
    body = directive_body(cluster, [(key, [standin.holder.url]) for key in keys])
    state = run_directive(cluster, n1, body)
    assert state["state"] == "complete" and state["loaded"] == keys
    # Asked for a batch (once per fetcher at most, before the first refusal is known), then for
    # each block with a GET of its own.
    assert 1 <= standin.holder.batches - batches_before <= 4
    assert sorted(standin.holder.gets[gets_before:]) == sorted(keys)


def test_the_deadline_makes_a_directive_partial(cluster, standin):
    """Loading stops at the deadline: the node has given up every block still on its way when
    it says the directive is partial, so that none of them is stored later."""
    n2 = cluster.node("n2")
    keys = [random_key() for _ in range(4)]
    for seed, key in enumerate(keys, start=550):
        standin.add(key, container(seed))
    late = threading.Event()
    for key in keys[2:]:
        standin.holder.held[key] = late
    started = time.monotonic()
    body = directive_body(cluster, [(key, [standin.holder.url]) for key in keys], deadline_ms=3_000)
    try:
        state = run_directive(cluster, n2, body)
    finally:
        late.set()
    assert time.monotonic() - started < 8.0
    assert state["state"] == "partial"
    assert state["loaded"] == keys[:2]
    assert "deadline" in state["reason"]
    asked = [key for key in keys[2:] if key in standin.holder.gets]
    assert keys[2] in asked
    left = standin.holder.requester_left
    wait_until(lambda: set(asked) <= set(left), "the held blocks let go")
    assert {key: left[key] for key in asked} == dict.fromkeys(asked, True)
    reader = n2.api(cluster.tokens["reader_a"])
    assert reader.get_block(cluster.compat, cluster.scope_a, keys[0]).status_code == 200
    for key in keys[2:]:
        assert reader.get_block(cluster.compat, cluster.scope_a, key).status_code == 404


def test_the_same_directive_sent_at_once_is_accepted_once(cluster):
    """The controller's task and its resend may deliver one directive together: every copy is
    answered 202 and the node keeps one directive."""
    from workers.models import Directive

    n1, n2 = cluster.node("n1"), cluster.node("n2")
    [(key, _)] = put_chain(cluster, n1, 1, 560)
    body = directive_body(cluster, [(key, [n1.url])])
    copies = 12
    barrier = threading.Barrier(copies)

    def send(_):
        api = n2.api(cluster.tokens["controller"])
        barrier.wait()
        return api.post("prefetch", json=body)

    with ThreadPoolExecutor(copies) as pool:
        answers = list(pool.map(send, range(copies)))
    assert [answer.status_code for answer in answers] == [202] * copies, [
        answer.text for answer in answers if answer.status_code != 202
    ]
    assert Directive.objects.filter(instance=n2.name, directive=body["directive"]).count() == 1
    assert run_directive(cluster, n2, body)["state"] == "complete"


def test_bad_directives_are_problems(cluster):
    n2 = cluster.node("n2")
    controller = n2.api(cluster.tokens["controller"])
    reader = n2.api(cluster.tokens["reader_a"])
    good = directive_body(cluster, [(random_key(), [cluster.node("n1").url])])
    cases = [
        (reader.post("prefetch", json=good), 403, "kvsp-forbidden"),
        (reader.get(f"prefetch/{good['directive']}"), 403, "kvsp-forbidden"),
        (controller.post("prefetch", json={**good, "blocks": []}), 422, "kvsp-invalid-record"),
        (controller.post("prefetch", json={**good, "deadline_ms": 0}), 422, "kvsp-invalid-record"),
        (controller.post("prefetch", json={**good, "directive": "x"}), 422, "kvsp-invalid-record"),
        (
            controller.post("prefetch", json={**good, "layer_order": "descending"}),
            422,
            "kvsp-invalid-record",
        ),
        (
            controller.post("prefetch", content=b"[", headers={"Content-Type": "application/json"}),
            400,
            "kvsp-malformed-request",
        ),
        (controller.get(f"prefetch/{uuid.uuid4()}"), 404, "kvsp-not-found"),
        (controller.get("prefetch/not-a-uuid"), 404, "kvsp-not-found"),
    ]
    assert_problems(cases)
