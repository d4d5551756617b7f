"""Instance status (spec 6.3) from real nodes to the real Placement Controller: a record every
third of its TTL with the epoch and the links, the lifecycle through PUT state, and a restart
that raises the epoch and keeps the leases."""

from __future__ import annotations

import os
import signal
import time
import uuid
from types import SimpleNamespace

import pytest
from django.utils import timezone

from tests.node.conftest import STATUS_TTL_MS, Node, extra_node, start_all
from tests.node.support import (
    assert_problems,
    container,
    directive_body,
    lease_body,
    random_key,
    run_directive,
    store,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db


def instance(name: str):
    from placement.models import Instance

    return Instance.objects.get(name=name)


class DrivenClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stopping:
    """A runtime's ``stopping`` event, set after ``rounds`` rounds of a loop, whose waits pass
    at once on ``clock``, for as long as they were asked to."""

    def __init__(self, clock: DrivenClock, rounds: int):
        self.clock = clock
        self.rounds = rounds

    def is_set(self) -> bool:
        return self.rounds == 0

    def wait(self, timeout: float) -> bool:
        self.rounds -= 1
        self.clock.now += timeout
        return False


@pytest.mark.parametrize("round_s", [0.0, 0.4, 0.7])
def test_a_report_starts_every_third_of_the_ttl_whatever_the_last_one_took(settings, round_s):
    """The reporter's schedule, on a clock the test drives: the time a report takes counts
    towards the interval, which is within the third of the TTL that the spec allows. The
    cluster test below shows the reports arriving in time on a real, busy machine."""
    from workers.status import StatusReporter, report_interval_s

    settings.KVSP_STATUS_TTL_MS = STATUS_TTL_MS
    clock = DrivenClock()
    starts: list[float] = []

    class TimedReports(StatusReporter):
        def once(self) -> None:
            starts.append(clock())
            clock.now += round_s

    reporter = TimedReports(SimpleNamespace(stopping=Stopping(clock, rounds=5)), clock=clock)
    reporter.run()
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == pytest.approx([report_interval_s()] * 4)
    assert report_interval_s() <= STATUS_TTL_MS / 3000


def test_every_node_reports_within_its_ttl(cluster):
    seen: dict[str, list] = {key: [] for key in cluster.nodes}

    def three_more_reports_from_each() -> bool:
        for key, node in cluster.nodes.items():
            at = instance(node.name).last_report_at
            if at is not None and (not seen[key] or seen[key][-1] != at):
                seen[key].append(at)
        return all(len(reports) >= 4 for reports in seen.values())

    wait_until(three_more_reports_from_each, "three reports from every node", interval=0.02)
    for key, node in cluster.nodes.items():
        reports = seen[key]
        gaps = [(b - a).total_seconds() for a, b in zip(reports, reports[1:], strict=False)]
        # However late one comes on a busy machine, never so late that the record expires.
        assert max(gaps) < STATUS_TTL_MS / 1000, gaps
        row = instance(node.name)
        assert row.state == "active"
        status = row.last_status
        assert status["instance"] == node.url and status["ttl_ms"] == STATUS_TTL_MS
        # The epoch is the worker's start time in milliseconds.
        assert abs(status["epoch"] - time.time() * 1000) < 15 * 60 * 1000
        assert status["running"] >= 0 and status["queued"] >= 0
        assert 0 <= status["kv_utilization"] <= 1


def test_the_engine_node_says_what_it_serves_and_the_holders_that_they_run_no_engine(cluster):
    """Placement and resume may choose the node with an engine, never a storage-only holder
    (DESIGN.md section 3)."""
    # Until its engine has loaded the node reports none (it would refuse requests with 503),
    # and the configured rates until the engine has measured its own.
    name = cluster.node("n2").name

    def measured() -> bool:
        row = instance(name)
        return row.runs_engine and row.last_status["decode_tokens_per_s"] != 1_000

    wait_until(measured, "n2's engine loaded and measured", timeout=90)
    n2 = instance(name)
    assert n2.last_status["compat_ids"] == [cluster.compat]
    assert n2.last_status["prefill_tokens_per_s"] != 10_000
    assert "engine" not in n2.last_status and n2.serves(cluster.compat)
    for key in ("n1", "n3"):
        holder = instance(cluster.node(key).name)
        assert holder.last_status["engine"] is False and "compat_ids" not in holder.last_status
        assert not holder.serves(cluster.compat)


def test_drain_sleep_and_wake_through_the_controller(cluster):
    from workers.models import Node

    n1 = cluster.node("n1")
    control = cluster.control("controller")
    assert control.put(f"instances/{n1.name}/state", json={"state": "draining"}).status_code == 200
    # The PC pushes the state to the node; with nothing in flight the node reports sleeping.
    wait_until(lambda: instance(n1.name).state == "sleeping", "the instance asleep", timeout=20)
    assert Node.objects.get(name=n1.name).state == "sleeping"

    body = {
        "directive": str(uuid.uuid4()),
        "scope_id": cluster.scope_a,
        "compat_id": cluster.compat,
        "blocks": [{"block_key": random_key(), "sources": [cluster.node("n3").url]}],
        "deadline_ms": 5000,
        "lease_ms": 1000,
    }
    node_controller = n1.api(cluster.tokens["controller"])
    assert node_controller.post("prefetch", json=body).status_code == 202
    state = wait_until(
        lambda: (
            (s := node_controller.get(f"prefetch/{body['directive']}").json())["state"] != "pending"
            and s
        ),
        "the directive's end",
    )
    assert state["state"] == "failed" and "not active" in state["reason"]

    assert control.put(f"instances/{n1.name}/state", json={"state": "active"}).status_code == 200
    wait_until(lambda: Node.objects.get(name=n1.name).state == "active", "the node awake")
    # The first report to arrive may have left before the node woke; the second has not.
    woke, since = timezone.now(), set()

    def two_reports_since_it_woke() -> bool:
        at = instance(n1.name).last_report_at
        if at > woke:
            since.add(at)
        return len(since) >= 2

    wait_until(two_reports_since_it_woke, "two reports since the node woke", interval=0.02)
    assert instance(n1.name).state == "active"


def test_put_state_is_the_controllers_and_checked(cluster):
    n3 = cluster.node("n3")
    controller = n3.api(cluster.tokens["controller"])
    cases = [
        (
            n3.api(cluster.tokens["reader_a"]).put("state", json={"state": "active"}),
            403,
            "kvsp-forbidden",
        ),
        (controller.put("state", json={"state": "failed"}), 422, "kvsp-invalid-record"),
        (controller.put("state", json={"state": None}), 422, "kvsp-invalid-record"),
        (controller.put("state", json=["active"]), 400, "kvsp-malformed-request"),
        (n3.api(None).put("state", json={"state": "active"}), 401, "kvsp-unauthenticated"),
        (controller.post("state", json={"state": "active"}), 405, "kvsp-method-not-allowed"),
    ]
    assert_problems(cases)
    same = controller.put("state", json={"state": "active"})
    assert same.status_code == 200 and same.json() == {"state": "active"}


def test_a_restart_raises_the_epoch_and_keeps_leases_and_blocks(cluster):
    from workers.models import Lease

    n2 = cluster.node("n2")
    api = n2.api(cluster.tokens["reader_a"])
    key, data = random_key(), container(600)
    store(cluster, n2, key, data)
    lease = api.post("leases", json=lease_body(cluster, [key], ttl_ms=60_000)).json()
    # A block n2 prefetched has a working copy in its worker's device tier.
    n1 = cluster.node("n1")
    fetched_key = random_key()
    store(cluster, n1, fetched_key, container(601))
    directive = directive_body(cluster, [(fetched_key, [n1.url])])
    assert run_directive(cluster, n2, directive)["state"] == "complete"
    assert tiers_of(cluster, n2, fetched_key) == ["device"]
    # While n2 is down its shared memory loses a leased block, and an old crash left a file.
    lost_key = random_key()
    store(cluster, n2, lost_key, container(602))
    lost_lease = api.post("leases", json=lease_body(cluster, [lost_key], ttl_ms=60_000)).json()
    before = instance(n2.name)
    n2.stop()
    [lost_file] = [p for p in n2.host_files() if lost_key in p.name]
    lost_file.unlink()
    orphan = lost_file.with_name("0" * 64 + ".kvb")
    orphan.write_bytes(b"left over")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))

    n2.restart()
    wait_until(
        lambda: (instance(n2.name).epoch or 0) > before.epoch, "a report of the new epoch", 30
    )
    after = instance(n2.name)
    assert after.restarts == before.restarts + 1 and after.state == "active"

    assert Lease.objects.get(lease=lease["lease"]).blocks.count() == 1
    renewed = api.put(f"leases/{lease['lease']}", json={"ttl_ms": 30_000})
    assert renewed.status_code == 200
    assert api.get_block(cluster.compat, cluster.scope_a, key).content == data
    assert api.delete(f"leases/{lease['lease']}").status_code == 204
    # The lost block's record was withdrawn although it was leased; the stray file is gone.
    assert tiers_of(cluster, n2, lost_key) == []
    assert api.get_block(cluster.compat, cluster.scope_a, lost_key).status_code == 404
    assert Lease.objects.get(lease=lost_lease["lease"]).blocks.count() == 0
    assert not orphan.exists()
    # The new worker holds no working copies, and the record says so soon.
    wait_until(lambda: tiers_of(cluster, n2, fetched_key) == ["host"], "a host-only record")


