"""Sessions on the reference engine (spec 6.5, 6.8): the time to first token of a long shared
prefix loaded from a peer against the same prefix recomputed, and the time from an instance's
death to the first token of its resumed session.

A control plane (gunicorn, its Celery worker and beat with a failure check every 0.25 s), a
storage-only holder ``h`` and three engine nodes ``a``, ``b``, ``c`` (the reference model,
blocks of 16 tokens, status records of 1.5 s), all on loopback with Postgres and Redis.

Time to first token, per repeat, with a fresh prefix of ``--prefix`` tokens each time:

- loaded: ``a`` serves a request with the prefix and publishes its blocks; ``a`` is drained, so
  that placement goes elsewhere; the client's clock starts, it places a request with the prefix
  and another suffix (``POST CP placements``: the PC sends the chosen node a prefetch directive)
  and sends that node ``POST generate`` with the placement's request_ref; the clock stops when
  the first output token reaches the front end (its ``delivered_at``);
- recomputed: the same node, a prefix it has never seen, placed and sent the same way.

The PC's directives get a deadline of 60 s here, so that the loaded figure is that of the whole
prefix rather than of what a deadline let through.

Failover, per repeat: the engine nodes now have ``h`` as their session holder (they are
restarted so), so the prompt blocks outlive ``a``. A session with a fresh prefix decodes on
``a``; after 16 tokens ``a``'s worker and HTTP process get SIGKILL; the figures are the PC's
``failed_over_at`` less the kill time (detection) and ``resumed_first_token_at`` less
``failed_over_at`` (resume: the resume request, loading the prompt blocks from ``h``,
recomputing the rest, the first new token); ``a`` is then restarted for the next repeat.

    .venv/bin/python bench/bench_sessions.py [--prefix 2048] [--repeat 3]
        [--layers 4 --hidden 64 --heads 4 --kv-heads 2]

Needs Postgres and Redis on 127.0.0.1 (CELERY_BROKER_URL, default redis://127.0.0.1:6379/3).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from bench.support import PG, fresh_database  # noqa: E402
from tests.support.processes import Beat, Server, Worker, free_port, run_manage  # noqa: E402

DB = "kvsp_bench_sessions"
BLOCK_TOKENS = 16
STATUS_TTL_MS = 1500
FAILURE_CHECK_S = 0.25
SUFFIX = 16


class Fleet:
    """The processes of the bench, and what the client needs to talk to them."""

    def __init__(self, options, work: Path, shm: Path):
        from index.services import do_create_principal, do_create_scope, do_register_descriptor
        from kvsp.compat import compat_id_hex
        from placement.services import do_register_instance
        from workers.engines.modeldir import create_reference_model, reference_descriptor

        self.run_id = os.urandom(3).hex()
        model_dir = create_reference_model(
            work / "model",
            layers=options.layers,
            hidden_size=options.hidden,
            heads=options.heads,
            kv_heads=options.kv_heads,
            max_positions=max(4096, options.prefix + 512),
        )
        self.model_dir = model_dir
        descriptor = reference_descriptor(model_dir, block_tokens=BLOCK_TOKENS)
        self.compat = compat_id_hex(descriptor)
        do_register_descriptor(descriptor, self.compat)
        scope = do_create_scope(f"bench-{self.run_id}")
        self.scope = scope.scope_id_hex
        self.controller = do_create_principal("bench-pc", controller=True).token
        self.client_token = do_create_principal(
            "bench-router", scope_ids=[bytes(scope.scope_id)]
        ).token
        self.cp_port = free_port()
        self.cp_url = f"http://127.0.0.1:{self.cp_port}/kvsp/"
        keys = ("h", "a", "b", "c")
        self.ports = {key: free_port() for key in keys}
        self.urls = {key: f"http://127.0.0.1:{port}/kvsp/" for key, port in self.ports.items()}
        self.names = {key: f"{key}-{self.run_id}" for key in keys}
        base = {
            **os.environ,
            "KVSP_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            "KVSP_TOKEN": self.controller,
        }
        control = {
            **base,
            "KVSP_ROLE": "control",
            "KVSP_FAILURE_CHECK_S": str(FAILURE_CHECK_S),
            # Long enough for a whole prefix to load: the figure is the loading, not a cut.
            "KVSP_PREFETCH_DEADLINE_MS": "60000",
        }
        links = [{"holder": self.urls["h"], "mbit_per_s": 100_000, "rtt_us": 50}]
        links += [{"holder": self.urls[key], "mbit_per_s": 20_000, "rtt_us": 200} for key in "abc"]
        self.nodes: dict[str, list] = {}
        self.env: dict[str, dict] = {}
        self.session_holders = False
        for key in keys:
            do_register_instance(self.names[key], self.urls[key])
            token = do_create_principal(
                f"node-{self.names[key]}",
                scope_ids=[bytes(scope.scope_id)],
                holder_urls=[self.urls[key]],
                instance=self.names[key],
            ).token
            env = {
                **base,
                "KVSP_ROLE": "node",
                "KVSP_INSTANCE": self.names[key],
                "KVSP_PUBLIC_URL": self.urls[key],
                "KVSP_CONTROL_URL": self.cp_url,
                "KVSP_TOKEN": token,
                "KVSP_SHM_DIR": str(shm),
                "KVSP_DISK_DIR": str(work / "disk"),
                "KVSP_STATUS_TTL_MS": str(STATUS_TTL_MS),
                "KVSP_LINKS": json.dumps(
                    [link for link in links if link["holder"] != self.urls[key]]
                ),
            }
            if key == "h":
                env.update(KVSP_PREFILL_TOKENS_PER_S="1", KVSP_DECODE_TOKENS_PER_S="1")
            else:
                env.update(KVSP_MODEL_DIR=str(model_dir), KVSP_BLOCK_TOKENS=str(BLOCK_TOKENS))
            self.env[key] = env
        self.work = work
        self.control_processes = [
            Server("bench-cp", control, work, workers=2, port=self.cp_port),
            Worker("bench-cp-worker", control, work, queues=["control"], concurrency=1),
            Beat("bench-beat", control, work),
        ]

    def node_processes(self, key: str) -> list:
        env = self.env[key]
        if key != "h" and self.session_holders:
            env = {**env, "KVSP_SESSION_HOLDERS": self.urls["h"]}
        return [
            Server(f"bench-{key}", env, self.work, workers=2, port=self.ports[key]),
            Worker(
                f"bench-{key}-worker",
                env,
                self.work,
                queues=[f"ii.{self.names[key]}"],
                pool="threads",
                concurrency=4,
            ),
        ]

    def start(self) -> None:
        for process in self.control_processes:
            process.start()
        for key in self.env:
            self.start_node(key)

    def start_node(self, key: str) -> None:
        from workers.models import Node

        before = Node.objects.filter(name=self.names[key]).first()
        self.nodes[key] = self.node_processes(key)
        for process in self.nodes[key]:
            process.start()

        def started() -> bool:
            row = Node.objects.filter(name=self.names[key]).first()
            # A new incarnation, whose engine has loaded.
            fresh = row is not None and (before is None or row.epoch > before.epoch)
            return fresh and (key == "h" or row.engine is not None)

        wait(started, 120, f"{key} started")
        wait(lambda: instance(self.names[key]).state == "active" and live(self.names[key]), 60)

    def restart_engines(self, *, session_holders: bool) -> None:
        self.session_holders = session_holders
        for key in "abc":
            for process in reversed(self.nodes[key]):
                process.stop()
            self.start_node(key)

    def kill(self, key: str) -> float:
        for process in self.nodes[key]:
            process.signal(signal.SIGKILL)
        killed = time.time()
        for process in self.nodes[key]:
            process.proc.wait(timeout=10)
        return killed

    def stop(self) -> None:
        if "router" in self.__dict__:
            self.router.close()
        for processes in self.nodes.values():
            for process in reversed(processes):
                process.stop()
        for process in reversed(self.control_processes):
            process.stop()

    def api(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(
            headers={"Authorization": f"Bearer {token or self.client_token}"}, timeout=120
        )

    @functools.cached_property
    def router(self) -> httpx.Client:
        """The client's one HTTP client, kept for the whole run as a router or front end keeps
        its connections: building one (its TLS context, whatever the scheme) cost 70-250 ms
        here, which the figures would otherwise count in every time to first token."""
        return self.api()


def wait(predicate, timeout: float, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"no {what} after {timeout} s")


def ended_here(session: str):
    """The node's row of a one-token session once the session has ended there: its figures
    are final then (the token reaches the front end with its checkpoint, before the node has
    written them)."""
    from workers.models import ServedSession

    rows = ServedSession.objects.filter(session=session, finished_at__isnull=False)
    return wait(rows.first, 30, f"session {session} ended on its node")


def instance(name: str):
    from placement.models import Instance

    return Instance.objects.get(name=name)


def live(name: str) -> bool:
    from django.utils import timezone

    row = instance(name)
    return row.expires_at is not None and row.expires_at > timezone.now()


def first_token_at(session: str, index: int = 0) -> float:
    from sessions.models import OutputToken

    row = wait(
        lambda: OutputToken.objects.filter(session__session=session, index=index).first(),
        120,
        "first token",
    )
    return row.delivered_at.timestamp()


def set_state(fleet: Fleet, key: str, state: str) -> None:
    from workers.models import Node

    with fleet.api(fleet.controller) as pc:
        answer = pc.put(f"{fleet.cp_url}instances/{fleet.names[key]}/state", json={"state": state})
        assert answer.status_code == 200, answer.text
    settled = "sleeping" if state == "draining" else state
    wait(lambda: Node.objects.get(name=fleet.names[key]).state == settled, 60, settled)


def generate(fleet: Fleet, key: str, session: str, prompt, max_tokens: int, **more) -> None:
    body = {
        "session": session,
        "scope_id": fleet.scope,
        "compat_id": fleet.compat,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "sampler": {"method": "greedy", "params": {}, "seed": 0},
        **more,
    }
    answer = fleet.router.post(f"{fleet.urls[key]}generate", json=body)
    assert answer.status_code == 202, answer.text


def place(fleet: Fleet, tokens, request_ref: str) -> dict:
    answer = fleet.router.post(
        f"{fleet.cp_url}placements",
        json={
            "scope_id": fleet.scope,
            "compat_id": fleet.compat,
            "tokens": tokens,
            "request_ref": request_ref,
        },
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def completed(session: str) -> None:
    from sessions.models import Session

    wait(
        lambda: Session.objects.filter(session=session, state="completed").exists(),
        120,
        "completion",
    )


def bare_prefill_s(model_dir: Path, tokens: list[int]) -> float:
    """A bare transformers forward over ``tokens`` on this machine (best of 3): what the
    recomputed time to first token is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([tokens])
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            started = time.perf_counter()
            model(ids, use_cache=True)
            best = min(best, time.perf_counter() - started)
    return best


