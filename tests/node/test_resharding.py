"""Resharding on real nodes (spec 6.9): the Placement Controller moves a Shard Map between
versions with its two-phase commit, and the members fetch, keep, publish and release blocks.

Besides the package's cluster, this module starts three storage nodes ``r1``-``r3`` (blocks of
8 tokens of the reference model). Their maps carry the context (scope, Compatibility ID, block
size, Block Keys), so each plan names the blocks of its ranges. One run is on real tensors: a
context prefilled with the reference engine in this process, sharded, resharded, gathered
again from the new holders and decoded. The others use blocks of seeded noise and break
something: a member stopped with SIGSTOP, a member killed after it acknowledged, the
controller's worker killed between prepare and commit.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from tests.node.conftest import Node, extra_node, start_all
from tests.node.support import blocks_sent, container, problem, random_key
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db

BLOCK_TOKENS = 8


@dataclass
class Sharding:
    cluster: object
    compat: str
    scope_key: bytes
    nodes: dict[str, Node]
    run: str

    @property
    def scope(self) -> str:
        return self.cluster.scope_a

    def node(self, key: str) -> Node:
        return self.nodes[key]

    def controller(self, base: str | None = None):
        from tests.node.support import Api

        return Api(base or self.cluster.cp_url, self.cluster.tokens["controller"])

    def place(self, node: Node, keys: list[str], blocks: list[bytes]) -> None:
        """PUT the blocks on ``node`` (6.7); it stores and publishes each."""
        api = node.api(self.cluster.tokens["reader_a"])
        for key, data in zip(keys, blocks, strict=True):
            stored = api.put_block(self.compat, self.scope, key, data)
            assert stored.status_code == 201, stored.text

    def shards(self, *spans) -> list[dict]:
        """Shards from (first block, end block, node) spans."""
        return [
            {"tokens": [first * BLOCK_TOKENS, end * BLOCK_TOKENS], "instance": node.url}
            for first, end, node in spans
        ]

    def context(self, keys: list[str]) -> dict:
        return {
            "scope_id": self.scope,
            "compat_id": self.compat,
            "block_tokens": BLOCK_TOKENS,
            "block_keys": keys,
        }

    def put_map(self, name: str, keys: list[str], *spans) -> None:
        document = {
            "map": name,
            "version": 1,
            "shards": self.shards(*spans),
            "context": self.context(keys),
        }
        created = self.controller().put(f"shardmaps/{name}", json=document)
        assert created.status_code == 201, created.text

    def halves(self, label: str) -> tuple[str, list[str]]:
        """A map of 16 noise blocks, the first 8 held by r1 and the rest by r2, as version 1:
        its name and its keys."""
        a, b = self.node("r1"), self.node("r2")
        keys, blocks = noise_blocks(16)
        name = f"{label}-{self.run}"
        self.place(a, keys[:8], blocks[:8])
        self.place(b, keys[8:], blocks[8:])
        self.put_map(name, keys, (0, 8, a), (8, 16, b))
        return name, keys

    def reshard(self, name: str, *spans, deadline_ms: int) -> dict:
        body = {"shards": self.shards(*spans), "deadline_ms": deadline_ms}
        started = self.controller().post(f"shardmaps/{name}/reshard", json=body)
        assert started.status_code == 202, started.text
        return started.json()

    def operation(self, name: str, to: int = 2) -> dict:
        return self.controller().get(f"shardmaps/{name}/reshards/{to}").json()

    def finished(self, name: str, to: int = 2, timeout: float = 60) -> dict:
        """The operation once every member has been told its outcome."""

        def told():
            operation = self.operation(name, to)
            members = {plan["instance"] for plan in operation["plans"]}
            return operation if members <= set(operation["informed"]) else None

        return wait_until(told, f"reshard of {name} finished", timeout=timeout)

    def holders(self, key: str) -> set[str]:
        """The holders the Index Service lists for a block."""
        answer = self.controller().get(f"replicas/{self.compat}/{self.scope}/{key}")
        if answer.status_code == 404:
            return set()
        return {replica["holder"] for replica in answer.json()["replicas"]}

    def move(self, node: Node, name: str, to: int = 2):
        """The node's latest try of a move."""
        tries = self.tries(node, name, to)
        return tries[0] if tries else None

    def tries(self, node: Node, name: str, to: int = 2) -> list:
        """The node's tries of a move, the latest first."""
        from workers.models import ReshardMove

        return list(
            ReshardMove.objects.filter(instance=node.name, map=name, to_version=to).order_by("-pk")
        )

    def rows(self, node: Node, keys: list[str]) -> dict:
        from workers.models import StoredBlock

        found = StoredBlock.objects.filter(
            instance=node.name, block_key__in=[bytes.fromhex(key) for key in keys]
        )
        return {row.block_key_hex: row for row in found}

    def path_of(self, node: Node, key: str):
        """Where ``node`` keeps a block's serving copy (the host tier: these nodes never
        spill to disk)."""
        from workers.tiers import file_name

        ids = (bytes.fromhex(self.compat), bytes.fromhex(self.scope), bytes.fromhex(key))
        return node.shm_dir / node.name / file_name(ids)

    def direct_plan(self, name: str, keys: list[str]) -> dict:
        """A plan of map ``name`` from version 1 to 2 for a member holding the four blocks
        ``keys``: it keeps the first two and releases the others."""
        return {
            "map": name,
            "from": 1,
            "to": 2,
            "deadline_ms": 5000,
            "retain": [[0, 2 * BLOCK_TOKENS]],
            "fetch": [],
            "release": [[2 * BLOCK_TOKENS, 4 * BLOCK_TOKENS]],
            "scope_id": self.scope,
            "compat_id": self.compat,
            "block_tokens": BLOCK_TOKENS,
            "blocks": {str(i): key for i, key in enumerate(keys)},
        }

    def decide(self, node: Node, body: dict):
        return self.controller(node.url).post("reshard", json=body)


