"""Output event streams against the control plane's hot paths, on Postgres.

The same database, the same load and 2 gunicorn workers of 4 threads, served three ways:

- ``gthread``: ``kvspsite.wsgi`` under gunicorn's gthread worker (the control plane before);
- ``asgi``: ``kvspsite.asgi`` under gunicorn's ASGI worker: requests in a pool of 4 threads per
  process, streams on the event loop (``common/asgibridge.py``);
- ``django-asgi``: Django's own ASGI handler under the same worker, for comparison (it runs each
  request in a thread of its own, so persistent connections are off: ``KVSP_DB_CONN_MAX_AGE=0``).

The three run side by side on the same data. For each: status reports (200 simulated instances,
the common report of an unchanged epoch), lookups of 16 keys, publications and ``/healthz`` (no
database: the cost of serving a request), driven by wrk on 8 connections, as requests per second
and as the server's CPU milliseconds per request (on a shared machine the steadier figure).
Rounds are paired: each path on each server in turn, the order rotated every round; the ratios
to ``gthread`` are the medians of the rounds' ratios. Then, on ``asgi``: the same with 200
streams open and 200 more dropped without closing (against none open), the CPU the open streams
use while idle, the time from a token POSTed to its frame on all 200 streams; and how often
``/healthz`` answers within 5 s on one gthread worker of 4 threads while 8 streams are open.

Run: .venv/bin/python bench/bench_streams.py   (Postgres on 127.0.0.1; installs wrk)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_index import ensure_wrk, percentile, replica_records, wrk  # noqa: E402
from bench.bench_index import write_wrk_script as write_holder_script  # noqa: E402
from bench.bench_placement import write_status_script  # noqa: E402
from bench.support import control_env, fresh_database  # noqa: E402
from devtools.processes import BIN, Server, run_manage  # noqa: E402

DB = "kvsp_bench_streams"
COMPAT = "c0" * 32
HOLDER = "http://bench-holder.test/kvsp/"
INSTANCES = 200
STREAMS = 200
THREADS = 4


class BenchServer(Server):
    """The control plane served one of the three ways."""

    def __init__(self, kind: str, env: dict, logs: Path, *, workers: int = 2):
        super().__init__(f"bench-{kind}", env, logs, workers=workers, threads=THREADS)
        bind = f"127.0.0.1:{self.port}"
        common = ["--bind", bind, "--workers", str(workers)]
        common += ["--timeout", "120", "--graceful-timeout", "1"]
        if kind == "gthread":
            app = ["kvspsite.wsgi:application", "-k", "gthread", "--threads", str(THREADS)]
        elif kind == "asgi":
            app = ["kvspsite.asgi:application", "-k", "asgi"]
        else:
            app = ["django.core.asgi:get_asgi_application()", "-k", "asgi"]
            self.env = {
                **self.env,
                "DJANGO_SETTINGS_MODULE": "kvspsite.settings",
                "KVSP_DB_CONN_MAX_AGE": "0",
            }
        self.argv = [str(BIN / "gunicorn"), *app, *common]


def setup(env: dict) -> dict:
    """Scope, principals, instances with a first report, published replicas, sessions."""
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "kvspsite.settings"
    import django

    django.setup()
    from index.authentication import principal_for_token
    from index.services import do_create_principal, do_create_scope, do_publish_replica
    from kvsp.records import ReplicaRecord
    from placement.models import Instance
    from placement.services import do_register_instance, do_report_status
    from sessions.models import OutputToken, Session

    scope = do_create_scope("bench")
    scope_hex = scope.scope_id_hex
    holder = do_create_principal("holder", scope_ids=[bytes(scope.scope_id)], holder_urls=[HOLDER])
    publisher = principal_for_token(holder.token)
    records = replica_records(scope_hex, HOLDER, 4096)
    for record in records[:1024]:
        do_publish_replica(publisher, ReplicaRecord.from_json(record))
    instances = {}
    for i in range(INSTANCES):
        name = f"ii{i:04d}"
        url = f"http://{name}.test/kvsp/"
        do_register_instance(name, url)
        issued = do_create_principal(
            f"node-{name}", scope_ids=[bytes(scope.scope_id)], instance=name, holder_urls=[url]
        )
        instances[name] = issued.token
        do_report_status(principal_for_token(issued.token), name, status_record(url))
    # Four for the streams kept open, four for those dropped, four for gthread's: each group
    # well within the cap of 100 per principal.
    readers = [
        do_create_principal(f"reader-{n}", scope_ids=[bytes(scope.scope_id)]).token
        for n in range(12)
    ]
    sessions = []
    serving = Instance.objects.get(name="ii0000")
    for _ in range(10):
        session = Session.objects.create(
            session=uuid.uuid4(),
            scope_id=scope.scope_id,
            compat_id=bytes.fromhex(COMPAT),
            epoch=1,
            instance=serving,
            checkpoint={"sampler": {"deterministic": True}},
        )
        OutputToken.objects.create(session=session, index=0, token=1, epoch=1)
        sessions.append(str(session.session))
    return {
        "scope": scope_hex,
        "holder": holder.token,
        "records": records,
        "instances": instances,
        "readers": readers,
        "sessions": sessions,
    }


def status_record(url: str) -> dict:
    return {
        "instance": url,
        "epoch": 1,
        "state": "active",
        "running": 2,
        "queued": 0,
        "batch_size": 32,
        "kv_utilization": 0.3,
        "prefill_tokens_per_s": 20_000,
        "decode_tokens_per_s": 2_000,
        "links": [],
        "requested_state": None,
        "ttl_ms": 3_600_000,
    }


def scripts(directory: str, data: dict) -> dict:
    scope = data["scope"]
    keys = [record["block_key"] for record in data["records"][:1024]]
    lookups = [
        (
            "POST",
            "/kvsp/lookup",
            {"scope_id": scope, "compat_id": COMPAT, "block_keys": keys[n : n + 16]},
        )
        for n in range(0, 1024, 16)
    ]
    publishes = [
        ("PUT", f"/kvsp/replicas/{COMPAT}/{scope}/{record['block_key']}", record)
        for record in data["records"][1024:]
    ]
    status_lines = [
        (token, f"/kvsp/instances/{name}/status", status_record(f"http://{name}.test/kvsp/"))
        for name, token in data["instances"].items()
    ]
    return {
        "status reports": write_status_script(directory, status_lines),
        "lookups (16 keys)": write_holder_script(directory, "lookup", data["holder"], lookups),
        "publications": write_holder_script(directory, "publish", data["holder"], publishes),
        # No database: what serving a request costs, the framework included.
        "/healthz": write_holder_script(
            directory, "healthz", data["holder"], [("GET", "/healthz", None)]
        ),
    }


def server_cpu_s(server: Server) -> float:
    """CPU seconds the server's processes (master and workers) have used so far."""
    pids = [server.proc.pid]
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children")
    pids += [int(pid) for pid in children.read_text().split()]
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def rates(wrk_bin: str, server: Server, paths: dict, seconds: int) -> dict:
    """Per path: requests per second, and the server's CPU milliseconds per request."""
    out = {}
    for name, script in paths.items():
        cpu_before = server_cpu_s(server)
        rate, errors = wrk(wrk_bin, server.url, script, seconds, connections=8)
        cpu_ms = (server_cpu_s(server) - cpu_before) * 1000 / max(rate * seconds, 1)
        out[name] = (rate, cpu_ms)
        if errors:
            print(f"    {name}: {errors} errors")
    return out


