"""Block storage and retrieval on a real node (spec 6.7): PUT with If-None-Match, GET of the
whole container or of a layer range, Repr-Digest, Cache-Control, misses and scopes."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from devtools.processes import run_manage
from kvsp.container import decode
from kvsp.reprdigest import repr_digest_header, verify_repr_digest
from tests.node.conftest import REPLICA_TTL_MS
from tests.node.support import (
    BLOCK,
    assert_problems,
    block_gets,
    blocks_sent,
    container,
    layer_digests,
    problem,
    random_key,
    sha256,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db


def test_put_publishes_and_get_returns_the_container(cluster):
    n1 = cluster.node("n1")
    writer = n1.api(cluster.tokens["reader_a"])
    key, data = random_key(), container(1)
    stored = writer.put_block(cluster.compat, cluster.scope_a, key, data)
    assert stored.status_code == 201, stored.text
    record = stored.json()
    assert record["holder"] == n1.url and record["size"] == len(data)
    assert record["layer_digests"] == layer_digests(data)
    assert record["residency"] == [{"tier": "host", "layers": [0, 3], "read_mbit_per_s": 200_000}]
    assert stored.headers["location"] == f"{n1.url}blocks/{cluster.compat}/{cluster.scope_a}/{key}"

    listed = cluster.control("reader_a").get(f"replicas/{cluster.compat}/{cluster.scope_a}/{key}")
    assert listed.status_code == 200
    [replica] = listed.json()["replicas"]
    assert replica["holder"] == n1.url and replica["digest"] == record["digest"]

    got = writer.get_block(cluster.compat, cluster.scope_a, key)
    assert got.status_code == 200
    assert got.content == data
    assert got.headers["content-type"] == BLOCK
    assert got.headers["repr-digest"] == repr_digest_header(sha256(data))
    verify_repr_digest(got.headers["repr-digest"], got.content)
    cache = got.headers["cache-control"]
    assert cache.startswith("private, immutable, max-age=")
    max_age = int(re.search(r"max-age=(\d+)", cache)[1])
    assert 0 < max_age <= REPLICA_TTL_MS // 1000


def test_layer_range_is_a_slice_of_the_stored_container(cluster):
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    key, data = random_key(), container(2)
    assert api.put_block(cluster.compat, cluster.scope_a, key, data).status_code == 201
    whole = decode(data)

    got = api.get_block(cluster.compat, cluster.scope_a, key, layers="1-2")
    assert got.status_code == 200
    verify_repr_digest(got.headers["repr-digest"], got.content)
    part = decode(got.content)
    assert (part.first_layer, part.layer_count, part.token_count) == (1, 2, 16)
    for layer in (1, 2):
        assert bytes(part.layer(layer)[0]) == bytes(whole.layer(layer)[0])
        assert bytes(part.layer(layer)[1]) == bytes(whole.layer(layer)[1])
    part.verify_layer_digests(layer_digests(data), expected_first_layer=0)
    # The data of the range is one contiguous run of the stored file.
    start, end = whole.data_range(1, 2)
    assert got.content[part.header_size :] == data[start:end]

    again = api.get_block(cluster.compat, cluster.scope_a, key, layers="1-2")
    assert again.content == got.content
    assert again.headers["repr-digest"] == got.headers["repr-digest"]
    full_range = api.get_block(cluster.compat, cluster.scope_a, key, layers="0-3")
    assert full_range.content == data


def test_layers_the_holder_lacks_and_codecs_it_does_not_serve(cluster):
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    key = random_key()
    assert api.put_block(cluster.compat, cluster.scope_a, key, container(3)).status_code == 201

    beyond = api.get_block(cluster.compat, cluster.scope_a, key, layers="2-4")
    assert beyond.status_code == 404
    assert problem(beyond) == "kvsp-layers-unavailable"
    assert api.get_block(cluster.compat, cluster.scope_a, key, codec="1").status_code == 200
    other = api.get_block(cluster.compat, cluster.scope_a, key, codec="2")
    assert other.status_code == 406
    assert problem(other) == "kvsp-unsupported-codec"
    for params, name in (
        ({"layers": "3-1"}, "kvsp-malformed-request"),
        ({"layers": "two"}, "kvsp-malformed-request"),
        ({"codec": "raw"}, "kvsp-malformed-request"),
        # Numbers are ASCII digits: int() would read these Devanagari and fullwidth ones.
        ({"layers": "१-२"}, "kvsp-malformed-request"),
        ({"layers": "1-２"}, "kvsp-malformed-request"),
        ({"layers": "+1-2"}, "kvsp-malformed-request"),
        ({"codec": "१"}, "kvsp-malformed-request"),
    ):
        bad = api.get_block(cluster.compat, cluster.scope_a, key, **params)
        assert bad.status_code == 400 and problem(bad) == name
    not_acceptable = api.get(
        f"blocks/{cluster.compat}/{cluster.scope_a}/{key}", headers={"Accept": "application/json"}
    )
    assert not_acceptable.status_code == 406
    assert problem(not_acceptable) == "kvsp-not-acceptable"


def test_second_put_is_412_and_keeps_the_first_copy(cluster):
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    key, first = random_key(), container(4)
    assert api.put_block(cluster.compat, cluster.scope_a, key, first).status_code == 201
    second = api.put_block(cluster.compat, cluster.scope_a, key, container(5))
    assert second.status_code == 412
    assert problem(second) == "kvsp-precondition-failed"
    assert api.get_block(cluster.compat, cluster.scope_a, key).content == first


def at_once(calls: list) -> list:
    """The answers of ``calls``, made from one thread each, released together."""
    start = threading.Barrier(len(calls))

    def call(made):
        start.wait()
        return made()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(call, calls))


def test_concurrent_puts_of_one_key_store_exactly_one(cluster):
    """Two clients PUT different containers of one key at the same moment, through both of
    the node's HTTP processes: one gets 201, the other 412, and the holder serves the winner's
    octets under the winner's record."""
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    for round_ in range(12):
        key = random_key()
        bodies = [container(f"race-{round_}-{side}".encode()) for side in range(2)]
        answers = at_once(
            [partial(api.put_block, cluster.compat, cluster.scope_a, key, body) for body in bodies]
        )
        assert sorted(answer.status_code for answer in answers) == [201, 412], [
            answer.text for answer in answers
        ]
        winner = bodies[[answer.status_code for answer in answers].index(201)]
        assert api.get_block(cluster.compat, cluster.scope_a, key).content == winner
        listed = cluster.control("reader_a").get(
            f"replicas/{cluster.compat}/{cluster.scope_a}/{key}"
        )
        [replica] = listed.json()["replicas"]
        assert replica["layer_digests"] == layer_digests(winner)