def noise_blocks(count: int) -> tuple[list[str], list[bytes]]:
    """Random keys and containers of seeded noise in the reference geometry, 8 tokens each."""
    return (
        [random_key() for _ in range(count)],
        [container(os.urandom(8), tokens=BLOCK_TOKENS) for _ in range(count)],
    )


@contextmanager
def paused(node: Node):
    """The node's processes stopped (SIGSTOP) for the block, continued (SIGCONT) after it."""
    for process in (node.worker, node.server):
        process.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in (node.worker, node.server):
            process.signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def sharding(cluster, django_db_blocker, role_env, log_dir):
    from index.models import Scope
    from index.scopekeys import open_scope_key
    from index.services import do_register_descriptor
    from kvsp.compat import compat_id_hex
    from workers.engines.modeldir import reference_descriptor

    run = os.urandom(3).hex()
    descriptor = reference_descriptor(cluster.model_dir, block_tokens=BLOCK_TOKENS)
    compat = compat_id_hex(descriptor)
    nodes: dict[str, Node] = {}
    with django_db_blocker.unblock():
        do_register_descriptor(descriptor, compat)
        scope = Scope.objects.get(scope_id=bytes.fromhex(cluster.scope_a))
        scope_key = open_scope_key(scope.scope_id, scope.key_ciphertext)
        for key in ("r1", "r2", "r3"):
            nodes[key] = extra_node(
                cluster, role_env, log_dir, f"{key}-{run}", [bytes(scope.scope_id)]
            )
    try:
        start_all([process for node in nodes.values() for process in node.processes()])
        yield Sharding(cluster, compat, bytes(scope_key), nodes, run)
    finally:
        for node in nodes.values():
            for process in (node.worker, node.server):
                if process is not None:
                    process.signal(signal.SIGCONT)
            node.stop()


@pytest.fixture(scope="module")
def engine(cluster):
    from workers.engines.reference import ReferenceEngine

    return ReferenceEngine(cluster.model_dir, block_tokens=BLOCK_TOKENS, device="cpu")


def owners(spans, count: int) -> list:
    """The member of each block under a map of (first block, end block, node) spans."""
    out = [None] * count
    for first, end, node in spans:
        out[first:end] = [node] * (end - first)
    return out


