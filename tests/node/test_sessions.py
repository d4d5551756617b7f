"""Sessions on real tensors, end to end (spec 6.5, 6.8): nodes with the reference engine serve
generations, load a prefix through a placement's directive, checkpoint, and are resumed by the
Placement Controller after a SIGKILL or a pause, with the front end delivering every index once.

Besides the package's cluster, this module starts four engine nodes ``e1``-``e4`` (blocks of 8
tokens, status records of 1.5 s, the storage holder ``n1`` as their session holder, links to
``n1`` and to one another) and Celery beat with a failure check every 0.25 s. The expected
outputs come from the same model run in this process, uninterrupted.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch

from tests.node.conftest import Node, start_all
from tests.node.support import assert_problems, problem
from tests.support.processes import Beat, free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db

BLOCK_TOKENS = 8
STATUS_TTL_MS = 1500
# A cache recomputed from scratch runs the same arithmetic on matrices of other shapes, so its
# float32 logits may differ in the last bits; 1e-5 is far above the largest difference seen
# (below 1e-6) and far below the gaps between competing logits (as in tests/engines).
TOLERANCE = 1e-5
GREEDY = {"method": "greedy", "params": {}, "seed": 0}
TOP_P = {"method": "top-p", "params": {"p": 0.9, "temperature": 0.8}, "seed": 7}


def prompt_tokens(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (count,), generator=generator).tolist()


@dataclass
class Serving:
    cluster: object
    compat: str
    engines: dict[str, Node]
    reference: object  # the engine of this process, for the expected outputs

    def node(self, key: str) -> Node:
        return self.engines[key]

    def generate(self, key: str, session: str, prompt, max_tokens: int, sampler=GREEDY, **more):
        body = {
            "session": session,
            "scope_id": self.cluster.scope_a,
            "compat_id": self.compat,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "sampler": sampler,
            **more,
        }
        return self.node(key).api(self.cluster.tokens["reader_a"]).post("generate", json=body)

    def expected(self, prompt, max_tokens: int, sampler=GREEDY) -> list[int]:
        """What an uninterrupted run produces."""
        from workers.engines.samplers import TokenSampler

        draw = TokenSampler(sampler["method"], sampler["params"], seed=sampler["seed"])
        sequence = self.reference.prefill(prompt)
        out = []
        while len(out) < max_tokens:
            token = draw.sample(sequence.logits)
            out.append(token)
            if token == self.reference.eos_token_id:
                break
            self.reference.decode(sequence, token)
        return out


@pytest.fixture(scope="module")
def serving(cluster, django_db_blocker, role_env, log_dir):
    from index.services import do_create_principal, do_register_descriptor
    from kvsp.compat import compat_id_hex
    from placement.services import do_register_instance
    from workers.engines.modeldir import reference_descriptor
    from workers.engines.reference import ReferenceEngine

    run = os.urandom(3).hex()
    holder = cluster.node("n1")
    descriptor = reference_descriptor(cluster.model_dir, block_tokens=BLOCK_TOKENS)
    compat = compat_id_hex(descriptor)
    keys = ("e1", "e2", "e3", "e4")
    ports = {key: free_port() for key in keys}
    urls = {key: f"http://127.0.0.1:{ports[key]}/kvsp/" for key in keys}
    # The session holder is the fast source; peers are priced as farther away, so that what a
    # node measures of the holder during a prefetch still beats them.
    links = [{"holder": holder.url, "mbit_per_s": 100_000, "rtt_us": 50}]
    links += [{"holder": url, "mbit_per_s": 1_000, "rtt_us": 20_000} for url in urls.values()]
    scope = bytes.fromhex(cluster.scope_a)
    engines: dict[str, Node] = {}
    with django_db_blocker.unblock():
        do_register_descriptor(descriptor, compat)
        for key in keys:
            name = f"{key}-{run}"
            do_register_instance(name, urls[key])
            token = do_create_principal(
                f"node-{name}", scope_ids=[scope], holder_urls=[urls[key]], instance=name
            ).token
            env = role_env(
                KVSP_ROLE="node",
                KVSP_INSTANCE=name,
                KVSP_PUBLIC_URL=urls[key],
                KVSP_CONTROL_URL=cluster.cp_url,
                KVSP_TOKEN=token,
                KVSP_SHM_DIR=str(holder.shm_dir),
                KVSP_DISK_DIR=str(holder.disk_dir),
                KVSP_STATUS_TTL_MS=str(STATUS_TTL_MS),
                KVSP_REPLICA_TTL_MS="60000",
                KVSP_LEASE_MAX_TTL_MS="60000",
                KVSP_MODEL_DIR=str(cluster.model_dir),
                KVSP_BLOCK_TOKENS=str(BLOCK_TOKENS),
                KVSP_SESSION_HOLDERS=holder.url,
                KVSP_LINKS=json.dumps([link for link in links if link["holder"] != urls[key]]),
                KVSP_CHECKPOINT_TOKENS="4",
            )
            engines[key] = Node(
                name,
                ports[key],
                env,
                log_dir,
                holder.shm_dir,
                holder.disk_dir,
                token,
                http_workers=1,
            )
    beat = Beat(f"beat-{run}", role_env(KVSP_FAILURE_CHECK_S="0.25"), log_dir)
    try:
        start_all([process for node in engines.values() for process in node.processes()])
        beat.start()
        with django_db_blocker.unblock():
            for node in engines.values():
                wait_until(lambda n=node: serves(n, compat), f"{node.name} serving", timeout=90)
        yield Serving(
            cluster=cluster,
            compat=compat,
            engines=engines,
            reference=ReferenceEngine(cluster.model_dir, block_tokens=BLOCK_TOKENS, device="cpu"),
        )
    finally:
        beat.stop()
        for node in engines.values():
            for process in (node.worker, node.server):
                if process is not None:
                    process.signal(signal.SIGCONT)
            node.stop()


def serves(node: Node, compat: str) -> bool:
    from placement.models import Instance
    from workers.models import Node as NodeRow

    row = NodeRow.objects.filter(name=node.name).first()
    status = Instance.objects.get(name=node.name).last_status or {}
    return bool(row and row.engine and status.get("compat_ids") == [compat])


def session_row(session: str):
    from sessions.models import Session

    return Session.objects.select_related("instance").filter(session=session).first()


def served_rows(session: str) -> list:
    from workers.models import ServedSession

    return list(ServedSession.objects.filter(session=session).order_by("epoch"))


def finished_on_node(session: str, timeout: float = 60):
    """The node's row of the session once its run has ended: every block it computed is
    published by then (publication goes on after the last token)."""
    return wait_until(
        lambda: (
            (rows := served_rows(session))
            and rows[-1].state not in ("accepted", "running")
            and rows[-1]
        ),
        f"session {session} ended on its node",
        timeout=timeout,
    )


def delivered(serving: Serving, session: str) -> list[dict]:
    answer = serving.cluster.control("reader_a").get(f"sessions/{session}/output")
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def duplicate_tokens(serving: Serving) -> int:
    """Output tokens the control plane was sent for indices it held already (its /metrics)."""
    text = httpx.get(serving.cluster.cp_url.replace("/kvsp/", "/metrics"), timeout=10).text
    found = re.search(r'^kvsp_output_tokens_total\{outcome="duplicate"\} ([0-9.e+]+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def completed(session: str, timeout: float = 60):
    return wait_until(
        lambda: (row := session_row(session)) is not None and row.state == "completed" and row,
        f"session {session} completed",
        timeout=timeout,
    )


def request_state(serving: Serving, key: str, state: str) -> float:
    """The controller's PUT state (6.3); the time it was answered."""
    answer = serving.cluster.control("controller").put(
        f"instances/{serving.node(key).name}/state", json={"state": state}
    )
    assert answer.status_code == 200, answer.text
    return time.time()


