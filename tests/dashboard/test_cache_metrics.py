"""/metrics says where the cache hit and why it missed: lookups by the tier of each matched
block and the stop of their chain, placements by where their tokens come from and why they
recompute (kvsp.reasons), counted through the tally and read back as a scrape shows them."""

from __future__ import annotations

import pytest

from common.metrics import tally
from placement.models import Instance
from tests.dashboard.conftest import publish
from tests.dashboard.test_metrics import scrape
from tests.placement.conftest import BLOCK_TOKENS, HOLDER
from tests.placement.test_placement import link, up
from tests.support.fixtures import body

pytestmark = pytest.mark.django_db


class Figures:
    """What a scrape adds to the one before: counters as deltas."""

    def __init__(self, client):
        self.client = client
        self.before = self._read()

    def _read(self) -> dict:
        tally.write()
        return scrape(self.client)

    def added(self) -> dict:
        after = self._read()
        return {
            key: value - self.before.get(key, 0)
            for key, value in after.items()
            if key[0].startswith("kvsp_")
            and not key[0].startswith("kvsp_http_")  # the scrapes themselves are requests
            and key[0].endswith("_total")
            and value != self.before.get(key, 0)
        }


def lookup(cluster, keys) -> dict:
    request = {"scope_id": cluster.scope.scope_id_hex, "compat_id": cluster.compat}
    response = cluster.router.post("/kvsp/lookup", {**request, "block_keys": keys})
    assert response.status_code == 200
    return response.json()


def test_a_lookup_counts_its_hits_by_the_fastest_tier_and_its_stop(client, cluster):
    """In blocks, and in tokens: the lookup names Block Keys only, and its blocks are counted
    in the tokens of a block of its compat id when the tally is written."""
    # Block 0 on the device at one holder and on disk at another: it counts once, as device.
    publish(cluster.holder, cluster, cluster.keys[0], HOLDER, "device")
    ii1 = up("ii1", scope=cluster.scope, links=[])
    publish(ii1, cluster, cluster.keys[0], "http://ii1.test/kvsp/", "disk")
    publish(cluster.holder, cluster, cluster.keys[1], HOLDER, "host")
    publish(ii1, cluster, cluster.keys[2], "http://ii1.test/kvsp/", "nvme-of")
    figures = Figures(client)

    assert lookup(cluster, cluster.keys)["matched"] == 3
    source = ("source", "lookup")
    assert figures.added() == {
        ("kvsp_prefix_cache_query_blocks_total", (source,)): 4,
        ("kvsp_prefix_cache_hit_blocks_total", (source, ("tier", "device"))): 1,
        ("kvsp_prefix_cache_hit_blocks_total", (source, ("tier", "host"))): 1,
        ("kvsp_prefix_cache_hit_blocks_total", (source, ("tier", "other"))): 1,
        ("kvsp_prefix_cache_queries_total", (source,)): 4 * BLOCK_TOKENS,
        ("kvsp_prefix_cache_hits_total", (source, ("tier", "device"))): BLOCK_TOKENS,
        ("kvsp_prefix_cache_hits_total", (source, ("tier", "host"))): BLOCK_TOKENS,
        ("kvsp_prefix_cache_hits_total", (source, ("tier", "other"))): BLOCK_TOKENS,
        ("kvsp_prefix_cache_stops_total", (("reason", "no_replica"), source)): 1,
        ("kvsp_prefix_cache_missed_blocks_total", (("reason", "no_replica"), source)): 1,
        # What the request itself adds (prometheus-client, in process).
        ("kvsp_lookups_total", (source,)): 1,
        ("kvsp_lookup_block_keys_total", (source,)): 4,
        ("kvsp_lookup_matched_blocks_total", (source,)): 3,
    }

    # A chain that matches to its end stops nowhere.
    figures = Figures(client)
    lookup(cluster, cluster.keys[:3])
    added = figures.added()
    assert added[("kvsp_prefix_cache_query_blocks_total", (source,))] == 3
    assert added[("kvsp_prefix_cache_queries_total", (source,))] == 3 * BLOCK_TOKENS
    assert not [key for key in added if key[0].startswith("kvsp_prefix_cache_stops")]