def reshard_and_check(sharding, name: str, keys: list[str], version: int, before, after) -> None:
    """Move the map from the ``before`` spans to the ``after`` spans and check that exactly the
    blocks changing hands moved, each sent once by its holder in the old version, and that the
    retained ones were not touched: the same files, never read, anywhere."""
    nodes = list(sharding.nodes.values())
    old, new = owners(before, len(keys)), owners(after, len(keys))
    retained = {
        key: node for key, node, next_node in zip(keys, old, new, strict=True) if node is next_node
    }
    files = {key: os.stat(sharding.path_of(node, key)).st_ino for key, node in retained.items()}
    accessed = {
        key: row.last_access
        for node in nodes
        for key, row in sharding.rows(node, list(retained)).items()
        if retained[key] is node
    }
    # The nodes mark a block used at every GET (conftest.ACCESS_RESOLUTION_MS): a read of a
    # retained block would show in its last access.
    sent = {node.name: sum(blocks_sent(node).values()) for node in nodes}

    body = {"shards": sharding.shards(*after), "deadline_ms": 30_000}
    started = sharding.controller().post(f"shardmaps/{name}/reshard", json=body)
    assert started.status_code == 202, started.text
    operation = sharding.finished(name, version)
    assert operation["state"] == "committed", operation

    sources = {node.name: 0 for node in nodes}
    gained = {node.name: 0 for node in nodes}
    for node, next_node in zip(old, new, strict=True):
        if node is not next_node:
            sources[node.name] += 1
            gained[next_node.name] += 1
    assert {
        node.name: sum(blocks_sent(node).values()) - sent[node.name] for node in nodes
    } == sources
    for node in nodes:
        move = sharding.move(node, name, version)
        assert (move.phase, move.fetched_blocks) == ("committed", gained[node.name])
        assert move.released_blocks == sources[node.name]
    for key, node in retained.items():
        assert os.stat(sharding.path_of(node, key)).st_ino == files[key]
        assert sharding.rows(node, [key])[key].last_access == accessed[key]
    for key, node in zip(keys, new, strict=True):
        assert sharding.holders(key) == {node.url}, key
    for node in nodes:
        held = sharding.rows(node, keys)
        assert set(held) == {key for key, owner in zip(keys, new, strict=True) if owner is node}
        assert all(row.pending_move_id is None for row in held.values())