def settled(serving: Serving, key: str, state: str) -> None:
    from workers.models import Node as NodeRow

    name = serving.node(key).name
    wait_until(lambda: NodeRow.objects.get(name=name).state == state, f"{name} {state}", timeout=30)


def set_state(serving: Serving, key: str, state: str) -> None:
    request_state(serving, key, state)
    settled(serving, key, "sleeping" if state == "draining" else state)


def logits_of(serving: Serving, key: str, prompt, *, recompute: bool = False) -> tuple:
    from workers.tasks import prompt_logits

    result = prompt_logits.apply_async(
        args=[serving.cluster.scope_a, serving.compat, prompt, recompute],
        queue=serving.node(key).queue,
    ).get(timeout=60)
    logits = np.frombuffer(base64.b64decode(result["logits"]), dtype="<f4")
    return torch.from_numpy(logits.copy()), result["loaded_blocks"], result["recomputed_tokens"]


class Stream:
    """A client of the front end's event stream, recording every event as it arrives."""

    def __init__(self, serving: Serving, session: str):
        self.events: list[dict] = []
        self.error: Exception | None = None
        self.complete = threading.Event()
        self.url = f"{serving.cluster.cp_url}sessions/{session}/output"
        self.token = serving.cluster.tokens["reader_a"]
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"}
        try:
            for _ in range(400):  # the session exists from its first checkpoint on
                with httpx.stream("GET", self.url, headers=headers, timeout=120) as response:
                    if response.status_code == 404:
                        time.sleep(0.05)
                        continue
                    self._events(response.iter_lines())
                return
        except httpx.HTTPError as error:
            self.error = error

    def _events(self, lines) -> None:
        event = None
        for line in lines:
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                self.events.append(json.loads(line[6:]))
            elif line.startswith("data: ") and event == "complete":
                self.complete.set()
                return

    def tokens(self) -> list[int]:
        assert self.complete.wait(60), f"the stream did not complete ({self.error})"
        indices = [event["index"] for event in self.events]
        assert indices == list(range(len(indices))), indices
        return [event["token"] for event in self.events]


