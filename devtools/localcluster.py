"""A whole KVSP cluster on this machine, for a first look: ``manage.py kvsp_cluster``.

It starts a control plane (gunicorn, a Celery worker and beat) and nodes with the reference
engine (gunicorn and a Celery worker each), creates a scope, principals and the model's
Compatibility Descriptor, drives a workload of prompts with a shared prefix through
``POST placements`` and each chosen node's ``POST generate``, kills a node in the middle of a
session to show the failover, runs one reshard, and prints what it measured. Then it leaves the
dashboard running until Ctrl-C, and stops every process it started.

On the embedded default (no ``DATABASE_URL``) everything lives in a fresh folder (SQLite and a
filesystem broker); with ``DATABASE_URL`` and ``CELERY_BROKER_URL`` set it runs on those.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from devtools.processes import (
    ROOT,
    Beat,
    Process,
    Server,
    Worker,
    free_port,
    register_node,
    run_manage,
    stop_all,
)

# The demo's model and prompts are chosen so that finding a prefix again pays: the reference
# architecture at 8 layers of hidden 512 prefills the 1,032 tokens of a prompt in about 240 ms
# on two quiet cores (the 4-layer default in 19 ms, less than any load), while its one KV head
# of 16 keeps the cache at 1 KiB a token, so the prefix is 8 blocks of 128 KiB: each block
# fetched, admitted and published costs the same fixed round trips whatever its size.
DEMO_MODEL = {"layers": 8, "hidden_size": 512, "heads": 32, "kv_heads": 1}
BLOCK_TOKENS = 128
SHARED_PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 8
# The failover's session: a prompt of its own, as long as the workload's were before the
# longer prefix, so that its figure (detection and resume) stays comparable.
FAILOVER_PROMPT_TOKENS = 136
STATUS_TTL_MS = 2000
STOP_GRACE_S = 3.0


class ClusterError(RuntimeError):
    """The cluster could not be started or did not behave; the message says what and where."""


@dataclass
class NodeProcesses:
    name: str
    port: int
    env: dict
    server: Server | None = None
    worker: Worker | None = None
    engine: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kvsp/"

    def new_processes(self, logs: Path, incarnation: str = "") -> tuple[Server, Worker]:
        """Its HTTP server and its worker (not started); ``incarnation`` tells a restart's
        processes and logs from the first ones."""
        self.server = Server(
            f"{self.name}-http{incarnation}", self.env, logs, workers=2, port=self.port
        )
        self.worker = Worker(
            f"{self.name}-worker{incarnation}",
            self.env,
            logs,
            queues=[f"ii.{self.name}"],
            pool="threads",
            concurrency=4,
        )
        return self.server, self.worker


@dataclass
class Measurements:
    blocks_asked: int = 0
    blocks_matched: int = 0
    ttft_cached_ms: list[float] = field(default_factory=list)
    ttft_cold_ms: list[float] = field(default_factory=list)
    # The cached ones apart: the prompt sent to a node that loaded the prefix from a peer (its
    # placement's directive), and those served where the prefix already was.
    ttft_prefetched_ms: list[float] = field(default_factory=list)
    ttft_held_ms: list[float] = field(default_factory=list)
    sessions_completed: int = 0
    failover_ms: float | None = None
    failover_indices_once: bool | None = None
    reshard_state: str | None = None
    reshard_ms: float | None = None
    directives: list[str] = field(default_factory=list)
    blocks_prefetched: int = 0
    instances_active: int | None = None
    instances: int | None = None


class LocalCluster:
    def __init__(
        self,
        *,
        nodes: int = 3,
        requests: int = 12,
        directory: Path | None = None,
        console: Console | None = None,
    ):
        self.node_count = nodes
        self.requests = requests
        self.console = console or Console()
        self.embedded = not os.environ.get("DATABASE_URL")
        self.directory = directory or (ROOT / "var" / "cluster")
        self.logs = self.directory / "logs"
        self.processes: list[Process] = []
        self.nodes: list[NodeProcesses] = []
        self.holders: list[NodeProcesses] = []
        self.measured = Measurements()
        self.run_id = secrets.token_hex(3)
        self.rng = random.Random(7)

    # --- start-up -------------------------------------------------------------------------

    def base_env(self) -> dict:
        env = dict(os.environ)
        env.update(PYTHONUNBUFFERED="1", KVSP_STATUS_TTL_MS=str(STATUS_TTL_MS))
        if self.embedded:
            env["KVSP_VAR_DIR"] = str(self.directory / "var")
            env.pop("CELERY_BROKER_URL", None)
            env.pop("CELERY_RESULT_BACKEND", None)
        return env

    def manage(self, *args: str, env: dict | None = None) -> dict | list:
        result = run_manage(*args, env=env or self.control_env)
        if result.returncode:
            raise ClusterError(f"manage.py {' '.join(args)}: {result.stderr.strip()}")
        return json.loads(result.stdout) if result.stdout.strip().startswith(("{", "[")) else {}

    def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if self.embedded and self.directory.exists():
            shutil.rmtree(self.directory)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.control_port = free_port()
        self.control_url = f"http://127.0.0.1:{self.control_port}/kvsp/"
        self.control_env = {
            **self.base_env(),
            "KVSP_ROLE": "control",
            "KVSP_FAILURE_CHECK_S": "0.5",
        }
        with self.console.status("migrating the database"):
            self.manage("migrate", "--no-input")
        with self.console.status("creating the reference model"):
            self._create_model()
        with self.console.status("creating scope, principals, instances"):
            self._create_identities()
        self._start_processes()

    def _create_model(self) -> None:
        from workers.engines.modeldir import create_reference_model, reference_descriptor

        self.model_dir = create_reference_model(self.directory / "model", seed=0, **DEMO_MODEL)
        self.descriptor = reference_descriptor(self.model_dir, block_tokens=BLOCK_TOKENS)
        from kvsp.compat import compat_id_hex

        self.compat = compat_id_hex(self.descriptor)

    def _create_identities(self) -> None:
        scope = self.manage("kvsp_scope", "create", f"demo-{self.run_id}")
        self.scope = scope["scope_id"]
        self.controller_token = self.manage(
            "kvsp_principal", "create", f"pc-{self.run_id}", "--controller"
        )["token"]
        self.router_token = self.manage(
            "kvsp_principal", "create", f"router-{self.run_id}", "--scope", self.scope
        )["token"]
        self.admin_password = secrets.token_urlsafe(9)
        admin_env = {**self.control_env, "DJANGO_SUPERUSER_PASSWORD": self.admin_password}
        self.admin_user = f"admin-{self.run_id}"
        result = run_manage(
            "createsuperuser",
            "--no-input",
            "--username",
            self.admin_user,
            "--email",
            "admin@localhost",
            env=admin_env,
        )
        if result.returncode:
            raise ClusterError(f"createsuperuser: {result.stderr.strip()}")
        # The engine nodes, and one storage-only holder that keeps the sessions' copies.
        names = [f"n{index + 1}-{self.run_id}" for index in range(self.node_count)]
        for name in [*names, f"holder-{self.run_id}"]:
            port = free_port()
            url = f"http://127.0.0.1:{port}/kvsp/"
            token = register_node(self.manage, name, url, self.scope)
            node = NodeProcesses(name, port, {"KVSP_TOKEN": token}, engine=name in names)
            (self.nodes if node.engine else self.holders).append(node)
        peers = [node.url for node in [*self.nodes, *self.holders]]
        links = json.dumps([{"holder": url, "mbit_per_s": 20_000, "rtt_us": 100} for url in peers])
        for node in [*self.nodes, *self.holders]:
            node.env = {
                **self.base_env(),
                **node.env,
                "KVSP_ROLE": "node",
                "KVSP_INSTANCE": node.name,
                "KVSP_PUBLIC_URL": node.url,
                "KVSP_CONTROL_URL": self.control_url,
                "KVSP_MODEL_DIR": str(self.model_dir),
                "KVSP_BLOCK_TOKENS": str(BLOCK_TOKENS),
                "KVSP_SHM_DIR": str(self.directory / "shm"),
                "KVSP_DISK_DIR": str(self.directory / "disk"),
                "KVSP_LINKS": links,
                "KVSP_SESSION_HOLDERS": ",".join(holder.url for holder in self.holders),
            }
            if not node.engine:
                del node.env["KVSP_MODEL_DIR"]
            else:
                # The engines share the machine's cores: torch's default of a thread per core
                # in each of them had every forward pass contend with the others' (a token's
                # import and its decoding steps stalled hundreds of ms on two busy cores).
                node.env.setdefault(
                    "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.node_count))
                )
        self.http = httpx.Client(timeout=60)

    def _start_processes(self) -> None:
        planned: list[Process] = [
            Server(
                "control",
                {**self.control_env, "KVSP_TOKEN": self.controller_token},
                self.logs,
                workers=2,
                port=self.control_port,
            ),
            Worker(
                "control-worker",
                {**self.control_env, "KVSP_TOKEN": self.controller_token},
                self.logs,
                queues=["control"],
            ),
            Beat("beat", {**self.control_env, "KVSP_TOKEN": self.controller_token}, self.logs),
        ]
        for node in [*self.nodes, *self.holders]:
            planned += node.new_processes(self.logs)
        with self._progress() as progress:
            task = progress.add_task("starting processes", total=len(planned) + 1)
            for process in planned:
                process.start()
                self.processes.append(process)
                progress.advance(task)
                if process.name == "control":
                    self._put(
                        f"{self.control_url}compat/{self.compat}",
                        self.descriptor,
                        self.router_token,
                    )
            self._wait_active(len(self.nodes))
            progress.advance(task)

    def _wait_active(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listing = self._get(f"{self.control_url}instances/", self.controller_token)
            mine = [i for i in listing["instances"] if i["name"].endswith(self.run_id)]
            # Serving: active (and told so), reporting, and its engine loaded (it then lists
            # the compat id).
            serving = [
                i
                for i in mine
                if i["state"] == "active"
                and i["state_pushed"]
                and i["live"]
                and self.compat in i["compat_ids"]
            ]
            holders = [i for i in mine if i["name"].startswith("holder-") and i["live"]]
            if len(serving) >= count and len(holders) == len(self.holders):
                return
            time.sleep(0.2)
        raise ClusterError(f"fewer than {count} nodes became active; see {self.logs}")

    # --- HTTP ---------------------------------------------------------------------------

    def _headers(self, token: str) -> dict:
        return {"Authorization": f"Bearer {token}"}

    def _check(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            raise ClusterError(
                f"{response.request.method} {response.request.url}: "
                f"{response.status_code} {response.text[:300]}"
            )
        return response.json() if response.content else {}

    def _call(self, method: str, url: str, token: str, body=None) -> dict:
        try:
            response = self.http.request(method, url, json=body, headers=self._headers(token))
        except httpx.HTTPError as error:
            raise ClusterError(f"{method} {url}: {error}; logs in {self.logs}") from None
        return self._check(response)

    def _get(self, url: str, token: str) -> dict:
        return self._call("GET", url, token)

    def _put(self, url: str, body, token: str) -> dict:
        return self._call("PUT", url, token, body)

    def _post(self, url: str, body, token: str) -> dict:
        return self._call("POST", url, token, body)

    # --- workload -------------------------------------------------------------------------

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(3, 300) for _ in range(count)]

    def _generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        instance: str | None = None,
        request_ref: str | None = None,
    ) -> tuple[str, str]:
        """Place (unless an instance is given) and start a generation; (session, node URL)."""
        if instance is None:
            placement = self._post(
                f"{self.control_url}placements",
                {
                    "scope_id": self.scope,
                    "compat_id": self.compat,
                    "tokens": prompt,
                    "request_ref": request_ref,
                },
                self.router_token,
            )
            self.measured.blocks_asked += len(prompt) // BLOCK_TOKENS
            self.measured.blocks_matched += placement["matched"]
            if placement["directive"]:
                self.measured.directives.append(placement["directive"])
            else:
                request_ref = None  # no directive to wait for: the node serves at once
            instance = placement["instance"]
        session = str(uuid.uuid4())
        body = {
            "session": session,
            "scope_id": self.scope,
            "compat_id": self.compat,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "sampler": {"method": "greedy"},
        }
        if request_ref:
            body["request_ref"] = request_ref
        self._post(f"{instance}generate", body, self.controller_token)
        return session, instance

    def _output(self, session: str) -> dict:
        """The delivered tokens; none yet while the session has no first checkpoint (404)."""
        url = f"{self.control_url}sessions/{session}/output"
        try:
            response = self.http.get(url, headers=self._headers(self.controller_token))
        except httpx.HTTPError as error:
            raise ClusterError(f"GET {url}: {error}") from None
        if response.status_code == 404:
            return {"tokens": [], "complete": False}
        return self._check(response)

    def _wait_first_token(self, session: str, started: float, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._output(session)["tokens"]:
                return (time.monotonic() - started) * 1000
            time.sleep(0.01)
        raise ClusterError(f"session {session}: no token after {timeout} s")

    def _wait_complete(self, session: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            output = self._output(session)
            if output["complete"]:
                return output
            time.sleep(0.05)
        raise ClusterError(f"session {session} did not complete in {timeout} s")

    def run_workload(self) -> None:
        """Prompts one after another: every fourth shares nothing (the recompute case), the
        others share a prefix. The first to share it computes it; for the second the node that
        did is drained, as an operator would before maintenance, so that placement sends the
        prompt elsewhere with a prefetch directive that loads the prefix from that node."""
        prefix = self.shared_prefix = self._tokens(SHARED_PREFIX_TOKENS)
        with self._progress() as progress:
            task = progress.add_task("workload: prompts with a shared prefix", total=self.requests)
            computed_at = None
            for index in range(self.requests):
                cold = index % 4 == 0
                prompt = self._tokens(SHARED_PREFIX_TOKENS) if cold else prefix
                prompt = prompt + self._tokens(SUFFIX_TOKENS)
                drained = None
                if not cold and computed_at:
                    drained, computed_at = computed_at, ""
                    self._set_state(drained, "draining")
                started = time.monotonic()
                session, instance = self._generate(
                    prompt, max_tokens=8, request_ref=f"demo-{self.run_id}-{index}"
                )
                ttft = self._wait_first_token(session, started)
                first_share = not cold and computed_at is None
                if cold or first_share:
                    self.measured.ttft_cold_ms.append(ttft)
                else:
                    self.measured.ttft_cached_ms.append(ttft)
                    (
                        self.measured.ttft_prefetched_ms
                        if drained is not None
                        else self.measured.ttft_held_ms
                    ).append(ttft)
                if first_share:
                    computed_at = instance
                self._wait_complete(session)
                if drained is not None:
                    self._set_state(drained, "active")
                    self._wait_active(len(self.nodes))
                self.measured.sessions_completed += 1
                progress.advance(task)
        self.measured.blocks_prefetched = self._prefetched()

    def _set_state(self, url: str, state: str) -> None:
        name = next(node.name for node in self.nodes if node.url == url)
        url = f"{self.control_url}instances/{name}/state"
        self._put(url, {"state": state}, self.controller_token)

    def _prefetched(self) -> int:
        """Blocks the placements' prefetch directives loaded, as the nodes report them."""
        loaded = 0
        for url in self.measured.directives:
            deadline = time.monotonic() + 30
            while True:
                state = self._get(url, self.controller_token)
                if state["state"] != "pending" or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            loaded += len(state.get("loaded", []))
        return loaded

    # --- failover -------------------------------------------------------------------------

    def show_failover(self) -> None:
        prompt = self._tokens(FAILOVER_PROMPT_TOKENS)
        with self._progress() as progress:
            task = progress.add_task("failover: killing a node mid-session", total=3)
            session, instance = self._generate(prompt, max_tokens=64)
            victim = next(node for node in self.nodes if node.url == instance)
            deadline = time.monotonic() + 60
            while len(self._output(session)["tokens"]) < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            killed_at = time.monotonic()
            victim.worker.kill()
            victim.server.kill()
            # Counted once the victim is gone: a token it posted as it was killed is not one
            # of the resume's (with a model slow to decode, one often was: "109 ms").
            delivered = len(self._output(session)["tokens"])
            progress.advance(task)
            while len(self._output(session)["tokens"]) <= delivered:
                if time.monotonic() - killed_at > 120:
                    raise ClusterError("the session did not resume within 120 s")
                time.sleep(0.01)
            self.measured.failover_ms = (time.monotonic() - killed_at) * 1000
            progress.advance(task)
            output = self._wait_complete(session)
            indices = [token["index"] for token in output["tokens"]]
            self.measured.failover_indices_once = indices == list(range(len(indices)))
            # Bring the node back, as a new incarnation, for the reshard.
            for process in victim.new_processes(self.logs, "-2"):
                self.processes.append(process.start())
            self._wait_active(len(self.nodes), timeout=90)
            progress.advance(task)

    # --- reshard --------------------------------------------------------------------------

    def show_reshard(self) -> None:
        """Shard the workload's shared prefix over two nodes that hold its blocks, then grow
        the map to three: the third node fetches the middle range from its old member, the
        others keep what they had."""
        keys = self._prefix_keys()
        found = self._post(
            f"{self.control_url}lookup",
            {"compat_id": self.compat, "scope_id": self.scope, "block_keys": keys},
            self.router_token,
        )
        if found["matched"] < len(keys):
            raise ClusterError(
                f"only {found['matched']} of the shared prefix's {len(keys)} blocks are published"
            )
        holders = {
            block["block_key"]: {replica["holder"] for replica in block["replicas"]}
            for block in found["blocks"]
        }
        live = [node.url for node in self.nodes]
        half = len(keys) // 2
        first, second = (
            [url for url in live if all(url in holders[key] for key in part)]
            for part in (keys[:half], keys[half:])
        )
        if not first or not second:
            raise ClusterError("no node holds a whole half of the shared prefix")
        low = first[0]
        high = next((url for url in second if url != low), second[0])
        third = next((url for url in live if url not in (low, high)), high)
        quarter = half // 2 * BLOCK_TOKENS
        end = len(keys) * BLOCK_TOKENS
        map_id = f"demo-{self.run_id}"
        context = {
            "scope_id": self.scope,
            "compat_id": self.compat,
            "block_tokens": BLOCK_TOKENS,
            "block_keys": keys,
        }
        self._put(
            f"{self.control_url}shardmaps/{map_id}",
            {
                "map": map_id,
                "version": 1,
                "shards": [
                    {"tokens": [0, 2 * quarter], "instance": low},
                    {"tokens": [2 * quarter, end], "instance": high},
                ],
                "context": context,
            },
            self.controller_token,
        )
        started = time.monotonic()
        operation = self._post(
            f"{self.control_url}shardmaps/{map_id}/reshard",
            {
                "shards": [
                    {"tokens": [0, quarter], "instance": low},
                    {"tokens": [quarter, 3 * quarter], "instance": third},
                    {"tokens": [3 * quarter, end], "instance": high},
                ],
                "deadline_ms": 10_000,
            },
            self.controller_token,
        )
        url = f"{self.control_url}shardmaps/{map_id}/reshards/{operation['to']}"
        with self.console.status("reshard: preparing, then commit or abort"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                state = self._get(url, self.controller_token)["state"]
                if state != "preparing":
                    break
                time.sleep(0.1)
        self.measured.reshard_state = state
        self.measured.reshard_ms = (time.monotonic() - started) * 1000

    def check_instances(self, seconds: float) -> None:
        """Watch the instances for a while after the run: every one should stay active (a node
        that stalls on the database or loses its record shows up here)."""
        deadline = time.monotonic() + seconds
        count = len(self.nodes) + len(self.holders)
        worst = count
        while True:
            listing = self._get(f"{self.control_url}instances/", self.controller_token)
            mine = [i for i in listing["instances"] if i["name"].endswith(self.run_id)]
            worst = min(worst, sum(i["state"] == "active" and i["live"] for i in mine))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        self.measured.instances, self.measured.instances_active = count, worst

    def _prefix_keys(self) -> list[str]:
        """The Block Keys (4.2) of the shared prefix's complete blocks, with the scope's key."""
        from kvsp.blockkeys import block_keys

        scope_key = self._get(f"{self.control_url}scopes/{self.scope}/key", self.router_token)
        keys = block_keys(
            bytes.fromhex(scope_key["scope_key"]),
            bytes.fromhex(self.compat),
            self.shared_prefix,
            BLOCK_TOKENS,
        )
        return [key.hex() for key in keys]

    # --- report and shut-down ---------------------------------------------------------------

    def summary(self) -> Table:
        m = self.measured
        table = Table(title="KVSP local cluster")
        table.add_column("measure")
        table.add_column("value", justify="right")
        ratio = m.blocks_matched / m.blocks_asked if m.blocks_asked else 0.0
        table.add_row("sessions completed", str(m.sessions_completed))
        table.add_row(
            "lookup hit ratio (blocks)", f"{ratio:.2f} ({m.blocks_matched}/{m.blocks_asked})"
        )
        if m.ttft_cached_ms and m.ttft_cold_ms:
            cached, cold = statistics.median(m.ttft_cached_ms), statistics.median(m.ttft_cold_ms)
            table.add_row("time to first token, prefix cached", f"{cached:.0f} ms")
            for label, figures in (
                ("loaded from a peer", m.ttft_prefetched_ms),
                ("already on the node", m.ttft_held_ms),
            ):
                if figures:
                    table.add_row(f"  of which {label}", _ms(figures))
            table.add_row("time to first token, recomputed", f"{cold:.0f} ms")
        if m.failover_ms is not None:
            table.add_row("failover: kill to next token", f"{m.failover_ms:.0f} ms")
            table.add_row("failover: every index delivered once", str(m.failover_indices_once))
        table.add_row(
            "blocks prefetched from peers",
            f"{m.blocks_prefetched} ({len(m.directives)} directives)",
        )
        if m.reshard_state is not None:
            table.add_row("reshard", f"{m.reshard_state} in {m.reshard_ms:.0f} ms")
        if m.instances_active is not None:
            table.add_row(
                "instances active throughout the check", f"{m.instances_active}/{m.instances}"
            )
        return table

    def summary_json(self) -> dict:
        m = self.measured
        return {
            "sessions_completed": m.sessions_completed,
            "hit_ratio": m.blocks_matched / m.blocks_asked if m.blocks_asked else 0.0,
            "ttft_cached_ms": statistics.median(m.ttft_cached_ms) if m.ttft_cached_ms else None,
            "ttft_cold_ms": statistics.median(m.ttft_cold_ms) if m.ttft_cold_ms else None,
            "ttft_prefetched_ms": (
                statistics.median(m.ttft_prefetched_ms) if m.ttft_prefetched_ms else None
            ),
            "ttft_held_ms": statistics.median(m.ttft_held_ms) if m.ttft_held_ms else None,
            "failover_ms": m.failover_ms,
            "failover_indices_once": m.failover_indices_once,
            "reshard": m.reshard_state,
            "directives": len(m.directives),
            "blocks_prefetched": m.blocks_prefetched,
            "instances": m.instances,
            "instances_active": m.instances_active,
        }

    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}/"

    def wait_for_interrupt(self, announcement: str) -> None:
        """Print ``announcement``, then wait for Ctrl-C or SIGTERM. Both are handled here,
        whatever the launcher inherited (a shell starts background jobs with SIGINT ignored,
        and Python then leaves it so), and from before the announcement: a Ctrl-C sent as soon
        as it is read is not lost."""
        stop = []
        previous = {
            sig: signal.signal(sig, lambda *args: stop.append(True))
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.console.print(announcement)
            while not stop:
                time.sleep(0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        """Stop every process at once: SIGTERM to all, a few seconds' grace, SIGKILL to what
        is left."""
        if self.processes:
            alive = [process for process in self.processes if process.alive()]
            if alive:
                # On stderr: stdout ends with the summary (``--json`` prints it last).
                Console(stderr=True).print(
                    f"stopping {len(alive)} processes: {', '.join(p.name for p in alive)}"
                )
            stop_all(alive, grace=STOP_GRACE_S)
        self.processes.clear()
        if hasattr(self, "http"):
            self.http.close()

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )


def _ms(figures: list[float]) -> str:
    """A median in ms, with how many prompts it is of when more than one."""
    median = f"{statistics.median(figures):.0f} ms"
    return median if len(figures) == 1 else f"{median} (median of {len(figures)})"