def test_grow_shift_swap_and_shrink_on_real_tensors_move_only_what_changes_hands(sharding, engine):
    """A context prefilled with the reference engine is sharded over two members, then grown
    to three, shifted, swapped and shrunk back to two. Each time only the blocks that change
    hands move, and the retained ones are never read. The blocks gathered from the holders of
    the last version decode exactly as the unsharded cache."""
    from common.peers import BlockConnections
    from kvsp.blockkeys import block_keys
    from kvsp.records import ReplicaRecord
    from workers import fetch

    a, b, c = (sharding.node(key) for key in ("r1", "r2", "r3"))
    blocks = 48
    generator = torch.Generator().manual_seed(20261130)
    prompt = torch.randint(3, 320, (blocks * BLOCK_TOKENS + 3,), generator=generator).tolist()
    prefix, tail = prompt[: blocks * BLOCK_TOKENS], prompt[blocks * BLOCK_TOKENS :]
    unsharded = engine.prefill(prefix)
    octets = [bytes(bytearray().join(e.parts)) for e in engine.export_blocks(unsharded, 0, blocks)]
    expected = engine.extend(unsharded, tail)
    expected_next = engine.decode(unsharded, int(expected.argmax()))
    compat = bytes.fromhex(sharding.compat)
    keys = [key.hex() for key in block_keys(sharding.scope_key, compat, prefix, BLOCK_TOKENS)]

    name = f"real-{sharding.run}"
    versions = [
        [(0, 24, a), (24, 48, b)],
        [(0, 16, a), (16, 32, c), (32, 48, b)],  # grow from two to three
        [(0, 20, a), (20, 36, c), (36, 48, b)],  # shift
        [(0, 20, c), (20, 36, a), (36, 48, b)],  # swap a and c
        [(0, 28, a), (28, 48, b)],  # shrink back to two
    ]
    sharding.place(a, keys[:24], octets[:24])
    sharding.place(b, keys[24:], octets[24:])
    sharding.put_map(name, keys, *versions[0])

    # The plans of the grow, as the PC states them (DESIGN.md section 3) with their blocks.
    plans = {
        plan["instance"]: plan
        for plan in sharding.reshard(name, *versions[1], deadline_ms=30_000)["plans"]
    }
    assert plans[a.url]["retain"] == [[0, 128]] and plans[a.url]["release"] == [[128, 192]]
    assert plans[c.url]["fetch"] == [
        {"tokens": [128, 192], "from": a.url},
        {"tokens": [192, 256], "from": b.url},
    ]
    assert plans[c.url]["blocks"] == {str(i): keys[i] for i in range(16, 32)}
    assert plans[b.url]["retain"] == [[256, 384]] and plans[b.url]["release"] == [[192, 256]]
    assert sharding.finished(name)["state"] == "committed"
    gained = sharding.move(c, name)
    assert (gained.fetched_blocks, gained.fetched_octets) == (16, sum(map(len, octets[16:32])))

    for version in range(3, len(versions) + 1):
        reshard_and_check(
            sharding, name, keys, version, versions[version - 2], versions[version - 1]
        )

    # Gathered per the last version from its holders, verified against their records, decoded.
    reader = BlockConnections({"Authorization": f"Bearer {sharding.cluster.tokens['reader_a']}"})
    gathered = []
    for key, owner in zip(keys, owners(versions[-1], blocks), strict=True):
        listed = sharding.controller().get(f"replicas/{sharding.compat}/{sharding.scope}/{key}")
        record = ReplicaRecord.from_json(listed.json()["replicas"][0])
        assert record.holder == owner.url
        fetched = fetch.fetch_block(reader, owner.url, record, max_size=1 << 20)
        gathered.append(bytearray(fetched.buffer))
    assert [bytes(data) for data in gathered] == octets
    sharded = engine.import_blocks(gathered, tokens=prefix, compat_id=sharding.compat)
    logits = engine.extend(sharded, tail)
    assert torch.equal(logits, expected)
    assert torch.equal(engine.decode(sharded, int(logits.argmax())), expected_next)


def test_a_member_that_never_acknowledges_aborts_and_what_it_fetched_is_discarded(sharding):
    """b is stopped: neither its plan nor c's fetch from it can finish. The PC aborts; c
    discards the blocks it had fetched from a; nothing is released."""
    a, b, c = (sharding.node(key) for key in ("r1", "r2", "r3"))
    name, keys = sharding.halves("stopped")
    with paused(b):
        sharding.reshard(name, (0, 4, a), (4, 12, c), (12, 16, b), deadline_ms=3000)
        wait_until(
            lambda: (move := sharding.move(c, name)) is not None and move.phase == "aborted",
            "c told to abort",
        )
        operation = sharding.operation(name)
        assert operation["state"] == "aborted" and b.url in operation["reason"]
        assert operation["acknowledged"] == [a.url]
        # c had fetched a's four blocks before b's stalled; they are gone, never published.
        assert sharding.move(c, name).fetched_blocks == 4
        assert sharding.rows(c, keys) == {}
        assert not any(sharding.path_of(c, key).exists() for key in keys)
        for key in keys[4:8]:
            assert sharding.holders(key) == {a.url}
        wait_until(lambda: sharding.move(a, name).phase == "aborted", "a told to abort")
        assert set(sharding.rows(a, keys)) == set(keys[:8])  # nothing released
    operation = sharding.finished(name)
    assert sharding.move(b, name).phase == "aborted"
    assert set(sharding.rows(b, keys)) == set(keys[8:])
    for i, key in enumerate(keys):
        assert sharding.holders(key) == {(a if i < 8 else b).url}
    for node in (a, b, c):
        assert sharding.move(node, name).released_blocks == 0
    current = sharding.controller().get(f"shardmaps/{name}").json()
    assert current["version"] == 1  # version 1 stayed authoritative

    # Version 1 is still authoritative: the same reshard again is attempt 2, and commits.
    again = sharding.reshard(name, (0, 4, a), (4, 12, c), (12, 16, b), deadline_ms=30_000)
    assert (again["to"], again["attempt"]) == (2, 2)
    operation = sharding.finished(name)
    assert (operation["attempt"], operation["state"]) == (2, "committed"), operation
    assert (sharding.move(c, name).attempt, sharding.move(c, name).fetched_blocks) == (2, 8)
    # A lease c asked b for in the first try, granted once b woke up, may hold b's release back
    # until it ends (6.6).
    wait_until(
        lambda: all(
            sharding.holders(key) == {(a if i < 4 else c if i < 12 else b).url}
            for i, key in enumerate(keys)
        ),
        "the blocks at their holders of version 2",
        timeout=60,
    )
    assert sharding.controller().get(f"shardmaps/{name}").json()["version"] == 2


