"""The dashboard and the admin in a real headless browser, against a gunicorn-served control
plane and a control worker on loopback, with a stand-in instance that reports, takes a prefetch
directive and is told to drain, and a session that streams while its page is open.

Screenshots go to ``test-artifacts/dashboard/``. Every page the browser opens must be free of
console errors and uncaught exceptions.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

import httpx
import pytest

from index.models import Holder
from tests.dashboard.browser import chromium_page
from tests.dashboard.conftest import checkpoint_document
from tests.placement.conftest import HOLDER
from tests.support.fixtures import make_caller, make_instance, replica_json, status_record
from tests.support.standin import StandinNode

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

OPERATOR, PASSWORD = "operator", "operator-password-1"


class Http:
    """A principal speaking to the served control plane over HTTP."""

    def __init__(self, base_url: str, caller):
        self.client = httpx.Client(
            base_url=f"{base_url}/kvsp/",
            headers={"Authorization": f"Bearer {caller.token}"},
            timeout=10,
        )

    def put(self, path: str, body) -> httpx.Response:
        return self.client.put(path, json=body)

    def post(self, path: str, body) -> httpx.Response:
        return self.client.post(path, json=body)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)


class Reporter(threading.Thread):
    """Instances that keep reporting their status every half second, with a changing load."""

    def __init__(self, instances: list[tuple[str, str, Http]]):
        super().__init__(daemon=True)
        self.instances = instances
        self.stopping = threading.Event()
        self.reported = threading.Event()  # every instance has reported once
        self.failures: list[str] = []

    def run(self) -> None:
        beat = 0
        while not self.stopping.is_set():
            for name, url, http in self.instances:
                record = status_record(
                    url,
                    running=beat % 5,
                    queued=beat % 3,
                    batch_size=8,
                    kv_utilization=0.2 + (beat % 4) / 10,
                    links=[{"holder": HOLDER, "mbit_per_s": 100_000, "rtt_us": 10}],
                )
                response = http.put(f"instances/{name}/status", record)
                if response.status_code != 200:
                    self.failures.append(f"{name}: {response.status_code} {response.text}")
            beat += 1
            self.reported.set()
            self.stopping.wait(0.5)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


@dataclass
class Served:
    url: str
    standin: StandinNode
    controller: Http
    ii1: Http
    session: str
    holder_id: int


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_superuser(OPERATOR, password=PASSWORD)


@pytest.fixture
def served(cluster, role_env, start_process, operator):
    """The control plane on loopback with a cluster that reports, places and streams."""
    controller = make_caller("pc", controller=True)
    env = role_env(
        KVSP_TOKEN=controller.token, KVSP_STATUS_SAMPLE_S="0", KVSP_DIRECTIVE_POLL_S="0.1"
    )
    server = start_process("server", "control-dashboard", env, workers=2)
    start_process("worker", "control-worker-dashboard", env, queues=["control"])
    with StandinNode() as standin:
        ii1 = Http(server.url, make_instance("ii1", standin.url, scopes=[cluster.scope]))
        ii2_url = "http://ii2.test/kvsp/"
        ii2 = Http(server.url, make_instance("ii2", ii2_url, scopes=[cluster.scope]))
        holder = Http(server.url, cluster.holder)
        router = Http(server.url, cluster.router)
        for key, tier in zip(cluster.keys[:3], ("device", "host", "disk"), strict=True):
            record = replica_json(
                cluster.scope.scope_id_hex,
                cluster.compat,
                key,
                HOLDER,
                residency=[{"tier": tier, "layers": [0, 3]}],
            )
            path = f"replicas/{cluster.compat}/{cluster.scope.scope_id_hex}/{key}"
            assert holder.put(path, record).status_code == 201
        reporter = Reporter([("ii1", standin.url, ii1), ("ii2", ii2_url, ii2)])
        reporter.start()
        try:
            assert reporter.reported.wait(10)
            lookup = {
                "scope_id": cluster.scope.scope_id_hex,
                "compat_id": cluster.compat,
                "block_keys": cluster.keys,
            }
            assert router.post("lookup", lookup).status_code == 200
            placement = {
                "scope_id": cluster.scope.scope_id_hex,
                "compat_id": cluster.compat,
                "tokens": cluster.tokens,
                "request_ref": "req-browser",
            }
            placed = router.post("placements", placement)
            assert placed.status_code == 200 and placed.json()["directive"], placed.text
            session = str(uuid.uuid4())
            document = checkpoint_document(cluster, session, offset=0, generated=[])
            assert ii1.put(f"sessions/{session}/checkpoint", document).status_code == 201
            pc = Http(server.url, controller)
            shards = [{"tokens": [0, 4096], "instance": standin.url}]
            shard_map = {"map": "ctx-1", "version": 1, "shards": shards}
            assert pc.put("shardmaps/ctx-1", shard_map).status_code == 201
            grown = [*shards, {"tokens": [4096, 8192], "instance": standin.url}]
            resharded = pc.post("shardmaps/ctx-1/reshard", {"shards": grown, "deadline_ms": 10_000})
            assert resharded.status_code == 202, resharded.text
            yield Served(
                server.url,
                standin,
                pc,
                ii1,
                session,
                Holder.objects.get(url=HOLDER).pk,
            )
        finally:
            reporter.stop()
        assert reporter.failures == []


def screenshots(artifacts_dir):
    return artifacts_dir / "dashboard"


def test_an_operator_watches_the_cluster_drains_an_instance_and_follows_a_session(
    served, artifacts_dir
):
    base = served.url
    with chromium_page(screenshots(artifacts_dir)) as watched:
        page = watched.page
        watched.log_in(base, OPERATOR, PASSWORD)
        assert page.inner_text("h1") == "Cluster"

        # The instances as they report, the directive completing, the charts drawn.
        row = page.locator('tr[data-instance="ii1"]')
        row.locator(".state-active").wait_for()
        page.locator("table.directives .state-complete").wait_for()
        page.locator(
            '[data-chart="hit_ratio"] svg circle, [data-chart="hit_ratio"] svg polyline'
        ).first.wait_for()
        page.locator('[data-chart="load"] svg').wait_for()
        assert "req-browser" in page.inner_text('[data-section="directives"]')
        assert HOLDER in page.inner_text('[data-section="replicas"]')
        page.locator("table.reshards .state-committed").wait_for()  # the PC's two phases ran
        assert "v1 → v2" in page.inner_text("table.reshards")
        watched.screenshot("overview")

        # Drain ii1: the page comes back saying so, the row shows it, the PC tells the instance.
        row.get_by_role("button", name="Drain").click()
        page.locator(".message.success").wait_for()
        assert page.inner_text(".message.success") == "ii1 is draining."
        page.locator('tr[data-instance="ii1"] .state-draining').wait_for()
        served.standin.wait_for("PUT", "/kvsp/state")
        assert served.standin.received("PUT", "/kvsp/state")[-1] == {"state": "draining"}
        # Once the instance has been told, the refreshed row stops saying it is being told.
        page.wait_for_function(
            "!document.querySelector('tr[data-instance=\"ii1\"]').textContent.includes('telling')"
        )
        page.locator('[data-chart="load"] svg').wait_for()
        watched.screenshot("overview-drained")

        # A change made elsewhere (the API) shows up without reloading the page.
        page.evaluate("window.notReloaded = true")
        woken = served.controller.put("instances/ii1/state", {"state": "active"})
        assert woken.status_code == 200 and woken.json()["state"] == "active"
        page.locator('tr[data-instance="ii1"] .state-active').wait_for()
        assert page.evaluate("window.notReloaded") is True

        # The session page while the instance streams its tokens.
        page.goto(f"{base}/sessions/{served.session}")
        page.evaluate("window.notReloaded = true")
        tokens = page.locator("ol.tokens li")
        assert tokens.count() == 0
        for start in (0, 5, 10):
            batch = [{"epoch": 1, "index": i, "token": 900 + i} for i in range(start, start + 5)]
            if start == 10:
                batch[-1]["final"] = True
            assert served.ii1.post(f"sessions/{served.session}/output", batch).status_code == 200
            page.wait_for_function(
                f"document.querySelectorAll('ol.tokens li').length === {start + 5}"
            )
        page.locator('[data-section="session"] .state-completed').wait_for()
        assert tokens.all_inner_texts() == [str(900 + i) for i in range(15)]
        assert "15 tokens delivered of 15" in page.inner_text('[data-section="session"]')
        assert page.evaluate("window.notReloaded") is True
        watched.screenshot("session")

        # The instance's own page, with charts of its sampled figures.
        page.click('[data-section="session"] a[href="/instances/ii1"]')
        page.locator('[data-chart="load"] svg polyline').first.wait_for()
        assert page.inner_text("h1") == "Instance ii1"
        watched.screenshot("instance")

        # Withdraw a replica from its holder's page.
        page.goto(f"{base}/holders/{served.holder_id}")
        boxes = page.locator('input[name="replica"]')
        assert boxes.count() == 3
        boxes.first.check()
        page.get_by_role("button", name="Withdraw chosen replicas").click()
        page.locator(".message.success").wait_for()
        assert page.inner_text(".message.success") == "Withdrew 1 replica(s)."
        assert page.locator('input[name="replica"]').count() == 2
        watched.screenshot("holder")

        assert watched.errors == []


def test_an_operator_drains_an_instance_from_the_admin(
    cluster, role_env, start_process, operator, artifacts_dir
):
    server = start_process("server", "control-admin", role_env(), workers=1)
    ii = Http(server.url, make_instance("ii7", "http://ii7.test/kvsp/", scopes=[cluster.scope]))
    assert ii.put("instances/ii7/status", status_record("http://ii7.test/kvsp/")).status_code == 200
    with chromium_page(screenshots(artifacts_dir)) as watched:
        page = watched.page
        watched.log_in(server.url, OPERATOR, PASSWORD, then="/admin/placement/instance/")
        row = page.locator("#result_list tbody tr", has_text="ii7")
        assert "\tActive\t" in row.inner_text()
        row.locator('input[name="_selected_action"]').check()
        page.select_option('select[name="action"]', "make_draining")
        page.click('button[name="index"]')
        page.locator(
            ".messagelist .info", has_text="Asked 1 instance(s) to be draining."
        ).wait_for()
        assert "\tDraining\t" in page.locator("#result_list tbody tr", has_text="ii7").inner_text()
        watched.screenshot("admin-instances")

        page.click("#result_list tbody tr a:text('ii7')")
        page.locator("fieldset", has_text="Lifecycle (6.3)").wait_for()
        assert page.locator('input[name="name"]').count() == 0  # its identity is read-only
        watched.screenshot("admin-instance")

        page.click('a:text("View on site")')
        page.wait_for_url(f"{server.url}/instances/ii7")
        page.locator('[data-section="instance"] .state-draining').wait_for()
        assert watched.errors == []
