"""Block GET (spec 6.7) over loopback, verified by the client, against nginx serving the same
octets from the same file and one SHA-256 over them.

A node (gunicorn, ``KVSP_ROLE=node``, on a fresh Postgres database) stores a 64 MiB container of
32 layers in its host tier (shared memory) with PUT. The client then GETs it with the node's own
fetch client (``workers.fetch.fetch_block``): Repr-Digest, every layer digest as its layer
completes, and the replica digest, i.e. two SHA-256 passes over the data. The limit is nginx
(a process of this script's own, with a temporary configuration on a free port) serving the
very file the node serves, read by the same HTTP client, plus one ``hashlib.sha256`` over the
octets: the least any verified transfer has to do. Target: node / limit >= 0.7 in throughput.
Also shown: the node's GET without verification, and a layer range (layers 8-15, sent as a new
header and a byte range of the file). Best of several repeats, alternating, so that a busy
machine shows as noise rather than as a slower implementation.

    .venv/bin/python bench/bench_blocks.py [--repeats N]

Needs Postgres on 127.0.0.1; installs nginx from Debian's packages (nginx-light) when missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from bench.support import PG, Nginx, ensure_nginx, fresh_database  # noqa: E402
from kvsp.container import RAW_CODEC, decode, encode, store_headers  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from kvsp.reprdigest import verify_repr_digest  # noqa: E402
from tests.support.processes import Server, free_port, run_manage  # noqa: E402

DB = "kvsp_bench_node"
LAYERS = 32
SECTION = 1 << 20
TOKENS = 256
TARGET = 0.7
CHUNK = 1 << 20


def best_of(repeats: int, function) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats

    work = Path(tempfile.mkdtemp(prefix="kvsp-bench-blocks-"))
    shm = Path(tempfile.mkdtemp(prefix="kvsp-bench-blocks-", dir="/dev/shm"))
    port = free_port()
    node_url = f"http://127.0.0.1:{port}/kvsp/"
    env = {
        **os.environ,
        "DATABASE_URL": f"{PG}/{DB}",
        "KVSP_VAR_DIR": str(ROOT / "var"),
        "KVSP_ROLE": "node",
        "KVSP_INSTANCE": "bench",
        "KVSP_PUBLIC_URL": node_url,
        "KVSP_SHM_DIR": str(shm),
        "KVSP_DISK_DIR": str(work / "disk"),
        "KVSP_LOG_LEVEL": "ERROR",
        "PYTHONUNBUFFERED": "1",
    }
    control_env = {**env, "KVSP_ROLE": "control"}
    fresh_database(DB)
    migrated = run_manage("migrate", "--no-input", env=control_env)
    if migrated.returncode:
        sys.exit(migrated.stderr)

    def principal(*args: str) -> str:
        created = run_manage("kvsp_principal", "create", *args, env=control_env)
        return json.loads(created.stdout)["token"]

    scope = json.loads(run_manage("kvsp_scope", "create", "bench", env=control_env).stdout)[
        "scope_id"
    ]
    token = principal("bench-client", "--scope", scope)
    # No control plane runs here: the node's is a free port that nobody answers, so the PUT's
    # publication fails at once (the keeper that would retry it is not started either).
    env["KVSP_CONTROL_URL"] = f"http://127.0.0.1:{free_port()}/kvsp/"
    env["KVSP_TOKEN"] = principal("bench-node", "--scope", scope, "--holder", node_url)

    rng = random.Random(6701)
    data = encode(
        RAW_CODEC,
        0,
        TOKENS,
        [(rng.randbytes(SECTION), rng.randbytes(SECTION)) for _ in range(LAYERS)],
    )
    compat, key = rng.randbytes(32).hex(), rng.randbytes(32).hex()
    path = f"blocks/{compat}/{scope}/{key}"

    node = Server("bench-node", env, work, workers=1, port=port)
    nginx = Nginx(ensure_nginx(), shm / "bench", work, work)
    try:
        node.start()
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=node_url, headers=headers, timeout=120) as client:
            stored = client.put(
                path, content=data, headers=store_headers(hashlib.sha256(data).digest())
            )
            if stored.status_code != 201:
                sys.exit(f"PUT answered {stored.status_code}: {stored.text}")
            record = ReplicaRecord.from_json(stored.json())
        [stored_file] = [p for p in (shm / "bench").iterdir() if p.name.endswith(".kvb")]
        if stored_file.read_bytes() != data:
            sys.exit("the stored file differs from the container")
        nginx.start()
        nginx_url = f"http://127.0.0.1:{nginx.port}/{stored_file.name}"
        run(repeats, data, record, node_url, path, token, nginx_url)
    finally:
        nginx.stop()
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run(repeats, data, record, node_url, path, token, nginx_url) -> None:
    from workers.fetch import BlockConnections, fetch_block

    node_client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120)
    node_connections = BlockConnections({"Authorization": f"Bearer {token}"})
    plain_client = httpx.Client(timeout=120)

    def read_all(client, url, **params) -> tuple[bytearray, httpx.Headers]:
        body = bytearray()
        with client.stream("GET", url, params=params) as response:
            if response.status_code != 200:
                raise SystemExit(f"{url} answered {response.status_code}")
            for chunk in response.iter_raw(CHUNK):
                body += chunk
            return body, response.headers

    def node_verified():
        fetched = fetch_block(node_connections, node_url, record, max_size=len(data) + 4096)
        assert fetched.size == len(data)

    def node_plain():
        body, _ = read_all(node_client, node_url + path)
        assert len(body) == len(data)

    def nginx_and_hash():
        body, _ = read_all(plain_client, nginx_url)
        hashlib.sha256(body).digest()
        assert len(body) == len(data)

    def nginx_plain():
        body, _ = read_all(plain_client, nginx_url)
        assert len(body) == len(data)

    def node_slice():
        body, headers = read_all(node_client, node_url + path, layers="8-15")
        verify_repr_digest(headers["repr-digest"], body)
        part = decode(body)
        part.verify_layer_digests(record.layer_digests, expected_first_layer=0)

    # Correctness first: what the node sends is the container, digests and all.
    body, headers = read_all(node_client, node_url + path)
    verify_repr_digest(headers["repr-digest"], body)
    if bytes(body) != data:
        raise SystemExit("the node sent other octets")
    node_slice()

    timings = {"limit": [], "nginx": [], "verified": [], "plain": [], "slice": []}
    for _ in range(repeats):
        timings["limit"].append(best_of(1, nginx_and_hash))
        timings["nginx"].append(best_of(1, nginx_plain))
        timings["verified"].append(best_of(1, node_verified))
        timings["plain"].append(best_of(1, node_plain))
        timings["slice"].append(best_of(1, node_slice))
    best = {name: min(values) for name, values in timings.items()}
    mib = len(data) / (1 << 20)
    sliced = decode(data).data_range(8, 15)
    slice_mib = (sliced[1] - sliced[0]) / (1 << 20)

    def line(name, seconds, size_mib, ratio=None, mark=""):
        rate = size_mib * (1 << 20) / seconds / 1e9
        shown = f"  ratio {ratio:4.2f}{mark}" if ratio is not None else ""
        print(f"  {name:58} {seconds * 1e3:8.2f} ms {rate:6.2f} GB/s{shown}")

    print(f"block GET over loopback: {LAYERS} layers, {mib:.2f} MiB, best of {repeats}")
    line("nginx GET of the same file + one sha256 (the limit)", best["limit"], mib, 1.0)
    ratio = best["limit"] / best["verified"]
    mark = "  (target >= 0.7)" if ratio >= TARGET else f"  BELOW TARGET {TARGET}"
    line("node GET + Repr-Digest + layer + replica digests", best["verified"], mib, ratio, mark)
    line("nginx GET alone", best["nginx"], mib, best["limit"] / best["nginx"])
    line(
        "node GET alone (sendfile), not verified", best["plain"], mib, best["limit"] / best["plain"]
    )
    line(f"node GET layers=8-15 ({slice_mib:.0f} MiB) + verified", best["slice"], slice_mib)
    if ratio < TARGET:
        raise SystemExit(f"missed: verified node GET at {ratio:.2f} of the limit")


if __name__ == "__main__":
    main()
