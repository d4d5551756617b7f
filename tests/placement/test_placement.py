"""Placement decisions on constructed clusters where the right answer is known by hand (6.4)."""

import pytest

from kvsp.records import (
    MAX_REQUEST_REF_LENGTH,
    InstanceAnswer,
    InstancesAnswer,
    PlacementAnswer,
)
from placement.models import Directive, Instance
from tests.placement.conftest import HOLDER
from tests.support.answers import assert_answers_as
from tests.support.fixtures import body, make_instance, problem_name, report, status_record
from tests.support.statements import PRINCIPAL_OF_TOKEN, statements_sent

pytestmark = pytest.mark.django_db


def link(mbit_per_s, rtt_us=10, holder=HOLDER):
    return {"holder": holder, "mbit_per_s": mbit_per_s, "rtt_us": rtt_us}


def up(name, *, scope, **figures):
    caller = make_instance(name, scopes=[scope])
    url = f"http://{name}.test/kvsp/"
    assert body(report(caller, name, status_record(url, **figures)))["state"] == "active"
    return caller


def by_name(answer):
    return {c["name"]: c for c in answer["candidates"]}


def test_a_hit_on_a_fast_link_wins(cluster):
    cluster.publish(4)
    up("fast", scope=cluster.scope, links=[link(100_000)])
    up("cold", scope=cluster.scope, links=[])
    answer = body(cluster.place())
    assert_answers_as(PlacementAnswer, answer)
    assert answer["name"] == "fast"
    assert answer["matched"] == 4
    fast = by_name(answer)["fast"]
    # 4 MB at 100,000 Mbit/s is 320 us, plus a round trip; then 5 tail tokens at 10,000/s.
    assert fast["fetch_us"] == pytest.approx(330)
    assert fast["recompute_unmatched_us"] == pytest.approx(500)
    assert fast["recompute_all_us"] == pytest.approx(6_900)
    assert fast["cost_us"] == pytest.approx(830)
    assert by_name(answer)["cold"]["cost_us"] == pytest.approx(6_900)
    assert answer["directive"].startswith("http://fast.test/kvsp/prefetch/")
    directive = Directive.objects.get()
    assert [b["block_key"] for b in directive.blocks] == cluster.keys
    assert all(b["sources"] == [HOLDER] for b in directive.blocks)
    assert directive.request_ref == "req-1"


def test_a_request_ref_the_directive_cannot_keep_is_refused(cluster):
    """The directive keeps the router's reference: a longer one is a 422 that names it, not
    a failed INSERT, and nothing is recorded."""
    cluster.publish(4)
    up("fast", scope=cluster.scope, links=[link(100_000)])
    response = cluster.place(request_ref="r" * (MAX_REQUEST_REF_LENGTH + 1))
    assert response.status_code == 422
    assert "request_ref: must be a string of at most 400" in body(response)["detail"]
    assert not Directive.objects.exists()
    assert body(cluster.place(request_ref="r" * MAX_REQUEST_REF_LENGTH))["directive"]
    assert Directive.objects.get().request_ref == "r" * MAX_REQUEST_REF_LENGTH


def test_a_hit_on_a_slow_link_loses_to_recompute(cluster):
    cluster.publish(4)
    up("slow", scope=cluster.scope, links=[link(100)], prefill_tokens_per_s=10_000)
    up("quick", scope=cluster.scope, links=[], prefill_tokens_per_s=20_000)
    answer = body(cluster.place())
    assert answer["name"] == "quick"
    slow = by_name(answer)["slow"]
    assert slow["fetch_us"] == pytest.approx(320_010)
    # Loading would take longer than recomputing, so the slow one prices recompute...
    assert slow["cost_us"] == pytest.approx(slow["recompute_all_us"])
    # ...and the recompute of the faster prefill wins; nothing is prefetched.
    assert answer["directive"] is None
    assert not Directive.objects.exists()


def test_a_busy_instance_loses_to_an_idle_one(cluster):
    cluster.publish(4)
    up("busy", scope=cluster.scope, links=[link(100_000)], queued=4)
    up("idle", scope=cluster.scope, links=[link(100_000)])
    answer = body(cluster.place())
    assert answer["name"] == "idle"
    busy, idle = by_name(answer)["busy"], by_name(answer)["idle"]
    assert busy["wait_us"] > 0 and idle["wait_us"] == 0
    assert busy["fetch_us"] == idle["fetch_us"]