REQUESTS_SUMMARY = re.compile(
    r"(\d+) tokens? from the serving instances' own tiers · (\d+) from peers · (\d+) recomputed"
)


def shown_requests(admin_client, session: str, rows: list) -> tuple[int, int, int]:
    """What the session's dashboard page, and its live JSON alike, show of its requests (the
    node's ``rows``): each with its time to first token and the parts of it; the tokens of
    them all from the serving instances' own tiers, from peers, and recomputed."""
    from django.template.defaultfilters import floatformat

    from kvsp.timeline import first_token_parts

    page = admin_client.get(f"/sessions/{session}")
    assert page.status_code == 200
    live = admin_client.get(f"/live/sessions/{session}")
    assert live.status_code == 200
    shown = [page.content.decode(), live.json()["html"]["requests"]]
    for html in shown:
        for row in rows:
            parts, total = first_token_parts(row.timings_us)
            assert total is not None and f"{floatformat(total / 1000, 1)} ms" in html
            for step, spent in parts:
                assert f"{step} {floatformat(spent / 1000, 1)} ms" in html
    (summary,) = {REQUESTS_SUMMARY.search(html).groups() for html in shown}
    return tuple(map(int, summary))


def kill(node: Node) -> None:
    node.worker.kill()
    node.server.kill()


# --- A session on one instance, draining ------------------------------------------------------