def tiers_of(cluster, node, key: str) -> list[str]:
    replicas = (
        cluster.control("reader_a")
        .get(f"replicas/{cluster.compat}/{cluster.scope_a}/{key}")
        .json()
        .get("replicas", [])
    )
    return [
        entry["tier"]
        for record in replicas
        if record["holder"] == node.url
        for entry in record["residency"]
    ]


def test_a_node_paused_past_its_ttl_rejoins_by_itself_as_a_new_incarnation(
    cluster, start_process, role_env
):
    """A pause (a GC stall, a lock, SIGSTOP here) lets the record expire and the PC fail the
    instance; when the node runs again it rejoins on its own, with a higher epoch."""
    from workers.models import Node

    n1 = cluster.node("n1")
    before = instance(n1.name)
    start_process("beat", "beat-rejoin", role_env(KVSP_FAILURE_CHECK_S="0.25"))
    n1.worker.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: instance(n1.name).state == "failed", "the instance failed", 30)
    finally:
        n1.worker.signal(signal.SIGCONT)
    rejoined = wait_until(
        lambda: (row := instance(n1.name)).state == "active" and row.epoch > before.epoch and row,
        "the instance active under a new epoch",
        30,
    )
    assert rejoined.restarts == before.restarts + 1
    assert Node.objects.get(name=n1.name).epoch == rejoined.epoch
    # It keeps reporting under the new epoch: nobody restarted it.
    wait_until(lambda: instance(n1.name).last_report_at > rejoined.last_report_at, "a later report")
    assert instance(n1.name).state == "active" and n1.worker.alive()


