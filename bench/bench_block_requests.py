"""CPU per request of a node's block path (spec 6.6, 6.7), in process, against the least any
request costs here.

A node's WSGI application (``KVSP_ROLE=node``, on a fresh Postgres database) is called through
Django's test client, so no socket or HTTP parsing is counted: only what the node does per
request. Each request is repeated and timed with ``time.process_time`` (the CPU of this
process, the database's work excluded). The floor is ``GET /healthz``: the same middleware and
no work. Also shown, for reference, an authenticated DRF request that reads one row (``GET
prefetch/{directive}`` for a directive the node does not know, as the controller): what every
request paid before block and lease requests had a path of their own.

    .venv/bin/python bench/bench_block_requests.py [--repeats N]

Needs Postgres on 127.0.0.1.
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support import PG, fresh_database, migrated_in_process  # noqa: E402

DB = "kvsp_bench_requests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1000)
    repeats = parser.parse_args().repeats

    shm = Path(tempfile.mkdtemp(prefix="kvsp-bench-requests-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kvsp-bench-requests-"))
    os.environ.update(
        DJANGO_SETTINGS_MODULE="kvspsite.settings",
        DATABASE_URL=f"{PG}/{DB}",
        KVSP_ROLE="node",
        KVSP_INSTANCE="bench",
        KVSP_PUBLIC_URL="http://testserver/kvsp/",
        KVSP_SHM_DIR=str(shm),
        KVSP_DISK_DIR=str(disk),
        KVSP_LOG_LEVEL="ERROR",
        # No control plane runs: a node must name one, and publication to it fails fast
        # (nothing listens on the discard port), off the request.
        KVSP_CONTROL_URL="http://127.0.0.1:9/kvsp/",
        KVSP_TOKEN="kvsp_bench",
    )
    fresh_database(DB)
    try:
        run(repeats)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def run(repeats: int) -> None:
    manage = migrated_in_process()
    from django.test import Client

    from kvsp.container import RAW_CODEC, encode, store_headers

    scope = manage("kvsp_scope", "create", "bench")["scope_id"]
    reader_token = manage("kvsp_principal", "create", "r", "--scope", scope)["token"]
    controller_token = manage("kvsp_principal", "create", "pc", "--controller")["token"]
    reader = Client(HTTP_AUTHORIZATION=f"Bearer {reader_token}")
    controller = Client(HTTP_AUTHORIZATION=f"Bearer {controller_token}")
    anonymous = Client()
    rng = random.Random(4401)
    compat = rng.randbytes(32).hex()

    def container() -> bytes:
        return encode(
            RAW_CODEC, 0, 16, [(rng.randbytes(2048), rng.randbytes(2048)) for _ in range(4)]
        )

    def put(key: str, data: bytes) -> None:
        headers = {
            f"HTTP_{name.upper().replace('-', '_')}": value
            for name, value in store_headers(hashlib.sha256(data).digest()).items()
            if name.lower() != "content-type"
        }
        response = reader.put(
            f"/kvsp/blocks/{compat}/{scope}/{key}",
            data,
            content_type="application/kvsp-block",
            **headers,
        )
        assert response.status_code == 201, response.content

    key = rng.randbytes(32).hex()
    put(key, container())
    path = f"/kvsp/blocks/{compat}/{scope}/{key}"
    miss = f"/kvsp/blocks/{compat}/{scope}/{'00' * 32}"
    unknown = f"/kvsp/prefetch/{uuid.uuid4()}"
    lease_body = json.dumps(
        {"compat_id": compat, "scope_id": scope, "block_keys": [key], "ttl_ms": 5000}
    )
    fresh = [(rng.randbytes(32).hex(), container()) for _ in range(repeats + 50)]

    def healthz():
        assert anonymous.get("/healthz").status_code == 200

    def drf_read():
        assert controller.get(unknown).status_code == 404

    def get():
        response = reader.get(path)
        assert response.status_code == 200
        b"".join(response.streaming_content)
        response.close()

    def get_miss():
        assert reader.get(miss).status_code == 404

    def lease():
        granted = reader.post("/kvsp/leases", lease_body, content_type="application/json")
        assert granted.status_code == 201, granted.content
        assert reader.delete(f"/kvsp/leases/{granted.json()['lease']}").status_code == 204

    def store():
        put(*fresh.pop())

    cases = [
        ("GET /healthz (the floor: middleware, no work)", healthz),
        ("authenticated DRF request reading one row", drf_read),
        ("block GET, 16 KiB", get),
        ("block GET, a miss", get_miss),
        ("block PUT, 16 KiB", store),
        ("lease POST + DELETE (two requests)", lease),
    ]
    cpu = {}
    for name, request in cases:
        for _ in range(min(50, repeats)):
            request()
        started = time.process_time()
        for _ in range(repeats):
            request()
        cpu[name] = (time.process_time() - started) / repeats
    floor = cpu[cases[0][0]]
    print(f"CPU per request of the node, in process, {repeats} each")
    for name, seconds in cpu.items():
        print(f"  {name:52} {seconds * 1e3:7.3f} ms  {seconds / floor:5.1f} x floor")


if __name__ == "__main__":
    main()