def test_a_draining_instance_finishes_its_session_then_sleeps_and_refuses_new_ones(serving):
    from placement.models import Instance
    from workers.models import Node as NodeRow

    prompt = prompt_tokens(29, seed=1)
    session = str(uuid.uuid4())
    stream = Stream(serving, session)
    accepted = serving.generate("e1", session, prompt, 40)
    assert accepted.status_code == 202, accepted.text
    session_url = f"{serving.cluster.cp_url}sessions/{session}"
    assert accepted.headers["location"] == session_url
    assert accepted.json() == {
        "session": session,
        "epoch": 1,
        "state": "accepted",
        "session_url": session_url,
        "output_url": f"{session_url}/output",
    }
    # Draining at once: the session admitted is in flight and completes first (6.3).
    drain_requested = request_state(serving, "e1", "draining")
    settled(serving, "e1", "sleeping")
    row = completed(session)
    (served,) = served_rows(session)
    name = serving.node("e1").name
    assert served.state == "completed"
    assert drain_requested < served.finished_at.timestamp()
    assert served.finished_at <= NodeRow.objects.get(name=name).state_changed_at
    wait_until(lambda: Instance.objects.get(name=name).state == "sleeping", "e1 reported asleep")

    expected = serving.expected(prompt, 40)
    assert stream.tokens() == expected
    assert [t["token"] for t in delivered(serving, session)] == expected
    assert (row.epoch, row.failovers, row.delivered, row.final_length) == (1, 0, 40, 40)
    # 29 + 39 positions were run: blocks 3..7 are generated ones, each checkpointed, stored,
    # published and copied to the session holder once the checkpoint was acknowledged.
    assert served.published_blocks == 3 + 5
    assert served.checkpoints >= 1 + 5
    assert (served.loaded_blocks, served.recomputed_tokens) == (0, 29)
    # Where the time to the first token went, on the node's row and, as the instance sent it
    # with its first checkpoint, at the control plane: every step, none negative, adding up
    # to no more than the time from admission to the first token.
    steps = ["queued", "keys", "directive", "prompt", "first_token"]
    assert set(served.timings_us) == {*steps, "first_checkpoint", "first_post"}
    assert all(type(spent) is int and spent >= 0 for spent in served.timings_us.values())
    took_us = (served.first_token_at - served.received_at).total_seconds() * 1e6
    assert sum(served.timings_us.values()) <= took_us + 1000
    assert set(row.timings_us) == set(steps)
    assert all(row.timings_us[step] == served.timings_us[step] for step in steps[1:])

    refused = serving.generate("e1", str(uuid.uuid4()), prompt, 4)
    assert refused.status_code == 409 and problem(refused) == "kvsp-invalid-state"
    set_state(serving, "e1", "active")


# --- Recompute equivalence through the protocol ----------------------------------------------


def test_blocks_prefetched_through_a_placement_give_the_logits_of_their_instance(
    serving, admin_client
):
    """A prompt prefilled on A and published, prefetched by B through a placement's directive:
    B computes the next-token logits A computes from its own cache, bit for bit, and a full
    recompute matches within TOLERANCE with the same greedy continuation."""
    prompt = prompt_tokens(29, seed=3)
    first = str(uuid.uuid4())
    assert serving.generate("e1", first, prompt, 24).status_code == 202
    completed(first)
    finished_on_node(first)
    out = [t["token"] for t in delivered(serving, first)]
    # The prompt and the first 21 tokens A generated: six blocks A published (three of the
    # prompt, three generated) and two tokens after them.
    query = prompt + out[:21]
    set_state(serving, "e1", "draining")  # so that the placement goes elsewhere
    try:
        reference = f"equivalence-{uuid.uuid4()}"
        placed = serving.cluster.control("reader_a").post(
            "placements",
            json={
                "scope_id": serving.cluster.scope_a,
                "compat_id": serving.compat,
                "tokens": query,
                "request_ref": reference,
            },
        )
        assert placed.status_code == 200, placed.text
        placement = placed.json()
        b = next(key for key, node in serving.engines.items() if node.url == placement["instance"])
        assert b != "e1" and placement["matched"] == 6 and placement["directive"]
        controller = serving.node(b).api(serving.cluster.tokens["controller"])

        def directive_end():
            # The PC sends the directive right after its answer: it may not have arrived.
            answer = controller.get(placement["directive"])
            return answer.status_code == 200 and answer.json()["state"] != "pending" and answer

        state = wait_until(directive_end, "the directive's end").json()
        assert state["state"] == "complete" and len(state["loaded"]) == 6

        on_b, loaded_b, recomputed_b = logits_of(serving, b, query)
        on_a, loaded_a, recomputed_a = logits_of(serving, "e1", query)
        assert (loaded_a, recomputed_a) == (loaded_b, recomputed_b) == (6, 2)
        assert torch.equal(on_a, on_b)
        on_b_recomputed, loaded, recomputed = logits_of(serving, b, query, recompute=True)
        assert (loaded, recomputed) == (0, len(query))
        here = serving.reference.prefill(query).logits
        for recomputed_logits in (on_b_recomputed, here):
            assert (recomputed_logits - on_a).abs().max().item() <= TOLERANCE

        # B serves the placed request with the blocks the directive loaded: its greedy
        # continuation is A's and the recomputed one.
        second = str(uuid.uuid4())
        accepted = serving.generate(b, second, query, 3, request_ref=reference)
        assert accepted.status_code == 202, accepted.text
        completed(second)
        (served,) = served_rows(second)
        assert (served.loaded_blocks, served.recomputed_tokens) == (6, 2)
        # The session's page: the six blocks came from peers through the directive.
        assert shown_requests(admin_client, second, [served]) == (0, 6 * BLOCK_TOKENS, 2)
        continuation = [t["token"] for t in delivered(serving, second)]
        assert continuation == out[21:24] == serving.expected(query, 3)
    finally:
        set_state(serving, "e1", "active")