def open_stream(port: int, session: str, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        (
            f"GET /kvsp/sessions/{session}/output HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
    )
    return sock


def read_head(sock: socket.socket) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def token_to_frame(server: Server, data: dict, streams: list) -> list[float]:
    """Seconds from POSTing a token of each session (as its instance does, to either worker)
    to its frame on each of the session's streams."""
    arrived: dict[int, float] = {}
    marker = b'"index":1,'
    done = threading.Event()

    def read(number: int, sock: socket.socket) -> None:
        seen = b""
        sock.settimeout(30)
        try:
            while marker not in seen:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                seen = seen[-64:] + chunk
            arrived[number] = time.perf_counter()
        except OSError:
            return
        if len(arrived) == len(streams):
            done.set()

    threads = [threading.Thread(target=read, args=(n, s)) for n, (s, _) in enumerate(streams)]
    for thread in threads:
        thread.start()
    posted = {}
    headers = {"Authorization": f"Bearer {data['instances']['ii0000']}"}
    with httpx.Client(timeout=30, headers=headers) as client:
        for session in data["sessions"]:
            posted[session] = time.perf_counter()
            answer = client.post(
                f"{server.url}/kvsp/sessions/{session}/output",
                json={"epoch": 1, "index": 1, "token": 2},
            )
            assert answer.status_code == 200, answer.text
    done.wait(30)
    for thread in threads:
        thread.join(timeout=5)
    return [arrived[n] - posted[session] for n, (_, session) in enumerate(streams) if n in arrived]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    wrk_bin = ensure_wrk()
    env = control_env(DB, KVSP_RATE_LIMIT_PER_S="0", KVSP_LOG_LEVEL="WARNING")
    fresh_database(DB)
    migrated = run_manage("migrate", "--no-input", env=env)
    if migrated.returncode:
        sys.exit(migrated.stderr)
    data = setup(env)
    logs = Path(tempfile.mkdtemp(prefix="kvsp-bench-streams-"))
    print(f"output streams benchmark: 2 workers of {THREADS} threads, wrk on 8 connections")
    kinds = ("gthread", "asgi", "django-asgi")
    with tempfile.TemporaryDirectory() as directory:
        paths = scripts(directory, data)
        servers = {kind: BenchServer(kind, env, logs) for kind in kinds}
        try:
            for server in servers.values():
                server.start()
            # Paired: every path on every server in turn, the order rotated each round, so that
            # what the shared machine does meanwhile weighs on all alike.
            measured = {kind: {name: [] for name in paths} for kind in kinds}
            for round_number in range(args.rounds):
                for name, script in paths.items():
                    order = kinds[round_number % 3 :] + kinds[: round_number % 3]
                    for kind in order:
                        measured[kind][name].append(
                            rates(wrk_bin, servers[kind], {name: script}, args.seconds)[name]
                        )
        finally:
            for server in servers.values():
                server.stop()
        print(
            f"  median of {args.rounds} paired rounds: requests/s, server CPU ms per request; "
            "in brackets the median of the rounds' ratios to gthread"
        )
        for name in paths:
            base = measured["gthread"][name]
            line = f"    {name:18s}"
            for kind in kinds:
                runs = measured[kind][name]
                rate = statistics.median(r for r, _ in runs)
                cpu_ms = statistics.median(c for _, c in runs)
                line += f" | {kind} {rate:4.0f}/s {cpu_ms:5.2f} ms"
                if kind != "gthread":
                    pairs = list(zip(runs, base, strict=True))
                    rate_ratio = statistics.median(r / b[0] for (r, _), b in pairs)
                    cpu_ratio = statistics.median(c / b[1] for (_, c), b in pairs)
                    line += f" ({rate_ratio:.2f}, {cpu_ratio:.2f})"
            print(line)

        server = BenchServer("asgi", env, logs).start()
        try:
            quiet = rates(wrk_bin, server, paths, args.seconds)
            time.sleep(2)
            idle_before = server_cpu_s(server)
            time.sleep(5)
            idle_alone = (server_cpu_s(server) - idle_before) / 5
            streams = []
            for n in range(STREAMS):
                session = data["sessions"][n % len(data["sessions"])]
                streams.append((open_stream(server.port, session, data["readers"][n % 4]), session))
            assert all(b" 200 " in read_head(sock) for sock, _ in streams)
            for n in range(STREAMS):
                sock = open_stream(
                    server.port, data["sessions"][n % 10], data["readers"][4 + n % 4]
                )
                read_head(sock)
                if n % 2:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
                else:
                    sock.shutdown(socket.SHUT_WR)
            time.sleep(2)
            idle_before = server_cpu_s(server)
            time.sleep(5)
            idle = (server_cpu_s(server) - idle_before) / 5
            loaded = rates(wrk_bin, server, paths, args.seconds)
            print(
                f"  asgi with {STREAMS} streams open (heartbeats every 5 s) and {STREAMS} "
                f"dropped, against none; idle, the server uses {idle:.3f} CPU s/s "
                f"({idle_alone:.3f} without streams):"
            )
            for name in paths:
                (rate, cpu_ms), (loaded_rate, loaded_cpu) = quiet[name], loaded[name]
                print(
                    f"    {name:18s} {rate:5.0f}/s {cpu_ms:5.2f} ms -> {loaded_rate:5.0f}/s "
                    f"({loaded_rate / rate:.2f}) {loaded_cpu:5.2f} ms ({loaded_cpu / cpu_ms:.2f})"
                )
            delays = token_to_frame(server, data, streams)
            print(
                f"  token to frame on {len(delays)} of {STREAMS} streams: median "
                f"{statistics.median(delays) * 1000:.1f} ms, p99 "
                f"{percentile(delays, 0.99) * 1000:.1f} ms (a stream on the other worker "
                "learns of it at the watcher's next look, every 50 ms)"
            )
            for sock, _ in streams:
                sock.close()
        finally:
            server.stop()

        # One worker, so that no other worker's free threads answer for it.
        server = BenchServer("gthread", env, logs, workers=1).start()
        try:
            held = [
                open_stream(server.port, data["sessions"][n % 10], data["readers"][8 + n % 4])
                for n in range(2 * THREADS)
            ]
            time.sleep(2)
            answered = 0
            for _ in range(6):  # each on a new connection, to whichever worker takes it
                try:
                    answered += httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
                except httpx.HTTPError:
                    pass
            print(
                f"  gthread, 1 worker of {THREADS} threads, {len(held)} streams open: /healthz "
                "answered within 5 s "
                f"{answered} times of 6"
            )
            for sock in held:
                sock.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