def test_a_miss_and_another_scope_answer_alike(cluster):
    n1 = cluster.node("n1")
    key = random_key()
    assert (
        n1.api(cluster.tokens["reader_a"])
        .put_block(cluster.compat, cluster.scope_a, key, container(6))
        .status_code
        == 201
    )
    stranger = n1.api(cluster.tokens["reader_b"]).get_block(cluster.compat, cluster.scope_a, key)
    miss = n1.api(cluster.tokens["reader_a"]).get_block(
        cluster.compat, cluster.scope_a, random_key()
    )
    assert stranger.status_code == miss.status_code == 404
    assert stranger.json() == miss.json()
    assert problem(miss) == "kvsp-not-found"
    # The controller reads every scope.
    controller = n1.api(cluster.tokens["controller"])
    assert controller.get_block(cluster.compat, cluster.scope_a, key).status_code == 200
    assert n1.api(None).get_block(cluster.compat, cluster.scope_a, key).status_code == 401


# What a loader's GET sends (the container, no Accept) is answered on the view's lean path; an
# Accept that names more than the container goes through DRF's negotiation.
NEGOTIATED = {"Accept": "application/kvsp-block, application/json;q=0.1"}
# Fields that differ per response, whichever path answered it.
PER_RESPONSE = {"date", "server", "connection", "keep-alive"}