# --- Failover ----------------------------------------------------------------------------------


def fail_over(serving: Serving, a: str, sampler: dict, seed: int, *, pause: bool = False) -> dict:
    """A session of 48 tokens on ``a`` from a prompt of its own (``seed``), cut at a random
    point mid-generation by a SIGKILL of its worker and HTTP process (or a SIGSTOP with
    ``pause``); returns what the test checks."""
    from placement.models import Instance
    from sessions.models import OutputToken

    prompt = prompt_tokens(29, seed=seed)
    session = str(uuid.uuid4())
    node = serving.node(a)
    stream = Stream(serving, session)
    cut_at = random.randint(6, 24)
    assert serving.generate(a, session, prompt, 48, sampler).status_code == 202
    wait_until(
        lambda: OutputToken.objects.filter(session__session=session).count() >= cut_at,
        f"{cut_at} tokens delivered",
    )
    if pause:
        for process in (node.worker, node.server):
            process.signal(signal.SIGSTOP)
    else:
        kill(node)
    cut = time.time()
    before = OutputToken.objects.filter(session__session=session).count()
    assert before < 48, "the session ended before the cut"
    wait_until(lambda: Instance.objects.get(name=node.name).state == "failed", f"{a} failed")
    return {
        "session": session,
        "prompt": prompt,
        "stream": stream,
        "cut": cut,
        "expected": serving.expected(prompt, 48, sampler),
        "node": node,
    }


def check_resumed(serving: Serving, run: dict, admin_client) -> None:
    session = run["session"]
    row = completed(session)
    tokens = delivered(serving, session)
    assert [t["index"] for t in tokens] == list(range(48))
    assert [t["token"] for t in tokens] == run["expected"]
    assert run["stream"].tokens() == run["expected"]
    assert row.failovers >= 1 and row.epoch >= 2 and row.instance.name != run["node"].name
    assert row.failed_over_at.timestamp() >= run["cut"]
    assert row.resumed_first_token_at is not None
    resumed = served_rows(session)[-1]
    assert resumed.kind == "resume" and resumed.state == "completed"
    assert resumed.epoch == row.epoch and resumed.instance == row.instance.name
    # The prompt blocks came from the session holder; what no block covered was recomputed.
    assert resumed.loaded_blocks >= 3 and resumed.recomputed_tokens >= 1
    # Tokens the resumed instance delivered carry its epoch, and none of them changed.
    assert all(t["epoch"] in (1, row.epoch) for t in tokens)
    # The session's page shows both requests: the generate recomputed its prompt, the resume
    # loaded its blocks from the session holder through its directive.
    requests = served_rows(session)
    assert [r.kind for r in requests][0] == "generate" and len(requests) >= 2
    drawn = [r for r in requests if "first_token" in r.timings_us]
    assert resumed in drawn
    own, peer, recomputed = shown_requests(admin_client, session, drawn)
    assert own + peer == BLOCK_TOKENS * sum(r.loaded_blocks for r in requests)
    assert peer >= BLOCK_TOKENS * resumed.loaded_blocks
    assert recomputed == sum(r.recomputed_tokens for r in requests)


def test_a_killed_instances_greedy_session_resumes_elsewhere_losing_nothing(serving, admin_client):
    duplicates = duplicate_tokens(serving)
    run = fail_over(serving, "e2", GREEDY, seed=5)
    check_resumed(serving, run, admin_client)
    # The tokens the killed instance had released after its last checkpoint are drawn again
    # by the resumed one, and not sent again: the first new token is the resume's first post.
    assert duplicate_tokens(serving) == duplicates