def account(served, directive) -> str:
    """Where a session's time to first token went on its node (``timings_us``), in ms, and
    its directive's wait in the worker's queue and its loading."""
    parts = [f"{step} {us / 1e3:.1f}" for step, us in served.timings_us.items()]
    if directive is not None and directive.started_at and directive.finished_at:
        queued = (directive.started_at - directive.received_at).total_seconds()
        loading = (directive.finished_at - directive.started_at).total_seconds()
        parts.append(f"(directive queued {queued * 1e3:.1f}, loading {loading * 1e3:.1f})")
    return " · ".join(parts)


def ttft(fleet: Fleet, options, rng: random.Random) -> None:
    from workers.models import Directive

    vocab = 256
    # cached: every prompt whose prefix a peer holds, as placed (the placement may recompute
    # it when that is cheaper); loaded: those of them whose prefix was loaded.
    cached, loaded, recomputed, loads, bare = [], [], [], [], []
    for repeat in range(options.repeat):
        prefix = [rng.randrange(3, vocab) for _ in range(options.prefix)]
        warm = str(uuid.uuid4())
        generate(fleet, "a", warm, prefix + [rng.randrange(3, vocab) for _ in range(SUFFIX)], 1)
        completed(warm)
        set_state(fleet, "a", "draining")
        try:
            tokens = prefix + [rng.randrange(3, vocab) for _ in range(SUFFIX)]
            reference = f"bench-{uuid.uuid4()}"
            started = time.time()
            placement = place(fleet, tokens, reference)
            key = next(k for k, url in fleet.urls.items() if url == placement["instance"])
            session = str(uuid.uuid4())
            # As docs/node.md ("Generate") says a front end does: the request_ref only when a
            # directive was sent, or the node waits for one that never comes.
            waits = {"request_ref": reference} if placement["directive"] else {}
            generate(fleet, key, session, tokens, 1, **waits)
            cached.append(first_token_at(session) - started)
            served = ended_here(session)
            if served.loaded_blocks:
                loaded.append(cached[-1])
            directive = Directive.objects.filter(request_ref=reference).first()
            if directive is not None and directive.finished_at is not None:
                loads.append((directive.finished_at - directive.received_at).total_seconds())
            fresh = [rng.randrange(3, vocab) for _ in range(options.prefix + SUFFIX)]
            started = time.time()
            place(fleet, fresh, f"bench-{uuid.uuid4()}")
            other = str(uuid.uuid4())
            generate(fleet, key, other, fresh, 1)
            recomputed.append(first_token_at(other) - started)
            bare.append(bare_prefill_s(fleet.model_dir, fresh))
            computed = ended_here(other)
            print(
                f"  repeat {repeat + 1}: on {key}, loaded {served.loaded_blocks} blocks "
                f"+ {served.recomputed_tokens} tokens: {cached[-1] * 1e3:8.1f} ms; "
                f"recomputed {computed.recomputed_tokens} tokens: {recomputed[-1] * 1e3:8.1f} ms"
            )
            print(f"    loaded, the node's account: {account(served, directive)}")
            print(f"    recomputed, the node's account: {account(computed, None)}")
        finally:
            set_state(fleet, "a", "active")
    median_recomputed = statistics.median(recomputed)
    median_loaded = statistics.median(loaded) if loaded else float("nan")
    print(
        f"time to first token, prefix of {options.prefix} tokens + {SUFFIX}, median of "
        f"{options.repeat} (loaded: of the {len(loaded)} the placement had loaded):"
    )
    rows = [
        ("prefix held by a peer, as placed", statistics.median(cached) * 1e3, "ms"),
        ("loaded from a peer (placement, directive, import)", median_loaded * 1e3, "ms"),
    ]
    if loads:
        rows.append(
            (
                "  of which the directive's loading, on the node",
                statistics.median(loads) * 1e3,
                "ms",
            )
        )
    rows.append(("recomputed", median_recomputed * 1e3, "ms"))
    median_bare = statistics.median(bare)
    rows.append(("bare transformers prefill of the same tokens", median_bare * 1e3, "ms"))
    rows.append(("recomputed / bare prefill (target <= 1.3)", median_recomputed / median_bare, ""))
    rows.append(("loaded / recomputed (target <= 0.5)", median_loaded / median_recomputed, ""))
    for label, value, unit in rows:
        print(f"  {label:<52} {value:9.2f} {unit}")