def answer(response) -> tuple:
    headers = {k: v for k, v in response.headers.items() if k not in PER_RESPONSE}
    if "cache-control" in headers:  # max-age counts down by the second
        headers["cache-control"] = re.sub(r"max-age=\d+", "max-age=N", headers["cache-control"])
    return response.status_code, headers, response.content


def test_a_loaders_get_is_answered_exactly_as_a_negotiated_one_and_counted(cluster):
    n1 = cluster.node("n1")
    key = random_key()
    reader = n1.api(cluster.tokens["reader_a"])
    assert reader.put_block(cluster.compat, cluster.scope_a, key, container(8)).status_code == 201
    block = f"blocks/{cluster.compat}/{cluster.scope_a}/{key}"
    miss = f"blocks/{cluster.compat}/{cluster.scope_a}/{random_key()}"
    cases = [
        (reader, block),
        (reader, f"{block}?layers=1-2"),
        (reader, f"{block}?layers=0-7"),
        (reader, f"{block}?layers=2"),
        (reader, f"{block}?codec=9"),
        (reader, miss),
        (n1.api(cluster.tokens["reader_b"]), block),  # another scope: like the miss
        (n1.api(None), block),
        (n1.api("kvsp_not-a-token"), block),
    ]
    gets = block_gets(n1.url)
    answers = []
    for api, path in cases:
        lean, negotiated = api.get(path), api.get(path, headers=NEGOTIATED)
        assert answer(lean) == answer(negotiated), path
        head = api.client.head(path)
        assert answer(head)[:2] == answer(lean)[:2] and head.content == b"", path
        answers.append(answer(lean))
    assert [status for status, _, _ in answers] == [200, 200, 404, 400, 406, 404, 404, 401, 401]
    assert answers[0][2] == container(8)
    assert answers[6] == answers[5]
    assert answers[0][1]["allow"] == "GET, PUT, HEAD, OPTIONS"
    assert "x-frame-options" not in answers[0][1]  # a node serves no pages to frame
    assert answers[0][1]["x-content-type-options"] == "nosniff"
    # Every GET is counted at /metrics, whichever path answered it (HEADs apart).
    assert block_gets(n1.url) - gets == 2 * len(cases)


def test_put_needs_the_scope_and_leaves_nothing_behind_when_refused(cluster):
    n1 = cluster.node("n1")
    files_before = n1.host_files()
    api = n1.api(cluster.tokens["reader_a"])
    key = random_key()
    put = partial(api.put_block, cluster.compat, cluster.scope_a, key)
    data = container(7)
    truncated = data[:-100]
    first_layer_1 = data[:8] + (1).to_bytes(4, "big") + data[12:]
    wrong_tokens = container(8, tokens=8)
    flipped = bytearray(data)
    flipped[-1] ^= 0x01  # in the data section: the container still parses
    flipped = bytes(flipped)
    cases = [
        (
            n1.api(cluster.tokens["reader_b"]).put_block(
                cluster.compat, cluster.scope_a, key, data
            ),
            403,
            "kvsp-forbidden",
        ),
        (
            api.put(
                f"blocks/{cluster.compat}/{cluster.scope_a}/{key}",
                content=data,
                headers={"Content-Type": BLOCK},
            ),
            428,
            "kvsp-precondition-failed",
        ),
        (
            put(data, **{"Content-Type": "application/json"}),
            415,
            "kvsp-unsupported-media-type",
        ),
        (put(b""), 411, "kvsp-malformed-request"),
        (put(truncated), 422, "kvsp-invalid-container"),
        (put(first_layer_1), 422, "kvsp-invalid-container"),
        (put(wrong_tokens), 422, "kvsp-invalid-container"),
        (
            put(data, **{"Repr-Digest": repr_digest_header(sha256(b"other"))}),
            422,
            "kvsp-digest-mismatch",
        ),
        (put(data, **{"Repr-Digest": "sha"}), 400, "kvsp-malformed-request"),
        # Without a Repr-Digest the body is still checked as a container.
        (put(truncated, **{"Repr-Digest": None}), 422, "kvsp-invalid-container"),
        (put(wrong_tokens, **{"Repr-Digest": None}), 422, "kvsp-invalid-container"),
        # Flipped in transit: the sender's Repr-Digest no longer matches.
        (
            put(flipped, **{"Repr-Digest": repr_digest_header(sha256(data))}),
            422,
            "kvsp-digest-mismatch",
        ),
    ]
    assert_problems(cases)
    assert api.get_block(cluster.compat, cluster.scope_a, key).status_code == 404
    assert n1.host_files() == files_before
    stored = put(data, **{"Repr-Digest": repr_digest_header(sha256(data))})
    assert stored.status_code == 201