def test_a_killed_instances_top_p_session_resumes_with_the_same_sample(serving, admin_client):
    """A non-deterministic sampler: no token is released before a checkpoint covers it, so the
    resumed instance draws every later token itself from the restored (seed, step)."""
    run = fail_over(serving, "e3", TOP_P, seed=6)
    check_resumed(serving, run, admin_client)
    from sessions.models import Session

    checkpoint = Session.objects.get(session=run["session"]).checkpoint
    assert checkpoint["sampler"]["method"] == "top-p"
    assert checkpoint["sampler"]["deterministic"] is False
    assert checkpoint["sampler"]["params"] == {"p": 0.9, "temperature": 0.8, "max_tokens": 48}


def test_a_paused_instance_is_refused_everything_after_its_failover(serving):
    from index.models import Replica, Scope
    from index.scopekeys import open_scope_key
    from kvsp.blockkeys import block_keys
    from sessions.models import OutputToken

    run = fail_over(serving, "e4", GREEDY, seed=8, pause=True)
    session, node = run["session"], run["node"]
    try:
        wait_until(
            lambda: (row := session_row(session)).epoch >= 2 and row.state == "completed",
            "the session completed elsewhere",
            timeout=60,
        )
        scope = Scope.objects.get(scope_id=bytes.fromhex(serving.cluster.scope_a))
        keys = block_keys(
            open_scope_key(scope.scope_id, scope.key_ciphertext),
            bytes.fromhex(serving.compat),
            run["prompt"] + run["expected"],
            BLOCK_TOKENS,
        )

        def published_by_a() -> set[bytes]:
            return {
                bytes(key)
                for key in Replica.objects.filter(
                    holder__url=node.url, block_key__in=keys
                ).values_list("block_key", flat=True)
            }

        before = published_by_a()
    finally:
        for process in (node.worker, node.server):
            process.signal(signal.SIGCONT)
    zombie = wait_until(
        lambda: (z := served_rows(session)[0]).state != "running" and z, "the paused run's end"
    )
    assert zombie.epoch == 1 and zombie.state == "superseded"
    assert "kvsp-stale-epoch" in zombie.reason
    row = session_row(session)
    # Nothing A sent after the failover was taken: no output of epoch 1 arrived later, and no
    # checkpoint of its replaced the new epoch's.
    late = OutputToken.objects.filter(
        session__session=session, epoch=1, delivered_at__gt=row.failed_over_at
    )
    assert not late.exists()
    assert row.checkpoint_epoch == row.epoch >= 2
    # A published only blocks that a checkpoint the PC acknowledged under epoch 1 covers (one
    # in flight when it was paused may have landed after), and nothing once it was refused.
    ended = published_by_a()
    covered = (len(run["prompt"]) + zombie.checkpoint_offset) // BLOCK_TOKENS
    published = sorted(keys.index(key) for key in ended)
    assert before <= ended and published and published[-1] < covered, (published, covered)
    time.sleep(1)
    assert published_by_a() == ended
    tokens = delivered(serving, session)
    assert [t["token"] for t in tokens] == run["expected"]
    assert run["stream"].tokens() == run["expected"]


# --- What the node refuses ----------------------------------------------------------------------