def test_resident_blocks_cost_nothing(cluster):
    warm = up("warm", scope=cluster.scope, links=[link(100)])
    cluster.publish(4, holder="http://warm.test/kvsp/", caller=warm)
    answer = body(cluster.place())
    warm = by_name(answer)["warm"]
    assert (warm["fetch_us"], answer["matched"]) == (0, 4)
    assert answer["directive"] is None  # everything is already there


def test_never_assign_to_an_instance_that_is_not_active(cluster):
    from placement.services import do_change_state

    cluster.publish(4)
    up("cheap", scope=cluster.scope, links=[link(100_000)])
    up("dear", scope=cluster.scope, links=[])
    do_change_state("cheap", "draining")
    answer = body(cluster.place())
    assert answer["name"] == "dear"
    assert set(by_name(answer)) == {"dear"}


def test_an_instance_serves_only_its_compat_ids(cluster):
    cluster.publish(4)
    up("other-model", scope=cluster.scope, links=[link(100_000)], compat_ids=["ab" * 32])
    up("this-model", scope=cluster.scope, links=[], compat_ids=[cluster.compat])
    assert body(cluster.place())["name"] == "this-model"


def test_an_instance_that_lists_no_compat_ids_serves_any(cluster):
    cluster.publish(4)
    up("listed-none", scope=cluster.scope, links=[link(100_000)], compat_ids=[])
    assert body(cluster.place())["name"] == "listed-none"


def test_the_candidates_are_read_in_one_query_however_many_there_are(
    cluster, django_assert_num_queries
):
    """Placement reads the fleet once, not once per instance (a status record read on its own
    per candidate made a placement over 1,000 instances 40 ms slower)."""
    from placement.selectors import candidates

    for n in range(6):
        up(f"engine-{n}", scope=cluster.scope, links=[link(100_000)])
    up("store", scope=cluster.scope, engine=False)
    with django_assert_num_queries(1):
        found = [instance.name for instance, _ in candidates(cluster.compat)]
    assert sorted(found) == [f"engine-{n}" for n in range(6)]


PLACEMENT_STATEMENTS = [
    "SELECT index_scope index_compatdescriptor",
    "SELECT index_replica index_holder",
    "SELECT placement_instance",
    "INSERT placement_directive",
]


def test_a_placement_that_prefetches_is_four_statements(
    cluster, monkeypatch, django_capture_on_commit_callbacks
):
    """The scope with its block size, the lookup, the candidates and the directive's INSERT,
    whatever the number of blocks, replica shapes and instances; and the directive it records
    is sent as the cost model planned it, each block with its sources by cost."""
    from index.authentication import principal_for_token
    from kvsp.records import PlacementRequest
    from placement import delivery, placements
    from tests.support.fixtures import make_caller

    second = "http://second.test/kvsp/"
    cluster.publish(4)
    publisher = make_caller("second", scopes=[cluster.scope], holders=[second])
    cluster.publish(2, holder=second, size=2_000_000, caller=publisher)
    for n in range(3):
        links = [link(100_000 * (n + 1))] + ([link(100_000, holder=second)] if n == 2 else [])
        up(f"engine-{n}", scope=cluster.scope, links=links)
    router = principal_for_token(cluster.router.token)
    sent = []
    monkeypatch.setattr(delivery, "send_soon", lambda directive: sent.append(directive.body()))
    request = {"scope_id": cluster.scope.scope_id_hex, "compat_id": cluster.compat}
    request |= {"tokens": cluster.tokens, "request_ref": "req-q"}
    with statements_sent() as statements, django_capture_on_commit_callbacks(execute=True):
        answer = placements.do_place(router, PlacementRequest.from_json(request))
    assert statements == PLACEMENT_STATEMENTS
    assert answer["name"] == "engine-2" and answer["matched"] == 4
    directive = Directive.objects.get()
    assert answer["directive"].endswith(str(directive.directive))
    assert [b["block_key"] for b in directive.blocks] == cluster.keys
    # The first two blocks are at both holders, the second one six times slower to fetch from.
    assert [b["sources"] for b in directive.blocks] == [[HOLDER, second]] * 2 + [[HOLDER]] * 2
    assert directive.sources == [[HOLDER, second], [HOLDER]]
    assert directive.block_count == 4
    assert sent == [directive.body()]
    assert sent[0]["blocks"] == directive.blocks and sent[0]["request_ref"] == "req-q"