def test_a_put_without_repr_digest_is_stored_and_served_with_one(cluster):
    """Spec 6.7 requires Repr-Digest of what holders return, not of what clients send."""
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    key, data = random_key(), container(9)
    stored = api.put_block(cluster.compat, cluster.scope_a, key, data, **{"Repr-Digest": None})
    assert stored.status_code == 201, stored.text
    got = api.get_block(cluster.compat, cluster.scope_a, key)
    assert got.content == data
    assert got.headers["repr-digest"] == repr_digest_header(sha256(data))
    again = api.put_block(cluster.compat, cluster.scope_a, key, data, **{"Repr-Digest": None})
    assert again.status_code == 412


def test_a_raw_container_no_layout_1_can_have_is_refused_under_any_compat(cluster):
    """Of a compat with no registered descriptor, only the container's own rules apply (4.3)."""
    from kvsp.container import RAW_CODEC, encode

    n1 = cluster.node("n1")
    api = n1.api(cluster.tokens["reader_a"])
    files_before = n1.host_files()
    compat = random_key()
    cannot_be = [
        encode(RAW_CODEC, 0, 2, [(bytes(8), bytes(6))]),
        encode(RAW_CODEC, 0, 2, [(bytes(8), bytes(8)), (bytes(4), bytes(4))]),
        encode(RAW_CODEC, 0, 4, [(bytes(6), bytes(6))]),
        encode(RAW_CODEC, 0, 0, [(bytes(2), bytes(2))]),
    ]
    for data in cannot_be:
        refused = api.put_block(compat, cluster.scope_a, random_key(), data)
        assert refused.status_code == 422 and problem(refused) == "kvsp-invalid-container"
        assert "codec raw" in refused.json()["detail"]
    assert n1.host_files() == files_before
    fits = encode(RAW_CODEC, 0, 2, [(bytes(8), bytes(8)), (bytes(8), bytes(8))])
    assert api.put_block(compat, cluster.scope_a, random_key(), fits).status_code == 201


def test_a_large_container_streams_both_ways(cluster):
    """4 MiB, of a compat with no registered descriptor: sent with sendfile, sliced by range."""
    api = cluster.node("n1").api(cluster.tokens["reader_a"])
    compat, key = random_key(), random_key()
    from kvsp.container import RAW_CODEC, encode

    sections = [(bytes([i]) * (256 << 10), bytes([i + 100]) * (256 << 10)) for i in range(8)]
    data = encode(RAW_CODEC, 0, 512, sections)
    assert api.put_block(compat, cluster.scope_a, key, data).status_code == 201
    got = api.get_block(compat, cluster.scope_a, key)
    assert got.content == data
    verify_repr_digest(got.headers["repr-digest"], got.content)
    part = api.get_block(compat, cluster.scope_a, key, layers="6-7")
    verify_repr_digest(part.headers["repr-digest"], part.content)
    assert bytes(decode(part.content).layer(7)[1]) == bytes([107]) * (256 << 10)