def test_a_lookup_of_a_compat_id_nobody_registered_counts_its_blocks_and_no_tokens(client, cluster):
    figures = Figures(client)
    request = {"scope_id": cluster.scope.scope_id_hex, "compat_id": "e7" * 32}
    response = cluster.router.post("/kvsp/lookup", {**request, "block_keys": cluster.keys[:2]})
    assert response.json()["matched"] == 0
    added = figures.added()
    source = ("source", "lookup")
    assert added[("kvsp_prefix_cache_query_blocks_total", (source,))] == 2
    assert not [key for key in added if key[0] == "kvsp_prefix_cache_queries_total"]

    # Counted with the lookups of a registered one, the tokens of those are written all the same.
    figures = Figures(client)
    cluster.router.post("/kvsp/lookup", {**request, "block_keys": cluster.keys[:2]})
    lookup(cluster, cluster.keys[:3])
    added = figures.added()
    assert added[("kvsp_prefix_cache_query_blocks_total", (source,))] == 5
    assert added[("kvsp_prefix_cache_queries_total", (source,))] == 3 * BLOCK_TOKENS


def test_a_scope_the_caller_may_not_read_counts_as_a_plain_stop(client, cluster):
    """Nothing in the figures sets a scope the caller may not read apart from an empty one."""
    from tests.support.fixtures import make_caller, make_scope

    publish(cluster.holder, cluster, cluster.keys[0], HOLDER, "device")
    stranger = make_caller("stranger", scopes=[make_scope("tenant-b")])
    figures = Figures(client)
    request = {"scope_id": cluster.scope.scope_id_hex, "compat_id": cluster.compat}
    response = stranger.post("/kvsp/lookup", {**request, "block_keys": cluster.keys[:2]})
    assert response.json()["matched"] == 0
    added = figures.added()
    source = ("source", "lookup")
    assert added[("kvsp_prefix_cache_stops_total", (("reason", "no_replica"), source))] == 1
    assert added[("kvsp_prefix_cache_missed_blocks_total", (("reason", "no_replica"), source))] == 2
    assert added[("kvsp_prefix_cache_queries_total", (source,))] == 2 * BLOCK_TOKENS
    assert not [key for key in added if key[0].startswith("kvsp_prefix_cache_hit")]


def test_a_placement_splits_its_tokens_and_counts_the_tier_of_each_source(client, cluster):
    publish(cluster.holder, cluster, cluster.keys[0], HOLDER, "device")
    publish(cluster.holder, cluster, cluster.keys[1], HOLDER, "host")
    fast = up("fast", scope=cluster.scope, links=[link(100_000)])
    # The third block is at the chosen instance itself, on its disk: loaded from its own tiers.
    publish(fast, cluster, cluster.keys[2], "http://fast.test/kvsp/", "disk")
    figures = Figures(client)

    answer = body(cluster.place())
    assert answer["name"] == "fast" and answer["matched"] == 3
    prompt = len(cluster.tokens)
    added = figures.added()
    source = ("source", "placement")
    assert added[("kvsp_prefix_cache_queries_total", (source,))] == prompt
    for tier in ("device", "host", "disk"):
        assert added[("kvsp_prefix_cache_hits_total", (source, ("tier", tier)))] == BLOCK_TOKENS
        assert added[("kvsp_prefix_cache_hit_blocks_total", (source, ("tier", tier)))] == 1
    tokens, fast = "kvsp_placement_tokens_total", ("instance", "fast")
    assert added[(tokens, (fast, ("origin", "own")))] == BLOCK_TOKENS
    assert added[(tokens, (fast, ("origin", "peer")))] == 2 * BLOCK_TOKENS
    assert added[(tokens, (fast, ("origin", "recompute")))] == prompt - 3 * BLOCK_TOKENS
    external = "kvsp_external_prefix_cache_hits_total"
    assert added[(external, (("tier", "device"),))] == BLOCK_TOKENS
    assert added[(external, (("tier", "host"),))] == BLOCK_TOKENS
    assert added[("kvsp_external_prefix_cache_hit_blocks_total", (("tier", "device"),))] == 1
    assert not [key for key in added if key[0] == "kvsp_placement_recomputes_total"]