@pytest.fixture(scope="module")
def fresh_engines(cluster, django_db_blocker, role_env, log_dir, tmp_path_factory):
    """Two nodes with the reference engine that nothing else uses: ``warm`` as configured by
    default, ``cold`` with ``KVSP_ENGINE_WARM_UP=0``."""
    run = os.urandom(3).hex()
    scope_ids = [bytes.fromhex(cluster.scope_a), bytes.fromhex(cluster.scope_b)]
    settings_of = {"warm": {}, "cold": {"KVSP_ENGINE_WARM_UP": "0"}}
    nodes: dict[str, Node] = {}
    with django_db_blocker.unblock():
        for key, extra in settings_of.items():
            nodes[key] = extra_node(
                cluster,
                role_env,
                log_dir,
                f"{key}-{run}",
                scope_ids,
                KVSP_MODEL_DIR=str(cluster.model_dir),
                KVSP_STATUS_TTL_MS=str(STATUS_TTL_MS),
                **extra,
            )
            nodes[key].http_workers = 1
    try:
        start_all([process for node in nodes.values() for process in node.processes()])
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


def engine_state(node: Node) -> dict:
    from workers.tasks import engine_state

    return engine_state.apply_async(queue=node.queue).get(timeout=30)


def serving(node: Node, compat: str) -> bool:
    status = instance(node.name).last_status or {}
    return status.get("compat_ids") == [compat] and "engine" not in status


def test_a_node_says_it_serves_only_once_its_engine_has_run_and_keeps_nothing_of_it(
    cluster, fresh_engines
):
    """The first session on a node does not pay for its engine's first run: by the time the node
    reports what it serves, its engine has run real forward passes. Nothing of them is a
    session, a block or a record."""
    from index.models import Replica
    from workers.models import Lease, ServedSession, StoredBlock

    for node in fresh_engines.values():
        wait_until(lambda n=node: serving(n, cluster.compat), f"{node.name} serving", 90)

    warm = engine_state(fresh_engines["warm"])
    assert warm["engine"] and warm["warm_up"]["forward_passes"] >= 1
    assert warm["forward_passes"] >= warm["warm_up"]["forward_passes"]
    # Turned off, the node serves all the same, cold.
    cold = engine_state(fresh_engines["cold"])
    assert cold["engine"] and cold["warm_up"] is None

    for node in fresh_engines.values():
        assert not ServedSession.objects.filter(instance=node.name).exists()
        assert not StoredBlock.objects.filter(instance=node.name).exists()
        assert not Lease.objects.filter(instance=node.name).exists()
        assert not Replica.objects.filter(holder__url=node.url).exists()
        assert node.host_files() == [] and node.disk_files() == []


def test_an_engine_that_fails_to_warm_up_is_served_cold(settings, tmp_path, monkeypatch, caplog):
    """A warm-up that fails is logged and costs nothing else: the engine is published and the
    node serves."""
    from workers.engines.modeldir import create_reference_model
    from workers.engines.reference import ReferenceEngine
    from workers.models import Node as NodeRow
    from workers.runtime import NodeRuntime

    settings.KVSP_MODEL_DIR = str(create_reference_model(tmp_path / "model"))
    settings.KVSP_ENGINE_WARM_UP = True

    def fail(engine):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ReferenceEngine, "warm_up", fail)
    runtime = NodeRuntime(f"warm-fails-{os.urandom(3).hex()}")
    with caplog.at_level("ERROR", logger="workers.runtime"):
        engine = runtime.engine()
    assert engine is not None and runtime.runs_engine
    assert runtime.engine_state() == {"engine": True, "warm_up": None, "forward_passes": 0}
    assert NodeRow.objects.get(name=runtime.name).engine["compat_id"] == engine.compat_id
    assert "warm-up failed" in caplog.text and "out of memory" in caplog.text