def failover(fleet: Fleet, options, rng: random.Random) -> None:
    from sessions.models import OutputToken, Session
    from workers.models import ServedSession, SessionKind

    detections, resumes, totals = [], [], []
    for repeat in range(options.repeat):
        prompt = [rng.randrange(3, 256) for _ in range(options.prefix + SUFFIX)]
        session = str(uuid.uuid4())
        generate(fleet, "a", session, prompt, 256)
        tokens = OutputToken.objects.filter(session__session=session)
        wait(lambda tokens=tokens: tokens.count() >= 16, 60, "16 tokens")
        killed = fleet.kill("a")
        resumed = Session.objects.filter(session=session, resumed_first_token_at__isnull=False)
        row = wait(resumed.first, 120, "the resumed session's first token")
        detection = row.failed_over_at.timestamp() - killed
        resume = (row.resumed_first_token_at - row.failed_over_at).total_seconds()
        detections.append(detection)
        resumes.append(resume)
        totals.append(detection + resume)
        completed(session)
        print(
            f"  repeat {repeat + 1}: resumed on {row.instance.name} under epoch {row.epoch}: "
            f"detection {detection * 1e3:7.1f} ms, resume {resume * 1e3:7.1f} ms"
        )
        served = (
            ServedSession.objects.filter(session=session, kind=SessionKind.RESUME)
            .select_related("directive")
            .order_by("-epoch")
            .first()
        )
        if served is not None:
            reached = (served.received_at - row.failed_over_at).total_seconds()
            print(
                f"    the resume reached its node {reached * 1e3:.1f} ms after the failover; "
                f"the node's account: {account(served, served.directive)}"
            )
        fleet.start_node("a")
    print(
        f"instance death to the resumed session's first token (status TTL {STATUS_TTL_MS} ms, "
        f"failure check every {FAILURE_CHECK_S} s), median of {options.repeat}:"
    )
    print(
        f"  detection (SIGKILL -> failed over):     {statistics.median(detections) * 1e3:9.1f} ms"
    )
    print(f"  resume (failed over -> first token):    {statistics.median(resumes) * 1e3:9.1f} ms")
    print(f"  total:                                  {statistics.median(totals) * 1e3:9.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvsp-bench-sessions-"))
    shm = Path(tempfile.mkdtemp(prefix="kvsp-bench-sessions-", dir="/dev/shm"))
    broker = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/3")
    os.environ.update(
        DATABASE_URL=f"{PG}/{DB}",
        CELERY_BROKER_URL=broker,
        CELERY_RESULT_BACKEND=broker,
        KVSP_VAR_DIR=str(ROOT / "var"),
        KVSP_ROLE="control",
        KVSP_LOG_LEVEL="WARNING",
    )
    fresh_database(DB)
    migrated = run_manage("migrate", "--no-input", env=dict(os.environ))
    if migrated.returncode:
        sys.exit(migrated.stderr)
    import django

    django.setup()
    fleet = Fleet(options, work, shm)
    try:
        fleet.start()
        rng = random.Random(2048)
        print(
            f"reference model: {options.layers} layers, hidden {options.hidden}, "
            f"{options.kv_heads} KV heads, blocks of {BLOCK_TOKENS} tokens"
        )
        ttft(fleet, options, rng)
        fleet.restart_engines(session_holders=True)
        failover(fleet, options, rng)
    finally:
        fleet.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