def recompute_reasons(client, cluster) -> dict:
    """Why the chosen instance recomputes one placement: {(instance, reason): count}."""
    figures = Figures(client)
    answer = body(cluster.place())
    assert answer["directive"] is None
    added = figures.added()
    recomputed = (("instance", answer["name"]), ("origin", "recompute"))
    assert added[("kvsp_placement_tokens_total", recomputed)] == len(cluster.tokens)
    return {
        (dict(labels)["instance"], dict(labels)["reason"]): value
        for (name, labels), value in added.items()
        if name == "kvsp_placement_recomputes_total"
    }


def test_a_placement_that_recomputes_says_why(client, cluster):
    up("quick", scope=cluster.scope, links=[], prefill_tokens_per_s=20_000)
    assert recompute_reasons(client, cluster) == {("quick", "no_match"): 1}

    cluster.publish(4)
    assert recompute_reasons(client, cluster) == {("quick", "no_link"): 1}

    up("slow", scope=cluster.scope, links=[link(100)], prefill_tokens_per_s=10_000)
    Instance.objects.filter(name="quick").update(state="draining")
    assert recompute_reasons(client, cluster) == {("slow", "recompute_cheaper"): 1}


def test_a_placement_whose_blocks_are_only_at_inactive_instances_says_so(client, cluster):
    up("engine", scope=cluster.scope, links=[], prefill_tokens_per_s=20_000)
    gone = up("gone", scope=cluster.scope, links=[])
    cluster.publish(4, holder="http://gone.test/kvsp/", caller=gone)
    Instance.objects.filter(name="gone").update(state="failed")
    assert recompute_reasons(client, cluster) == {("engine", "source_inactive"): 1}


def test_a_sessions_time_to_first_token_and_its_steps_are_histograms(
    client, cluster, django_capture_on_commit_callbacks
):
    import uuid

    from tests.dashboard.conftest import II1_URL, checkpoint_document
    from tests.support.fixtures import make_instance

    ii1 = make_instance("ii1", II1_URL, scopes=[cluster.scope])
    session = str(uuid.uuid4())
    document = checkpoint_document(cluster, session, offset=1, generated=[7])
    timings = {"queued": 2_000, "keys": 1_000, "directive": 40_000, "prompt": 300_000}
    timings |= {"first_token": 7_000, "first_checkpoint": 9_000, "custom-step": 5}
    before = scrape(client)
    with django_capture_on_commit_callbacks(execute=True):
        path = f"/kvsp/sessions/{session}/checkpoint"
        response = ii1.put(path, document | {"timings_us": timings})
    assert response.status_code == 201
    after = scrape(client)

    def added(name, *labels):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0) - before.get(key, 0)

    ttft = "kvsp_time_to_first_token_seconds"
    assert added(f"{ttft}_count") == 1
    assert added(f"{ttft}_sum") == pytest.approx(0.35)
    assert added(f"{ttft}_bucket", ("le", "0.25")) == 0
    assert added(f"{ttft}_bucket", ("le", "0.5")) == 1
    step = "kvsp_time_to_first_token_step_seconds"
    assert added(f"{step}_sum", ("step", "directive")) == pytest.approx(0.04)
    assert added(f"{step}_sum", ("step", "prompt")) == pytest.approx(0.3)
    assert added(f"{step}_count", ("step", "first_token")) == 1
    # Steps after the first token, and steps of other names, are not its parts.
    shown = {dict(labels).get("step") for name, labels in after if name.startswith(step)}
    assert shown == {"queued", "keys", "directive", "prompt", "first_token"}


def test_counts_a_write_could_not_add_are_kept_and_added_once_by_the_next(
    client, cluster, monkeypatch
):
    from django.db import OperationalError

    from common import services

    figures = Figures(client)
    lookup(cluster, cluster.keys[:2])
    add_counts = services.do_add_counts

    def unwritable(pending):
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "do_add_counts", unwritable)
    tally.write()  # fails: nothing written, nothing lost
    monkeypatch.setattr(services, "do_add_counts", add_counts)
    lookup(cluster, cluster.keys[:2])
    added = figures.added()
    source = ("source", "lookup")
    assert added[("kvsp_prefix_cache_query_blocks_total", (source,))] == 4
    assert added[("kvsp_prefix_cache_queries_total", (source,))] == 4 * BLOCK_TOKENS
    assert added[("kvsp_prefix_cache_stops_total", (("reason", "no_replica"), source))] == 2
