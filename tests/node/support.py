"""Helpers of the node tests: containers of the reference geometry, HTTP calls with a token, and a
stand-in holder (a real HTTP server on loopback) whose blocks arrive as slowly, or as wrongly,
as a test needs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from kvsp.container import MEDIA_TYPE, RAW_CODEC, decode, encode, store_headers
from kvsp.reprdigest import repr_digest_header
from tests.support.waiting import wait_until

# The reference model's geometry (workers.engines.modeldir defaults): 4 layers, 2 KV heads of
# dimension 16, float32, blocks of 16 tokens: sections of 2 KiB, containers of 16,468 octets.
LAYERS = 4
BLOCK_TOKENS = 16
SECTION = BLOCK_TOKENS * 2 * 16 * 4
BLOCK = MEDIA_TYPE


def random_key() -> str:
    return os.urandom(32).hex()


def container(
    seed: int | bytes, *, layers: int = LAYERS, tokens: int = BLOCK_TOKENS, head_dim: int = 16
) -> bytes:
    """A codec raw container of the reference geometry (2 KV heads of float32) whose sections
    are seeded noise."""
    seed = seed if isinstance(seed, bytes) else seed.to_bytes(8, "big")
    section = tokens * 2 * head_dim * 4

    def noise(label: bytes) -> bytes:
        out = bytearray()
        counter = 0
        while len(out) < section:
            out += hashlib.sha256(seed + label + counter.to_bytes(4, "big")).digest()
            counter += 1
        return bytes(out[:section])

    sections = [(noise(b"k%d" % i), noise(b"v%d" % i)) for i in range(layers)]
    return encode(RAW_CODEC, 0, tokens, sections)


def lease_body(cluster, keys, ttl_ms=5000):
    return {
        "compat_id": cluster.compat,
        "scope_id": cluster.scope_a,
        "block_keys": keys,
        "ttl_ms": ttl_ms,
    }


def directive_body(cluster, blocks, *, deadline_ms=20_000, lease_ms=5_000) -> dict:
    return {
        "directive": str(uuid.uuid4()),
        "request_ref": "req-7",
        "scope_id": cluster.scope_a,
        "compat_id": cluster.compat,
        "blocks": [{"block_key": key, "sources": sources} for key, sources in blocks],
        "layer_order": "ascending",
        "deadline_ms": deadline_ms,
        "lease_ms": lease_ms,
    }


def run_directive(cluster, node, body, timeout=30) -> dict:
    controller = node.api(cluster.tokens["controller"])
    accepted = controller.post("prefetch", json=body)
    assert accepted.status_code == 202, accepted.text
    location = accepted.headers["location"]
    assert location == f"{node.url}prefetch/{body['directive']}"
    assert accepted.json()["state"] in ("pending", "complete", "partial", "failed")

    def final():
        state = controller.get(location).json()
        return state if state["state"] != "pending" else None

    return wait_until(final, "a final directive state", timeout=timeout)


def store(cluster, node, key: str, data: bytes) -> None:
    stored = node.api(cluster.tokens["reader_a"]).put_block(
        cluster.compat, cluster.scope_a, key, data
    )
    assert stored.status_code == 201


def put_chain(cluster, node, count: int, seed: int) -> list[tuple[str, bytes]]:
    chain = []
    for offset in range(count):
        key, data = random_key(), container(seed + offset)
        store(cluster, node, key, data)
        chain.append((key, data))
    return chain


def layer_digests(data: bytes) -> list[str]:
    return [digest.hex() for digest in decode(data).layer_digests()]


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class Api:
    """Calls on one base URL with one principal's token."""

    def __init__(self, base: str, token: str | None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base = base
        self.client = httpx.Client(base_url=base, headers=headers, timeout=30)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.client.get(path, **kwargs)

    def put(self, path: str, **kwargs) -> httpx.Response:
        return self.client.put(path, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.client.post(path, **kwargs)

    def delete(self, path: str, **kwargs) -> httpx.Response:
        return self.client.delete(path, **kwargs)

    def put_block(self, compat: str, scope: str, key: str, data: bytes, **headers):
        """PUT a block as a holder's client does (6.7); a header given as None is left out."""
        headers = {**store_headers(sha256(data)), **headers}
        headers = {name: value for name, value in headers.items() if value is not None}
        return self.put(f"blocks/{compat}/{scope}/{key}", content=data, headers=headers)

    def get_block(self, compat: str, scope: str, key: str, **params):
        return self.get(f"blocks/{compat}/{scope}/{key}", params=params)


def counted(node, name: str, by: str) -> dict[str, float]:
    """A counter of the node's ``/metrics`` by the value of its label ``by``: the node's own
    series (its label ``instance`` is the node)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(node.url.removesuffix("kvsp/") + "metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total":
                assert sample.labels["instance"] == node.name
                found[sample.labels[by]] = sample.value
    return found


def block_gets(base_url: str) -> int:
    """Block GETs the node at ``base_url`` has answered, from its /metrics."""
    text = httpx.get(base_url.replace("/kvsp/", "/metrics"), timeout=10).text
    pattern = re.compile(r"^kvsp_http_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)
    return int(
        sum(
            float(value)
            for labels, value in pattern.findall(text)
            if 'endpoint="block"' in labels and 'method="GET"' in labels
        )
    )


def blocks_sent(node) -> dict[str, int]:
    """Blocks the node has sent to clients, by the request that asked (a GET of one block, or a
    batch), from its /metrics."""
    text = httpx.get(node.url.replace("/kvsp/", "/metrics"), timeout=10).text
    pattern = re.compile(r'^kvsp_blocks_sent_total\{request="([a-z]+)"\} ([0-9.e+]+)$', re.M)
    sent = {"get": 0, "batch": 0}
    for request, value in pattern.findall(text):
        sent[request] += int(float(value))
    return sent


def problem(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json", response.text
    document = response.json()
    assert document["status"] == response.status_code and document["detail"]
    assert "Traceback" not in response.text
    return document["type"].rsplit("/", 1)[-1]


def assert_problems(cases) -> None:
    """Each (response, status, problem type name) of ``cases`` answered as it says."""
    for response, status, name in cases:
        assert response.status_code == status, response.text
        assert problem(response) == name


def hung_up(connection: socket.socket) -> bool:
    """Whether the other end of ``connection`` closed (or reset) it: what is sent now is not
    read."""
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class StandinHolder:
    """A holder on a loopback port serving the blocks it is given, with leases.

    ``held[key]``, an event, holds a block back before its first octet until it is set;
    ``requester_left[key]`` then says whether the requester had hung up by that time (the
    block is not sent to it). ``trickle_s[key]`` spreads a block over that many seconds;
    ``served[key]`` replaces the octets sent (with a Repr-Digest of what is sent), to inject a
    block whose layers differ from its record. ``answers[key]`` lists (status, problem details)
    that the block's next GETs are answered with, one each, before it is served again: a holder
    that is out of order for a while, or refuses. ``pace_mbit_per_s`` makes the holder a link
    of that rate: the bodies of all GETs together leave no faster.
    ``received`` lists (method, path, Authorization field) of every request, in order: what a
    client hands whatever it takes for a holder; ``connections`` counts the connections they
    came over. It speaks only the spec: a POST of a batch of blocks (this project's extension)
    is answered 404, and counted in ``batches``. ``drop_idle`` closes each connection after one
    answer without saying so, as a holder does that times out idle connections just as a client
    reuses one.
    """

    def __init__(self):
        self.blocks: dict[str, bytes] = {}
        self.served: dict[str, bytes] = {}
        self.answers: dict[str, list[tuple[int, dict]]] = {}
        self.held: dict[str, threading.Event] = {}
        self.requester_left: dict[str, bool] = {}
        self.trickle_s: dict[str, float] = {}
        self.pace_mbit_per_s = 0.0
        self._link_free_at = 0.0
        self._link_lock = threading.Lock()
        self.leases: list[dict] = []
        self.gets: list[str] = []
        self.received: list[tuple[str, str, str | None]] = []
        self.connections = 0
        self.batches = 0
        self.drop_idle = False
        holder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                holder.connections += 1

            def handle_one_request(self):
                super().handle_one_request()
                if holder.drop_idle:
                    self.close_connection = True

            def parse_request(self):
                parsed = super().parse_request()
                if parsed:
                    holder.received.append(
                        (self.command, self.path, self.headers.get("Authorization"))
                    )
                return parsed

            def _head(self, status: int, length: int, content_type: str, headers=()):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(length))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()

            def _json(self, status: int, document: dict | None):
                body = json.dumps(document).encode() if document is not None else b""
                kind = "application/problem+json" if status >= 400 else "application/json"
                self._head(status, len(body), kind)
                self.wfile.write(body)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length))
                if self.path.rstrip("/").rsplit("/", 1)[-1] != "leases":
                    # Blocks in batches are this project's extension: a holder that speaks
                    # only the spec has no such resource.
                    holder.batches += 1
                    return self._json(404, {"type": "kvsp-not-found", "status": 404})
                missing = [k for k in request["block_keys"] if k not in holder.blocks]
                if missing:
                    return self._json(404, {"type": "kvsp-not-found", "status": 404})
                holder.leases.append(request)
                grant = {
                    "lease": f"standin-{len(holder.leases)}",
                    "compat_id": request["compat_id"],
                    "scope_id": request["scope_id"],
                    "block_keys": request["block_keys"],
                    "ttl_ms": request["ttl_ms"],
                    "expires_ms": int(time.time() * 1000) + request["ttl_ms"],
                }
                self._json(201, grant)

            def do_DELETE(self):
                self._json(204, None)

            def do_GET(self):
                key = self.path.rstrip("/").rsplit("/", 1)[-1].split("?")[0]
                holder.gets.append(key)
                if holder.answers.get(key):
                    return self._json(*holder.answers[key].pop(0))
                if key not in holder.blocks:
                    return self._json(404, {"type": "kvsp-not-found", "status": 404})
                gate = holder.held.get(key)
                if gate is not None:
                    gate.wait(timeout=120)
                    holder.requester_left[key] = hung_up(self.connection)
                    if holder.requester_left[key]:
                        self.close_connection = True
                        return
                data = holder.served.get(key, holder.blocks[key])
                headers = [("Repr-Digest", repr_digest_header(sha256(data)))]
                self._head(200, len(data), BLOCK, headers)
                if holder.pace_mbit_per_s:
                    return self._paced(data)
                trickle = holder.trickle_s.get(key, 0)
                pieces = 16 if trickle else 1
                step = -(-len(data) // pieces)
                try:
                    for start in range(0, len(data), step):
                        self.wfile.write(data[start : start + step])
                        self.wfile.flush()
                        if trickle:
                            time.sleep(trickle / pieces)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _paced(self, data: bytes):
                # Each piece occupies the one link for its octets' time, after those before it.
                for start in range(0, len(data), 4096):
                    piece = data[start : start + 4096]
                    with holder._link_lock:
                        sent_at = max(time.perf_counter(), holder._link_free_at)
                        sent_at += 8 * len(piece) / (holder.pace_mbit_per_s * 1e6)
                        holder._link_free_at = sent_at
                    time.sleep(max(sent_at - time.perf_counter(), 0))
                    self.wfile.write(piece)
                    self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/kvsp/"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandinHolder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def record(self, compat: str, scope: str, key: str, ttl_ms: int = 60_000) -> dict:
        """The Replica Record of a block this holder serves, as it would publish it."""
        data = self.blocks[key]
        digests = layer_digests(data)
        return {
            "block_key": key,
            "compat_id": compat,
            "scope_id": scope,
            "holder": self.url,
            "codec": RAW_CODEC,
            "size": len(data),
            "digest": "sha-256:" + sha256(b"".join(bytes.fromhex(d) for d in digests)).hex(),
            "layer_digests": digests,
            "residency": [{"tier": "host", "layers": [0, len(digests) - 1]}],
            "ttl_ms": ttl_ms,
        }


def block_row(instance: str, ids: tuple[bytes, bytes, bytes], at, **fields):
    """A StoredBlock row (not saved) of a block of 4 layers stored and last read ``at``, with
    placeholder digests: for tests of what the node does with its rows, not with files."""
    from workers.models import StoredBlock

    compat_id, scope_id, block_key = ids
    values = {
        "codec": 1,
        "size": 100,
        "token_count": 16,
        "layer_count": 4,
        "digest": b"\x00" * 32,
        "layer_digests": b"\x00" * 32 * 4,
        "repr_sha256": b"\x00" * 32,
        "tier": "host",
        "stored_at": at,
        "last_access": at,
        "refresh_due_at": at,
        **fields,
    }
    return StoredBlock(
        instance=instance, compat_id=compat_id, scope_id=scope_id, block_key=block_key, **values
    )