def test_a_revoked_token_stops_reading_and_leasing_blocks(cluster, role_env):
    """Block and lease requests take a verified token as it was for a short while
    (KVSP_AUTH_CACHE_S); a revocation still takes effect: the token is refused afterwards."""
    name, env = f"reader-{random_key()[:8]}", role_env()
    created = run_manage("kvsp_principal", "create", name, "--scope", cluster.scope_a, env=env)
    assert created.returncode == 0, created.stderr
    api = cluster.node("n1").api(json.loads(created.stdout)["token"])
    key = random_key()
    assert api.put_block(cluster.compat, cluster.scope_a, key, container(90)).status_code == 201
    assert api.get_block(cluster.compat, cluster.scope_a, key).status_code == 200

    revoked = run_manage("kvsp_principal", "revoke", name, env=env)
    assert revoked.returncode == 0, revoked.stderr
    # Each serving process may still take the token for KVSP_AUTH_CACHE_S after it last
    # verified it: each request is asked until it is refused.
    lease = {"compat_id": cluster.compat, "scope_id": cluster.scope_a, "block_keys": [key]}
    for request in (
        lambda: api.get_block(cluster.compat, cluster.scope_a, key),
        lambda: api.post("leases", json={**lease, "ttl_ms": 1000}),
    ):
        refused = wait_until(
            lambda request=request: (r := request()).status_code == 401 and r,
            "the revoked token refused",
            timeout=30,
        )
        assert problem(refused) == "kvsp-unauthenticated"


# --- Blocks in batches (docs/api.md "Blocks in batches") --------------------------------------


def batch_parts(response) -> list[tuple[dict, bytes]]:
    """The parts of a multipart/mixed answer: (header fields, body) each, read by the rules of
    RFC 2046 (a delimiter line, fields, a blank line, the body, a CRLF before the next)."""
    media_type, _, parameters = response.headers["content-type"].partition(";")
    assert media_type == "multipart/mixed"
    boundary = parameters.strip().removeprefix("boundary=").encode()
    body = response.content
    assert body.endswith(b"--" + boundary + b"--\r\n")
    assert int(response.headers["content-length"]) == len(body)
    parts = []
    for chunk in body.split(b"--" + boundary + b"\r\n")[1:]:
        head, _, rest = chunk.partition(b"\r\n\r\n")
        fields = dict(line.split(": ", 1) for line in head.decode().split("\r\n"))
        length = int(fields["Content-Length"])
        assert rest[length : length + 2] == b"\r\n"
        parts.append((fields, rest[:length]))
    return parts


def test_a_batch_answers_every_block_as_its_own_get_would_in_the_order_asked(cluster):
    n1 = cluster.node("n1")
    reader = n1.api(cluster.tokens["reader_a"])
    stored = {random_key(): container(seed) for seed in range(900, 904)}
    for key, data in stored.items():
        assert reader.put_block(cluster.compat, cluster.scope_a, key, data).status_code == 201
    missing = random_key()
    asked = [*list(stored)[:2], missing, *list(stored)[2:]]
    sent_before = blocks_sent(n1)
    answer = reader.post(f"blocks/{cluster.compat}/{cluster.scope_a}", json={"block_keys": asked})
    assert answer.status_code == 200, answer.text
    parts = batch_parts(answer)
    assert [fields["Content-Location"] for fields, _ in parts] == [
        f"blocks/{cluster.compat}/{cluster.scope_a}/{key}" for key in asked
    ]
    for key, (fields, body) in zip(asked, parts, strict=True):
        alone = reader.get_block(cluster.compat, cluster.scope_a, key)
        if key == missing:
            assert fields["Content-Type"] == "application/problem+json"
            assert json.loads(body) == alone.json()
            assert alone.status_code == 404
            continue
        assert fields["Content-Type"] == BLOCK
        assert body == alone.content == stored[key]
        assert fields["Repr-Digest"] == alone.headers["repr-digest"]
        verify_repr_digest(fields["Repr-Digest"], body)
    # Each block sent is counted once, as the batch's.
    assert blocks_sent(n1)["batch"] - sent_before["batch"] == len(stored)

    # Another scope's principal reads the same batch as all misses: nothing tells it apart.
    stranger = n1.api(cluster.tokens["reader_b"]).post(
        f"blocks/{cluster.compat}/{cluster.scope_a}", json={"block_keys": asked}
    )
    assert stranger.status_code == 200
    stranger_parts = batch_parts(stranger)
    assert [fields["Content-Type"] for fields, _ in stranger_parts] == [
        "application/problem+json"
    ] * len(asked)
    assert {body for _, body in stranger_parts} == {parts[2][1]}


