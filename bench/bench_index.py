"""Index Service on Postgres: lookup latency against the bare query, publish and lookup rates.

With 1,000,000 replica rows (32 layer digests each) in a fresh database, served by gunicorn:

- a lookup of 1,024 keys (all matched) and of 8,192 keys, end to end over HTTP: median and p99;
- in the same run (a) the bare psycopg query that fetches the same rows and (b) the bare index
  probe for the same number of keys when none exist;
  targets: end-to-end median <= 2x (a), and (a) <= 2x (b);
- publishes per second with 2 gunicorn workers (target 1,000/s) and lookups per second, driven
  by wrk from a second process;
- records per second published through the batch form (``POST replicas``, batches of
  ``--batch`` records, as large as fit the default body limit), against the single PUTs above,
  same server, same records, same connections (target >= 25x).

Run: .venv/bin/python bench/bench_index.py [--rows N] [--batch N]   (needs Postgres on
127.0.0.1; installs wrk from Debian's packages when it is missing)
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support import PG, control_env, fresh_database  # noqa: E402
from tests.support.processes import Server, run_manage  # noqa: E402
from tests.support.replicas import replica_json  # noqa: E402

JSON = {"Content-Type": "application/json"}

DB = "kvsp_bench"
COMPAT = bytes.fromhex("c0" * 32)
LAYERS = 32


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def timed(fn, repeats):
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def ensure_wrk() -> str:
    if not shutil.which("wrk"):
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, capture_output=True)
    return shutil.which("wrk")


def fresh_migrated_database(env) -> None:
    fresh_database(DB)
    migrated = run_manage("migrate", "--no-input", env=env)
    if migrated.returncode:
        sys.exit(migrated.stderr)


def load_rows(rows: int, scope_id: bytes) -> None:
    """Rows made server-side: block key i is sha256('k' || i), 16 holders, 32 layer digests."""
    with psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn:
        conn.execute(
            "INSERT INTO index_holder (url) SELECT 'http://holder-' || h || '.test/kvsp/' "
            "FROM generate_series(0, 15) h"
        )
        holder_ids = [r[0] for r in conn.execute("SELECT id FROM index_holder ORDER BY id")]
        conn.execute(
            """
            INSERT INTO index_replica (compat_id, scope_id, block_key, holder_id, codec, size,
                digest, layer_digests, residency, tier_mask, moqt_namespace, ttl_ms, expires_at,
                published_at, refreshed_at, refresh_count)
            SELECT %(compat)s, %(scope)s, sha256(('k' || i)::bytea), %(holders)s[1 + i %% 16],
                1, 2097152, sha256(('d' || i)::bytea),
                decode(repeat(encode(sha256(('l' || i)::bytea), 'hex'), 32), 'hex'),
                '[{"tier": "host", "layers": [0, 31]}]'::jsonb, 2, '', 600000,
                now() + interval '1 day', now(), now(), 0
            FROM generate_series(0, %(last)s) i
            """,
            {"compat": COMPAT, "scope": scope_id, "holders": holder_ids, "last": rows - 1},
        )
        conn.execute("VACUUM ANALYZE index_replica")
        size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('index_replica'))")
        print(f"  index_replica: {rows} rows, {size.fetchone()[0]} with indexes")


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"k" + str(i).encode()).digest()


SELECT = (
    "SELECT r.block_key, h.url, r.codec, r.size, r.digest, r.layer_digests, r.residency, "
    "r.moqt_namespace, r.expires_at FROM index_replica r JOIN index_holder h ON h.id = "
    "r.holder_id WHERE r.scope_id = %s AND r.compat_id = %s AND r.expires_at > now() "
    "AND r.block_key = ANY(%b)"
)


def setup_principals(env) -> tuple[str, str, str]:
    scope = json.loads(run_manage("kvsp_scope", "create", "bench", env=env).stdout)
    holders = [f"http://holder-{h}.test/kvsp/" for h in range(16)]
    args = ["kvsp_principal", "create", "bench-holder", "--scope", scope["scope_id"]]
    for holder in holders:
        args += ["--holder", holder]
    token = json.loads(run_manage(*args, env=env).stdout)["token"]
    return scope["scope_id"], token, holders[0]


def wrk(wrk_bin, url, script, seconds, connections=16):
    out = subprocess.run(
        [wrk_bin, "-t2", f"-c{connections}", f"-d{seconds}s", "-s", script, url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rate, int(errors.group(1)) if errors else 0


WRK_SCRIPT = """
local lines = {}
for line in io.lines("%(requests)s") do lines[#lines + 1] = line end
local i = 0
request = function()
  i = i %% #lines + 1
  local method, token, path, body = lines[i]:match("^(%%S+) (%%S+) (%%S+) (.*)$")
  return wrk.format(method, path, {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json"}, body)
end
"""


def write_requests_script(directory, name, requests):
    """A wrk script that sends ``requests`` in turn, each a (method, bearer token, path, JSON
    body); the path of the script."""
    request_file = Path(directory) / f"{name}.txt"
    request_file.write_text("\n".join(f"{m} {t} {p} {json.dumps(b)}" for m, t, p, b in requests))
    script = Path(directory) / f"{name}.lua"
    script.write_text(WRK_SCRIPT % {"requests": request_file})
    return str(script)


def write_wrk_script(directory, name, token, requests):
    """A wrk script that sends ``requests``, each a (method, path, JSON body), with ``token``."""
    return write_requests_script(directory, name, [(m, token, p, b) for m, p, b in requests])


def publish_requests(scope_hex, holder, count):
    out = []
    for record in replica_records(scope_hex, holder, count):
        out.append(
            ("PUT", f"/kvsp/replicas/{COMPAT.hex()}/{scope_hex}/{record['block_key']}", record)
        )
    return out


def batch_requests(scope_hex, holder, count, batch):
    records = replica_records(scope_hex, holder, count)
    return [
        ("POST", "/kvsp/replicas", {"records": records[start : start + batch]})
        for start in range(0, count, batch)
    ]


def replica_records(scope_hex, holder, count):
    return [
        replica_json(
            scope_hex,
            COMPAT.hex(),
            hashlib.sha256(b"pub" + str(i).encode()).hexdigest(),
            holder,
            layers=LAYERS,
            size=2097152,
            ttl_ms=600000,
        )
        for i in range(count)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1024, help="records per batch publication")
    args = parser.parse_args()
    wrk_bin = ensure_wrk()
    env = control_env(DB, KVSP_MAX_LOOKUP_KEYS="65536")
    print(f"index benchmark: {args.rows} rows, {LAYERS} layer digests each")
    fresh_migrated_database(env)
    scope_hex, token, holder = setup_principals(env)
    load_rows(args.rows, bytes.fromhex(scope_hex))

    logs = Path(tempfile.mkdtemp(prefix="kvsp-bench-"))
    server = Server("bench-control", env, logs, workers=2).start()
    try:
        lookup_conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        headers = {**JSON, "Authorization": f"Bearer {token}"}
        results = {}
        # The bare query at its best: binary results and a binary array of keys.
        with psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn, conn.cursor() as cursor:
            scope = bytes.fromhex(scope_hex)
            for count in (1024, 8192):
                start = (args.rows // 2) - count
                keys = [key_of(i) for i in range(start, start + count)]
                missing = [key_of(-1 - i) for i in range(start, start + count)]
                body = orjson.dumps(
                    {
                        "scope_id": scope_hex,
                        "compat_id": COMPAT.hex(),
                        "block_keys": [k.hex() for k in keys],
                    }
                )

                def over_http(body=body):
                    # Latency is until the whole answer has arrived; parsing is the client's.
                    # http.client reads a large body at C speed, so the client adds little.
                    try:
                        lookup_conn.request("POST", "/kvsp/lookup", body, headers)
                    except OSError:  # the server closed the kept-alive connection: reopen
                        lookup_conn.close()
                        lookup_conn.request("POST", "/kvsp/lookup", body, headers)
                    answer = lookup_conn.getresponse()
                    content = answer.read()
                    assert answer.status == 200, content[:200]
                    return content

                assert orjson.loads(over_http())["matched"] == count

                def bare(keys=keys, count=count):
                    rows = cursor.execute(SELECT, [scope, COMPAT, keys], binary=True).fetchall()
                    assert len(rows) == count

                def probe(missing=missing):
                    assert not cursor.execute(
                        SELECT, [scope, COMPAT, missing], binary=True
                    ).fetchall()

                for fn in (over_http, bare, probe):
                    timed(fn, 3)  # warm caches and connections
                e2e = timed(over_http, args.repeats)
                a = timed(bare, args.repeats)
                b = timed(probe, args.repeats)
                results[count] = (e2e, a, b)
                med = statistics.median
                print(
                    f"  lookup {count:5d} keys: end-to-end median {med(e2e):7.1f} ms "
                    f"p99 {percentile(e2e, 0.99):7.1f} ms | (a) bare query {med(a):6.1f} ms "
                    f"p99 {percentile(a, 0.99):6.1f} | (b) probe, none exist {med(b):6.1f} ms"
                )
                print(
                    f"      ratio end-to-end/(a) {med(e2e) / med(a):.2f} (target <= 2.0), "
                    f"(a)/(b) {med(a) / med(b):.2f} (target <= 2.0)"
                )

        with tempfile.TemporaryDirectory() as directory:
            publish = write_wrk_script(
                directory, "publish", token, publish_requests(scope_hex, holder, 2000)
            )
            rate, errors = wrk(wrk_bin, server.url, publish, args.seconds)
            # The framework's floor on this machine: an authenticated GET that, like a publish,
            # costs the token query and one indexed statement (a miss: 404 problem details).
            floor = write_wrk_script(
                directory, "floor", token, [("GET", f"/kvsp/compat/{COMPAT.hex()}", None)]
            )
            floor_rate, _ = wrk(wrk_bin, server.url, floor, args.seconds)
            print(
                f"  floor: authenticated GET of one indexed row {floor_rate:7.0f}/s; "
                f"publishes reach {rate / floor_rate:.2f} of it"
            )
            print(
                f"  publishes: {rate:7.0f}/s with 2 gunicorn workers, {errors} errors "
                f"(target >= 1000/s, ratio {rate / 1000:.2f})"
            )
            batches = write_wrk_script(
                directory,
                "batches",
                token,
                # As many distinct batches as connections and more, so that no two requests
                # at once refresh the same rows (the single PUTs' 2,000 records rarely do).
                batch_requests(scope_hex, holder, 32 * args.batch, args.batch),
            )
            # With the single PUTs' 16 connections, and with 2: a holder publishing in batches
            # needs few connections to keep the server busy, where single PUTs need many to hide
            # each round trip.
            for connections in (16, 2):
                batch_rate, batch_errors = wrk(
                    wrk_bin, server.url, batches, args.seconds, connections=connections
                )
                batch_records = batch_rate * args.batch
                print(
                    f"  batch publication, {connections:2d} connections: {batch_records:7.0f} "
                    f"records/s in batches of {args.batch} ({batch_rate:.1f} requests/s), "
                    f"{batch_errors} errors; ratio to single PUTs {batch_records / rate:.1f} "
                    "(target >= 25)"
                )
            lookups = []
            for n in range(200):
                start = (n * 997) % (args.rows - 64)
                lookups.append(
                    (
                        "POST",
                        "/kvsp/lookup",
                        {
                            "scope_id": scope_hex,
                            "compat_id": COMPAT.hex(),
                            "block_keys": [key_of(i).hex() for i in range(start, start + 64)],
                        },
                    )
                )
            script = write_wrk_script(directory, "lookup", token, lookups)
            rate, errors = wrk(wrk_bin, server.url, script, args.seconds)
            print(f"  lookups of 64 keys: {rate:7.0f}/s, {errors} errors")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