def test_a_member_killed_after_acknowledging_applies_the_commit_after_its_restart(sharding):
    """c acknowledges (its blocks pending), then dies; b, stopped until then, acknowledges
    last. The PC commits and keeps telling c, which, restarted, holds and publishes what it had
    fetched."""
    a, b, c = (sharding.node(key) for key in ("r1", "r2", "r3"))
    name, keys = sharding.halves("killed")
    with paused(b):
        sharding.reshard(name, (0, 4, a), (4, 8, c), (8, 16, b), deadline_ms=30_000)
        wait_until(
            lambda: {a.url, c.url} <= set(sharding.operation(name)["acknowledged"]),
            "a and c acknowledged",
        )
        c.worker.kill()
        c.server.kill()
    wait_until(lambda: sharding.operation(name)["state"] == "committed", "committed")
    wait_until(lambda: sharding.move(a, name).released_blocks == 4, "a released its four")
    pending = sharding.rows(c, keys[4:8])
    assert len(pending) == 4 and all(row.pending_move_id for row in pending.values())
    assert all(sharding.holders(key) == set() for key in keys[4:8])  # c has not heard yet

    c.restart()
    sharding.finished(name)
    move = sharding.move(c, name)
    assert (move.phase, move.fetched_blocks) == ("committed", 4)
    held = sharding.rows(c, keys)
    assert set(held) == set(keys[4:8]) and all(r.pending_move_id is None for r in held.values())
    for i, key in enumerate(keys):
        assert sharding.holders(key) == {(a if i < 4 else c if i < 8 else b).url}
    # The restarted node answers the decisions as before.
    assert sharding.decide(c, {"map": name, "commit": 2}).status_code == 200
    assert problem(sharding.decide(c, {"map": name, "abort": 2})) == "kvsp-invalid-state"
    assert set(sharding.rows(c, keys)) == set(keys[4:8])


def test_a_pc_restart_between_prepare_and_commit_is_finished_by_resume_reshards(sharding):
    """The controller's worker dies while it waits for b (a and c have acknowledged); started
    again, ``resume_reshards`` sends b its plan again and commits."""
    from placement.tasks import resume_reshards

    a, b, c = (sharding.node(key) for key in ("r1", "r2", "r3"))
    name, keys = sharding.halves("pc-restart")
    worker = sharding.cluster.control_worker
    with paused(b):
        sharding.reshard(name, (0, 4, a), (4, 8, c), (8, 16, b), deadline_ms=30_000)
        wait_until(
            lambda: {a.url, c.url} <= set(sharding.operation(name)["acknowledged"]),
            "a and c acknowledged",
        )
        worker.kill()
    try:
        assert sharding.operation(name)["state"] == "preparing"
        assert sharding.rows(a, keys[4:8]).keys() == set(keys[4:8])  # nothing released yet
    finally:
        worker.start()
    resume_reshards.delay()
    operation = sharding.finished(name)
    assert operation["state"] == "committed"
    assert b.url in operation["acknowledged"]
    for i, key in enumerate(keys):
        assert sharding.holders(key) == {(a if i < 4 else c if i < 8 else b).url}
    assert sharding.controller().get(f"shardmaps/{name}").json()["version"] == 2