@pytest.mark.parametrize(
    ("body", "status", "name"),
    [
        ({"block_keys": []}, 422, "kvsp-invalid-record"),
        ({"block_keys": ["AB" * 32]}, 422, "kvsp-invalid-record"),
        ({"block_keys": ["ab" * 32, "ab" * 32]}, 422, "kvsp-invalid-record"),
        ({"keys": ["ab" * 32]}, 422, "kvsp-invalid-record"),
        ([], 422, "kvsp-invalid-record"),
        ({"block_keys": ["ab" * 32] * 257}, 413, "kvsp-payload-too-large"),
    ],
)
def test_a_malformed_batch_is_refused_as_a_whole(cluster, body, status, name):
    n1 = cluster.node("n1")
    answer = n1.api(cluster.tokens["reader_a"]).post(
        f"blocks/{cluster.compat}/{cluster.scope_a}", json=body
    )
    assert answer.status_code == status, answer.text
    assert problem(answer) == name


def test_a_batch_needs_a_valid_token(cluster):
    n1 = cluster.node("n1")
    path = f"blocks/{cluster.compat}/{cluster.scope_a}"
    for token in (None, "kvsp_not-a-token"):
        answer = n1.api(token).post(path, json={"block_keys": [random_key()]})
        assert answer.status_code == 401 and problem(answer) == "kvsp-unauthenticated"


def test_the_batch_client_verifies_every_part_and_refuses_only_the_bad_one(cluster):
    from common.peers import BlockConnections
    from kvsp.records import ReplicaRecord
    from workers import fetch

    n1 = cluster.node("n1")
    reader = n1.api(cluster.tokens["reader_a"])
    records = []
    for seed in range(910, 914):
        key = random_key()
        answer = reader.put_block(cluster.compat, cluster.scope_a, key, container(seed))
        records.append(ReplicaRecord.from_json(answer.json()))
    # The holder's copy of the second block is damaged after it was stored: it sends the
    # damaged octets under the Repr-Digest of the original.
    [path] = [p for p in n1.host_files() if records[1].block_key in p.name]
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(damaged)
    missing = ReplicaRecord.from_json({**records[0].to_json(), "block_key": random_key()})
    asked = [*records, missing]
    with BlockConnections() as connections:
        outcomes = list(
            fetch.fetch_blocks(
                connections,
                n1.url,
                asked,
                max_size=1 << 20,
                token=cluster.tokens["reader_a"],
            )
        )
        assert [record for record, _ in outcomes] == asked
        kinds = [type(outcome).__name__ for _, outcome in outcomes]
        assert kinds == [
            "FetchedBlock",
            "ProtocolError",
            "FetchedBlock",
            "FetchedBlock",
            "SourceMiss",
        ]
        assert outcomes[1][1].problem == "kvsp-digest-mismatch"
        for record, outcome in (outcomes[0], outcomes[2], outcomes[3]):
            assert [d.hex() for d in outcome.layer_digests] == list(record.layer_digests)
        # The connection survives the refusals and serves the next batch.
        again = list(
            fetch.fetch_blocks(
                connections, n1.url, records[2:], max_size=1 << 20, token=cluster.tokens["reader_a"]
            )
        )
        assert all(isinstance(outcome, fetch.FetchedBlock) for _, outcome in again)
        with pytest.raises(fetch.BatchRefused) as refused:
            list(fetch.fetch_blocks(connections, n1.url, records, max_size=1 << 20, token="x"))
        assert not refused.value.unsupported