def test_a_placement_request_sends_the_same_statements_whatever_the_fleet(
    cluster, monkeypatch, django_capture_on_commit_callbacks, lookup_tally_not_due
):
    """A router's request adds its token's principal to the placement's four statements, and
    nothing per instance of the fleet."""
    from placement import delivery

    monkeypatch.setattr(delivery, "send_soon", lambda directive: None)
    cluster.publish(4)

    def statements(instances: int) -> list[str]:
        for n in range(instances):
            up(f"engine-{instances}-{n}", scope=cluster.scope, links=[link(100_000)])
        with statements_sent() as sent, django_capture_on_commit_callbacks(execute=True):
            assert body(cluster.place())["matched"] == 4
        return sent

    assert statements(1) == statements(20) == [PRINCIPAL_OF_TOKEN, *PLACEMENT_STATEMENTS]


def test_a_holder_without_an_engine_is_never_placed_whatever_its_compat_ids(cluster):
    """It would be the cheapest by far: it holds every block and computes fast."""
    for name, compat_ids in (("store", None), ("store-any", []), ("store-this", [cluster.compat])):
        figures = {"compat_ids": compat_ids} if compat_ids is not None else {}
        holder = up(name, scope=cluster.scope, engine=False, prefill_tokens_per_s=10**9, **figures)
        cluster.publish(4, holder=f"http://{name}.test/kvsp/", caller=holder)
    alone = cluster.place()
    assert alone.status_code == 503 and problem_name(alone) == "kvsp-unavailable"
    assert not Instance.objects.get(name="store").serves(cluster.compat)
    up("engine", scope=cluster.scope, links=[])
    answer = body(cluster.place())
    assert answer["name"] == "engine" and set(by_name(answer)) == {"engine"}
    # Asleep, it is never woken for a request either.
    from placement.services import do_change_state

    do_change_state("engine", "draining")
    for name in ("store", "store-any", "store-this"):
        Instance.objects.filter(name=name).update(state="sleeping")
    asleep = cluster.place()
    assert asleep.status_code == 503


def test_partial_prefix(cluster):
    cluster.publish(2)
    up("fast", scope=cluster.scope, links=[link(100_000)])
    answer = body(cluster.place())
    assert answer["matched"] == 2
    assert len(Directive.objects.get().blocks) == 2


def test_no_instance_is_503(cluster):
    response = cluster.place()
    assert response.status_code == 503
    assert problem_name(response) == "kvsp-unavailable"


def test_the_answer_explains_where_the_time_went(cluster):
    up("any", scope=cluster.scope)
    timings = body(cluster.place())["timings_us"]
    assert set(timings) == {"keys", "lookup", "pricing", "directive"}


def test_another_scope_is_not_found(cluster):
    from tests.support.fixtures import make_caller, make_scope

    up("any", scope=cluster.scope)
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    cluster.router = outsider
    response = cluster.place()
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokens": "abc"}, "tokens: must be an array"),
        ({"tokens": [-1]}, "tokens[0]: must be an integer from 0"),
        ({"tokens": [1, True]}, "tokens[1]: must be an integer from 0"),
        ({"tokens": []}, "tokens: must not be empty"),
        ({"compat_id": "zz"}, "compat_id: must be hex32"),
        ({"scope_id": 5}, "scope_id: must be hex16"),
        ({"tokens": [2**32]}, "tokens[0]: must be an integer from 0"),
    ],
)
def test_malformed_placements(cluster, change, named):
    request = {
        "scope_id": cluster.scope.scope_id_hex,
        "compat_id": cluster.compat,
        "tokens": cluster.tokens,
        **change,
    }
    response = cluster.router.post("/kvsp/placements", request)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/problem+json"
    assert named in body(response)["detail"]


def test_unregistered_descriptor_is_404(cluster):
    up("any", scope=cluster.scope)
    request = {"scope_id": cluster.scope.scope_id_hex, "compat_id": "cd" * 32, "tokens": [1, 2]}
    response = cluster.router.post("/kvsp/placements", request)
    assert response.status_code == 404
    assert "Compatibility Descriptor" in body(response)["detail"]


def test_instances_are_listed(cluster):
    up("ii1", scope=cluster.scope, running=2)
    listed = body(cluster.router.get("/kvsp/instances/"))
    assert_answers_as(InstancesAnswer, listed)
    listing = listed["instances"]
    assert [(i["name"], i["state"], i["running"], i["live"]) for i in listing] == [
        ("ii1", "active", 2, True)
    ]
    detail = body(cluster.router.get("/kvsp/instances/ii1"))
    assert_answers_as(InstanceAnswer, detail)
    assert detail["url"] == "http://ii1.test/kvsp/"
    assert cluster.router.get("/kvsp/instances/nope").status_code == 404
    assert Instance.objects.count() == 1
