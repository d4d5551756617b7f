"""Publication of Replica Records (spec 6.1) in process: single PUTs against the batch form.

The control plane's WSGI application (``KVSP_ROLE=control``, on a fresh Postgres database) is
called through Django's test client, so no socket or HTTP parsing is counted: only what the
Index Service does per record. Records carry 32 layer digests, as in ``bench_index.py``. Each
form is timed over records not published before (so every one is an insert) and then over the
same records again (every one a refresh), with ``time.process_time`` (this process's CPU, the
database's work excluded) and the wall clock (the database's work included). Also shown:
decoding and validating a record alone (``ReplicaRecord.from_json`` of a parsed JSON object),
the part of a batched record's cost that record validation is.

    .venv/bin/python bench/bench_publication.py [--singles N] [--batches N] [--batch N]

Needs Postgres on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_index import COMPAT, replica_records  # noqa: E402
from bench.support import control_in_process, migrated_in_process  # noqa: E402

DB = "kvsp_bench_publication"
HOLDER = "http://holder-0.test/kvsp/"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--singles", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    control_in_process(DB)
    run(args.singles, args.batches, args.batch)


def timed(work, count: int) -> tuple[float, float]:
    """Microseconds of CPU and of wall time per unit of ``count``."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return (
        (time.process_time() - cpu) / count * 1e6,
        (time.perf_counter() - wall) / count * 1e6,
    )


def run(singles: int, batches: int, batch: int) -> None:
    manage = migrated_in_process()
    from django.test import Client

    from kvsp.records import ReplicaRecord

    scope = manage("kvsp_scope", "create", "bench")["scope_id"]
    token = manage("kvsp_principal", "create", "h", "--scope", scope, "--holder", HOLDER)["token"]
    holder = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    records = replica_records(scope, HOLDER, singles + batches * batch)
    single_records, batched = records[:singles], records[singles:]
    bodies = [
        orjson.dumps({"records": batched[start : start + batch]})
        for start in range(0, len(batched), batch)
    ]
    puts = [
        (f"/kvsp/replicas/{COMPAT.hex()}/{scope}/{r['block_key']}", orjson.dumps(r))
        for r in single_records
    ]

    def put_each() -> None:
        for path, body in puts:
            response = holder.put(path, body, content_type="application/json")
            assert response.status_code in (200, 201), response.content[:300]

    def post_batches() -> None:
        for body in bodies:
            response = holder.post("/kvsp/replicas", body, content_type="application/json")
            assert response.status_code == 200, response.content[:300]
            assert all(r["status"] in (200, 201) for r in orjson.loads(response.content)["results"])

    parsed = [orjson.loads(body)["records"] for body in bodies]

    def decode() -> None:
        for items in parsed:
            for item in items:
                ReplicaRecord.from_json(item)

    put_each()  # warm: the holder interned, the code paths loaded
    print(
        f"publication in process: {singles} single PUTs, {batches} batches of {batch}, "
        "32 layer digests a record"
    )
    rows = {}
    rows["single PUT, refresh"] = timed(put_each, singles)
    rows["batch, insert"] = timed(post_batches, len(batched))
    rows["batch, refresh"] = timed(post_batches, len(batched))
    rows["decoding a record alone"] = timed(decode, len(batched))
    for name, (cpu, wall) in rows.items():
        print(f"  {name:26} {cpu:8.1f} us CPU {wall:8.1f} us wall per record")
    single_cpu, single_wall = rows["single PUT, refresh"]
    batch_cpu, batch_wall = rows["batch, refresh"]
    print(
        f"  single / batched refresh: {single_cpu / batch_cpu:.1f}x CPU, "
        f"{single_wall / batch_wall:.1f}x wall (target for records/s over HTTP: >= 25)"
    )
    decode_cpu = rows["decoding a record alone"][0]
    print(f"  decoding is {decode_cpu / batch_cpu:.0%} of a batched record's CPU")


if __name__ == "__main__":
    main()