def test_generate_is_checked_before_anything_is_admitted(serving):
    cluster = serving.cluster
    prompt = prompt_tokens(12, seed=9)
    session = str(uuid.uuid4())
    body = {
        "session": session,
        "scope_id": cluster.scope_a,
        "compat_id": serving.compat,
        "prompt": prompt,
        "max_tokens": 2,
        "sampler": GREEDY,
    }
    e1 = serving.node("e1")
    reader = e1.api(cluster.tokens["reader_a"])
    cases = [
        (e1.api(None).post("generate", json=body), 401, "kvsp-unauthenticated"),
        (e1.api(cluster.tokens["reader_b"]).post("generate", json=body), 403, "kvsp-forbidden"),
        (reader.post("generate", json=[body]), 400, "kvsp-malformed-request"),
        (reader.post("generate", json={**body, "session": "7"}), 400, "kvsp-malformed-request"),
        (reader.post("generate", json={**body, "prompt": []}), 422, "kvsp-invalid-record"),
        (reader.post("generate", json={**body, "prompt": [5, 320]}), 422, "kvsp-invalid-record"),
        (reader.post("generate", json={**body, "max_tokens": 0}), 422, "kvsp-invalid-record"),
        (reader.post("generate", json={**body, "max_tokens": 4090}), 422, "kvsp-invalid-record"),
        (
            reader.post("generate", json={**body, "sampler": {"method": "beam"}}),
            422,
            "kvsp-invalid-record",
        ),
        (
            reader.post(
                "generate", json={**body, "sampler": {"method": "greedy", "params": {"k": 4}}}
            ),
            422,
            "kvsp-invalid-record",
        ),
        (
            reader.post(
                "generate",
                json={**body, "sampler": {"method": "greedy", "params": {"max_tokens": 4}}},
            ),
            422,
            "kvsp-invalid-record",
        ),
        (
            reader.post("generate", json={**body, "compat_id": cluster.compat}),
            422,
            "kvsp-compat-mismatch",
        ),
        (
            cluster.node("n1").api(cluster.tokens["reader_a"]).post("generate", json=body),
            409,
            "kvsp-invalid-state",
        ),
    ]
    assert_problems(cases)
    assert not served_rows(session)

    first = reader.post("generate", json=body)
    again = reader.post("generate", json=body)
    assert first.status_code == again.status_code == 202
    # A repeat is the same session, answered as it stands now: the worker may have started it.
    assert {first.json()["state"], again.json()["state"]} <= {"accepted", "running"}
    assert {**first.json(), "state": None} == {**again.json(), "state": None}
    clash = reader.post("generate", json={**body, "max_tokens": 3})
    assert clash.status_code == 409 and problem(clash) == "kvsp-conflict"
    completed(session)
    assert [row.epoch for row in served_rows(session)] == [1]


def test_resume_is_the_controllers_and_checked(serving):
    cluster = serving.cluster
    session = str(uuid.uuid4())
    checkpoint = {
        "session": session,
        "epoch": 1,
        "compat_id": serving.compat,
        "scope_id": cluster.scope_a,
        "prompt_blocks": [],
        "prompt_tail": prompt_tokens(5, seed=10),
        "generated": [],
        "output_offset": 0,
        "sampler": {**GREEDY, "step": 0, "deterministic": True},
    }
    body = {
        "session": session,
        "epoch": 3,
        "checkpoint": checkpoint,
        "blocks": [],
        "resident": [],
        "deadline_ms": 2000,
        "lease_ms": 2000,
    }
    e1 = serving.node("e1")
    controller = e1.api(cluster.tokens["controller"])
    path = f"sessions/{session}/resume"
    unknown_block = os.urandom(32).hex()
    cases = [
        (e1.api(cluster.tokens["reader_a"]).post(path, json=body), 403, "kvsp-forbidden"),
        (
            controller.post(f"sessions/{uuid.uuid4()}/resume", json=body),
            400,
            "kvsp-malformed-request",
        ),
        (
            controller.post(path, json={**body, "epoch": 1}),
            422,
            "kvsp-invalid-record",
        ),
        (
            controller.post(path, json={**body, "checkpoint": {**checkpoint, "prompt_tail": []}}),
            422,
            "kvsp-invalid-record",
        ),
        (
            controller.post(
                path, json={**body, "checkpoint": {**checkpoint, "prompt_blocks": [unknown_block]}}
            ),
            409,
            "kvsp-conflict",
        ),
        (
            controller.post(
                path, json={**body, "checkpoint": {**checkpoint, "compat_id": cluster.compat}}
            ),
            422,
            "kvsp-compat-mismatch",
        ),
    ]
    assert_problems(cases)
    assert not served_rows(session)

    # Epoch 3 was never issued by the PC: the node admits the resume, and its first checkpoint
    # is refused, so it sends nothing else.
    accepted = controller.post(path, json=body)
    assert accepted.status_code == 202, accepted.text
    again = controller.post(path, json=body).json()  # the same resume, as it stands now
    assert {accepted.json()["state"], again["state"]} <= {"accepted", "running"}
    assert {**again, "state": None} == {**accepted.json(), "state": None}
    stale = controller.post(path, json={**body, "epoch": 2})
    assert stale.status_code == 409 and problem(stale) == "kvsp-stale-epoch"
    row = wait_until(
        lambda: (r := served_rows(session)[0]).state not in ("accepted", "running") and r,
        "the resume's end",
    )
    assert (row.state, row.epoch, row.released, row.checkpoints) == ("failed", 3, 0, 0)
    assert session_row(session) is None
