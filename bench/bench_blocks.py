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

Then the holder's own cost per request, what a loader's thousands of GETs of small blocks pay:
``--requests`` GETs one after another over one kept-alive connection, each verified by the
node's fetch client, of a 16 KiB and of a 2 MiB block, and ``GET /healthz`` (no work): the CPU
the node's server process (all its workers) and Postgres spend per request, and the wall time
per request, against nginx answering the same client for the same file in the same run.

    .venv/bin/python bench/bench_blocks.py [--repeats N] [--requests N]

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
from bench.timing import best_of  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    options = parser.parse_args()
    repeats = options.repeats

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
    # The blocks of the per-request figures: 16 KiB (4 layers of 2 KiB sections) and 2 MiB (32
    # layers of 32 KiB, a Llama-3-8B block of 16 tokens).
    small = {
        size: encode(
            RAW_CODEC,
            0,
            16,
            [(rng.randbytes(section), rng.randbytes(section)) for _ in range(layers)],
        )
        for size, layers, section in (("16 KiB", 4, 2048), ("2 MiB", 32, 32768))
    }

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
            small_records = {}
            for size, octets in small.items():
                small_key = rng.randbytes(32).hex()
                answer = client.put(
                    f"blocks/{compat}/{scope}/{small_key}",
                    content=octets,
                    headers=store_headers(hashlib.sha256(octets).digest()),
                )
                if answer.status_code != 201:
                    sys.exit(f"PUT answered {answer.status_code}: {answer.text}")
                small_records[size] = ReplicaRecord.from_json(answer.json())
        if stored_file.read_bytes() != data:
            sys.exit("the stored file differs from the container")
        nginx.start()
        nginx_url = f"http://127.0.0.1:{nginx.port}/{stored_file.name}"
        run(repeats, data, record, node_url, path, token, nginx_url)
        files = {
            size: next(p for p in (shm / "bench").iterdir() if p.read_bytes() == octets).name
            for size, octets in small.items()
        }
        per_request(
            options.requests,
            node,
            nginx,
            node_url,
            token,
            small_records,
            f"http://127.0.0.1:{nginx.port}/",
            files,
        )
    finally:
        nginx.stop()
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run(repeats, data, record, node_url, path, token, nginx_url) -> None:
    from common.peers import BlockConnections
    from workers.fetch import fetch_block

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
    line("node GET alone, not verified", best["plain"], mib, best["limit"] / best["plain"])
    line(f"node GET layers=8-15 ({slice_mib:.0f} MiB) + verified", best["slice"], slice_mib)
    if ratio < TARGET:
        print(f"missed: verified node GET at {ratio:.2f} of the limit")


def per_request(count, node, nginx, node_url, token, records, nginx_base, files) -> None:
    """The holder's CPU and wall time per GET over one kept-alive connection (module doc)."""
    from bench.support import CpuMeter
    from common.peers import BlockConnections
    from workers.fetch import fetch_block

    meter = CpuMeter([node, nginx])

    def measure(server: str, one) -> str:
        for _ in range(min(200, count)):
            one()  # warm: the connection, the auth cache, prepared statements
        before = meter.read()
        started = time.perf_counter()
        for _ in range(count):
            one()
        wall = (time.perf_counter() - started) / count
        spent = meter.spent(before, meter.read())
        cpu = spent.get(server, 0.0) / count
        pg = spent.get("postgres", 0.0) / count
        return f"{wall * 1e6:8.0f} {cpu * 1e6:11.0f} {pg * 1e6:9.0f}"

    print(
        f"holder's cost per request, {count:,} requests one after another over one kept-alive "
        "connection (us; server: the node's processes, or nginx's)"
    )
    print(f"  {'request':44} {'wall':>8} {'server CPU':>11} {'postgres':>9}")
    with BlockConnections({"Authorization": f"Bearer {token}"}) as connections:

        def healthz():
            with connections.get(node_url.replace("/kvsp/", "/healthz"), {}, 30) as answer:
                answer.read_all()

        print(f"  {'GET /healthz (no work)':44} {measure(node.name, healthz)}")
        for size, record in records.items():

            def node_get(record=record):
                fetch_block(connections, node_url, record, max_size=4 << 20)

            print(f"  {'block GET ' + size + ', verified':44} {measure(node.name, node_get)}")
    with BlockConnections() as connections:
        for size, name in files.items():
            buffer = memoryview(bytearray(4 << 20))

            def nginx_get(name=name, buffer=buffer):
                read = 0
                with connections.get(nginx_base + name, {}, 30) as answer:
                    while got := answer.readinto(buffer[read:]):
                        read += got
                hashlib.sha256(buffer[:read]).digest()

            print(f"  {'nginx GET ' + size + ' + one sha256':44} {measure(nginx.name, nginx_get)}")


if __name__ == "__main__":
    main()