def test_decisions_are_idempotent_late_ones_refused_and_a_leased_block_waits(sharding):
    """Plans, commits and aborts sent straight to a node, as the controller: repeats are
    harmless, the opposite decision is refused, a decision without a plan is recorded, and a
    block to release stays while a lease covers it."""
    a = sharding.node("r1")
    keys, blocks = noise_blocks(4)
    sharding.place(a, keys, blocks)
    name = f"direct-{sharding.run}"
    identity = {"scope_id": sharding.scope, "compat_id": sharding.compat, "block_tokens": 8}
    plan = sharding.direct_plan(name, keys)
    reader = a.api(sharding.cluster.tokens["reader_a"])
    lease = reader.post(
        "leases",
        json={
            "compat_id": sharding.compat,
            "scope_id": sharding.scope,
            "block_keys": [keys[2]],
            "ttl_ms": 60_000,
        },
    )
    assert lease.status_code == 201, lease.text

    assert problem(a.api(sharding.cluster.tokens["reader_a"]).post("reshard", json=plan)) == (
        "kvsp-forbidden"
    )
    first = sharding.decide(a, plan)
    assert first.status_code == 200, first.text
    assert first.json()["state"] == "preparing" and first.json()["loaded"]
    assert sharding.decide(a, plan).status_code == 200  # the same plan again
    other = {**plan, "retain": [[0, 8]], "release": [[8, 32]]}
    assert problem(sharding.decide(a, other)) == "kvsp-conflict"

    committed = sharding.decide(a, {"map": name, "commit": 2})
    assert committed.status_code == 200 and committed.json()["state"] == "committed"
    assert committed.json()["released_blocks"] == 1 and committed.json()["owed_release"] == 1
    assert set(sharding.rows(a, keys)) == set(keys[:3])  # block 3 released, block 2 leased
    assert sharding.holders(keys[3]) == set() and sharding.holders(keys[2]) == {a.url}
    assert sharding.decide(a, {"map": name, "commit": 2}).status_code == 200
    assert problem(sharding.decide(a, {"map": name, "abort": 2})) == "kvsp-invalid-state"
    assert problem(sharding.decide(a, plan)) == "kvsp-invalid-state"
    assert set(sharding.rows(a, keys)) == set(keys[:3])

    assert reader.delete(f"leases/{lease.json()['lease']}").status_code == 204
    assert set(sharding.rows(a, keys)) == set(keys[:2])  # released when its lease ended
    assert sharding.holders(keys[2]) == set()
    move = sharding.move(a, name)
    assert move.released_blocks == 2 and move.finished_at is not None

    # Decisions for moves this node never had a plan of: recorded, nothing to do.
    never = f"never-{sharding.run}"
    assert sharding.decide(a, {"map": never, "commit": 7}).status_code == 200
    assert problem(sharding.decide(a, {"map": never, "abort": 7})) == "kvsp-invalid-state"
    assert sharding.decide(a, {"map": never, "abort": 8}).json()["state"] == "aborted"
    assert sharding.decide(a, {"map": never, "abort": 8}).status_code == 200
    assert problem(sharding.decide(a, {"map": never, "commit": 8})) == "kvsp-invalid-state"
    # After an abort, a plan is the controller's next try of the move.
    again = sharding.decide(a, {**plan, "map": never, "from": 7, "to": 8})
    assert again.status_code == 200 and again.json()["state"] == "preparing", again.text
    assert sharding.decide(a, {"map": never, "abort": 8}).json()["state"] == "aborted"

    # Versions are stored whole, up to the largest JSON integer the records admit.
    assert sharding.decide(a, {"map": never, "commit": 2**53 - 1}).status_code == 200
    # A retained range may be far wider than the blocks the plan names: nothing walks it (a
    # walk of 2^32 blocks would outlast the client's timeout).
    wide = {**plan, "map": f"w-{sharding.run}", "block_tokens": 1, "deadline_ms": 1000}
    wide.update(retain=[[0, 2**32 - 1]], release=[], blocks={"0": keys[0]})
    answered = sharding.decide(a, wide)
    assert answered.status_code == 200, answered.text

    # Plans this node cannot carry out.
    patient = {**plan, "map": f"p-{sharding.run}", "deadline_ms": 600_001}
    assert problem(sharding.decide(a, patient)) == "kvsp-invalid-record"
    elsewhere = {**plan, "map": f"x-{sharding.run}", "instance": sharding.node("r2").url}
    assert problem(sharding.decide(a, elsewhere)) == "kvsp-invalid-record"
    fetch = [{"tokens": [0, 8], "from": sharding.node("r2").url}]
    unnamed = {"map": f"y-{sharding.run}", "from": 1, "to": 2, "deadline_ms": 100}
    unnamed.update(retain=[], fetch=fetch, release=[])
    refused = sharding.decide(a, unnamed)
    assert problem(refused) == "kvsp-invalid-record" and "Block Keys" in refused.json()["detail"]
    split = {
        **unnamed,
        **identity,
        "blocks": {"0": keys[0]},
        "fetch": [{**fetch[0], "tokens": [0, 4]}],
    }
    assert problem(sharding.decide(a, split)) == "kvsp-invalid-record"
    assert sharding.move(a, f"y-{sharding.run}") is None


def test_after_an_abort_the_next_try_is_accepted_and_a_late_abort_of_the_first_changes_nothing(
    sharding,
):
    """The controller numbers its tries of a move (the extension member ``attempt``): after
    the abort of try 1, the plan of try 2 is a move of its own; try 1's abort, repeated late,
    and its plan or commit change nothing of it. The move is then committed and released."""
    a = sharding.node("r1")
    keys, blocks = noise_blocks(4)
    sharding.place(a, keys, blocks)
    name = f"tries-{sharding.run}"
    plan = sharding.direct_plan(name, keys)
    first = sharding.decide(a, {**plan, "attempt": 1})
    assert first.status_code == 200 and first.json()["attempt"] == 1, first.text
    assert sharding.decide(a, {"map": name, "abort": 2, "attempt": 1}).status_code == 200
    assert problem(sharding.decide(a, {**plan, "attempt": 1})) == "kvsp-invalid-state"

    second = sharding.decide(a, {**plan, "attempt": 2})
    assert second.status_code == 200, second.text
    assert (second.json()["attempt"], second.json()["state"]) == (2, "preparing")
    late = sharding.decide(a, {"map": name, "abort": 2, "attempt": 1})
    assert (late.status_code, late.json()["attempt"], late.json()["state"]) == (200, 1, "aborted")
    assert problem(sharding.decide(a, {"map": name, "commit": 2, "attempt": 1})) == (
        "kvsp-invalid-state"
    )
    assert problem(sharding.decide(a, {**plan, "attempt": 1})) == "kvsp-invalid-state"
    assert sharding.move(a, name).phase == "preparing"
    assert set(sharding.rows(a, keys)) == set(keys)  # nothing released by try 1

    committed = sharding.decide(a, {"map": name, "commit": 2, "attempt": 2})
    assert committed.status_code == 200, committed.text
    assert (committed.json()["state"], committed.json()["released_blocks"]) == ("committed", 2)
    assert set(sharding.rows(a, keys)) == set(keys[:2])
    assert problem(sharding.decide(a, {**plan, "attempt": 3})) == "kvsp-invalid-state"
    assert problem(sharding.decide(a, {"map": name, "abort": 2, "attempt": 2})) == (
        "kvsp-invalid-state"
    )
    assert problem(sharding.decide(a, {**plan, "attempt": 0})) == "kvsp-invalid-record"

    # A try still preparing when a later one's plan arrives is given up for it.
    other = f"superseded-{sharding.run}"
    retain = {**plan, "map": other, "release": [], "blocks": {"0": keys[0], "1": keys[1]}}
    assert sharding.decide(a, {**retain, "attempt": 1}).status_code == 200
    assert sharding.decide(a, {**retain, "attempt": 2}).status_code == 200
    tries = sharding.tries(a, other)
    assert [(move.attempt, move.phase) for move in tries] == [(2, "preparing"), (1, "aborted")]
    assert sharding.decide(a, {"map": other, "commit": 2, "attempt": 2}).status_code == 200
