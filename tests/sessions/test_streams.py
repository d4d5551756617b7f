"""Output event streams on a real control plane: many of them, connected or dropped without a
word, leave the control plane answering; a client that left is noticed and its stream released;
streams are capped per principal; heartbeats and Last-Event-ID."""

import selectors
import socket
import struct
import threading
import time
import uuid

import httpx
import orjson
import pytest

from sessions.models import OpenStream
from tests.sessions.test_checkpoints_and_output import checkpoint
from tests.support.fixtures import (
    make_caller,
    make_instance,
    make_scope,
    replica_json,
    status_record,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# Generous: this is about answering at all, not about speed.
ANSWER_TIMEOUT_S = 5


class RawStream:
    """One client of ``GET sessions/{id}/output`` with ``Accept: text/event-stream`` on a socket
    of its own, so that it can leave the way a crashed or cut-off client does."""

    def __init__(self, port: int, session: str, token: str, *, last_event_id: int | None = None):
        self.session = session
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        lines = [
            f"GET /kvsp/sessions/{session}/output HTTP/1.1",
            f"Host: 127.0.0.1:{port}",
            f"Authorization: Bearer {token}",
            "Accept: text/event-stream",
        ]
        if last_event_id is not None:
            lines.append(f"Last-Event-ID: {last_event_id}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.received = b""

    def head(self) -> bytes:
        """The response head (status line and fields), once it has arrived."""
        while b"\r\n\r\n" not in self.received:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received.split(b"\r\n\r\n", 1)[0]

    def status(self) -> int:
        return int(self.head().split(b" ", 2)[1])

    def has_token(self, index: int) -> bool:
        return b'"index":%d,' % index in self.received

    def reset(self) -> None:
        """Leave abruptly: the kernel answers with a RST, no FIN, nothing read."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def half_close(self) -> None:
        """Stop sending and never read again, the socket left open."""
        self.sock.shutdown(socket.SHUT_WR)


class Readers:
    """Reads every connected stream in one thread, as their clients would."""

    def __init__(self, streams: list[RawStream]):
        self.selector = selectors.DefaultSelector()
        for stream in streams:
            stream.sock.setblocking(False)
            self.selector.register(stream.sock, selectors.EVENT_READ, stream)
        self.closed: list[RawStream] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.selector.select(timeout=0.1):
                stream = key.data
                try:
                    chunk = stream.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    stream.received += chunk
                else:
                    self.selector.unregister(stream.sock)
                    self.closed.append(stream)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.selector.close()


@pytest.fixture
def stream_settings():
    """What the control plane of a test runs with; heartbeats every second."""
    return {"KVSP_STREAM_HEARTBEAT_S": "1", "KVSP_RATE_LIMIT_PER_S": "0"}


@pytest.fixture
def served(cluster, role_env, start_process, stream_settings):
    """A control plane, an instance serving ten sessions with a token each, and what liveness
    checks need."""
    node = make_instance("ii1", scopes=[cluster.scope])
    server = start_process("server", "control", role_env(**stream_settings))
    sessions = [str(uuid.uuid4()) for _ in range(10)]
    for session in sessions:
        document = checkpoint(cluster, session)
        assert node.put(f"/kvsp/sessions/{session}/checkpoint", document).status_code == 201
        token = {"epoch": 1, "index": 0, "token": 7}
        assert node.post(f"/kvsp/sessions/{session}/output", token).status_code == 200
    key = cluster.keys[0]
    record = replica_json(
        cluster.scope.scope_id_hex, cluster.compat, key, "http://holder.test/kvsp/"
    )
    assert cluster.holder.put(
        f"/kvsp/replicas/{cluster.compat}/{cluster.scope.scope_id_hex}/{key}", record
    ).status_code in (200, 201)
    return {"cluster": cluster, "node": node, "server": server, "sessions": sessions, "key": key}


class Liveness:
    """``/healthz``, a status PUT and a lookup, each answered correctly within the timeout."""

    def __init__(self, served):
        self.url = served["server"].url
        self.cluster = served["cluster"]
        self.node = served["node"]
        self.key = served["key"]

    def check(self) -> None:
        with httpx.Client(timeout=ANSWER_TIMEOUT_S) as client:
            health = client.get(f"{self.url}/healthz")
            assert (health.status_code, health.json()["status"]) == (200, "ok")
            status = client.put(
                f"{self.url}/kvsp/instances/ii1/status",
                # The same epoch each time (a higher one is a restart, which fails the sessions
                # over), and a TTL that outlasts the test.
                json=status_record("http://ii1.test/kvsp/", ttl_ms=600_000),
                headers={"Authorization": f"Bearer {self.node.token}"},
            )
            assert (status.status_code, status.json()["state"]) == (200, "active")
            lookup = client.post(
                f"{self.url}/kvsp/lookup",
                json={
                    "scope_id": self.cluster.scope.scope_id_hex,
                    "compat_id": self.cluster.compat,
                    "block_keys": [self.key],
                },
                headers={"Authorization": f"Bearer {self.cluster.router.token}"},
            )
            assert lookup.status_code == 200
            assert lookup.json()["matched"] == 1


def test_many_streams_connected_or_dropped_leave_the_control_plane_answering(served):
    port = served["server"].port
    sessions = served["sessions"]
    liveness = Liveness(served)
    liveness.check()
    scope = served["cluster"].scope
    # The default cap (100 per principal) needs several principals for 200 streams.
    readers = [make_caller(f"reader-{n}", scopes=[scope]) for n in range(4)]
    leavers = [make_caller(f"leaver-{n}", scopes=[scope]) for n in range(4)]

    connected = []
    for n in range(200):
        stream = RawStream(
            port,
            sessions[n % len(sessions)],
            readers[n % len(readers)].token,
            last_event_id=0 if n % 2 else None,
        )
        connected.append(stream)
    for stream in connected:
        assert stream.status() == 200, stream.head()
    reading = Readers(connected)
    try:
        liveness.check()
        dropped = [
            RawStream(port, sessions[n % len(sessions)], leavers[n % len(leavers)].token)
            for n in range(200)
        ]
        for n, stream in enumerate(dropped):
            assert stream.status() == 200, stream.head()
            stream.reset() if n % 2 else stream.half_close()
            if n % 20 == 0:
                liveness.check()
        for _ in range(10):
            liveness.check()

        # Every dropped stream is noticed and released; every connected one stays.
        leaver_ids = [_principal_id(caller) for caller in leavers]
        reader_ids = [_principal_id(caller) for caller in readers]
        wait_until(
            lambda: not OpenStream.objects.filter(principal__in=leaver_ids).exists(),
            "release of the dropped streams",
            timeout=60,
        )
        assert OpenStream.objects.filter(principal__in=reader_ids).count() == 200
        # The server closed its side of every dropped connection: none waits in CLOSE-WAIT.
        wait_until(lambda: not close_wait_sockets(port), "no socket in CLOSE-WAIT", timeout=30)
        liveness.check()

        # The connected streams still deliver: the token before, then a new one.
        for n, stream in enumerate(connected):
            assert stream.has_token(0) == (n % 2 == 0)  # Last-Event-ID: 0 skips index 0
        for session in sessions:
            token = {"epoch": 1, "index": 1, "token": 8}
            answer = served["node"].post(f"/kvsp/sessions/{session}/output", token)
            assert answer.status_code == 200, answer.content
        wait_until(
            lambda: all(stream.has_token(1) for stream in connected),
            "the new token on every connected stream",
            timeout=60,
        )
        assert not reading.closed
        # Heartbeats keep an idle stream going.
        assert all(b": keepalive" in stream.received for stream in connected)
        liveness.check()
    finally:
        reading.close()
        for stream in connected:
            stream.sock.close()
        for stream in locals().get("dropped", []):
            stream.sock.close()


def close_wait_sockets(port: int) -> int:
    """TCP sockets of this machine on local ``port`` in CLOSE-WAIT: the peer has closed and
    the owner has not noticed."""
    found = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                local, _, state = line.split()[1:4]
                found += int(local.rsplit(":", 1)[1], 16) == port and state == "08"
    return found


def _principal_id(caller) -> int:
    from index.authentication import principal_for_token

    return principal_for_token(caller.token).id


@pytest.mark.parametrize(
    "stream_settings", [{"KVSP_STREAM_HEARTBEAT_S": "1", "KVSP_STREAMS_PER_PRINCIPAL": "2"}]
)
def test_streams_are_capped_per_principal_and_a_dropped_one_frees_its_place(served):
    cluster, server = served["cluster"], served["server"]
    session = served["sessions"][0]
    reader = make_caller("capped-reader", scopes=[cluster.scope])
    other = make_caller("other-reader", scopes=[cluster.scope])
    stream_headers = {"Authorization": f"Bearer {reader.token}", "Accept": "text/event-stream"}
    url = f"{server.url}/kvsp/sessions/{session}/output"
    # A HEAD is over with its head: it keeps no place.
    for _ in range(3):
        assert httpx.head(url, headers=stream_headers, timeout=ANSWER_TIMEOUT_S).status_code == 200
    first, second = (RawStream(server.port, session, reader.token) for _ in range(2))
    assert (first.status(), second.status()) == (200, 200)

    refused = httpx.get(url, headers=stream_headers, timeout=ANSWER_TIMEOUT_S)
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"].endswith("/kvsp-too-many-requests")
    assert int(refused.headers["Retry-After"]) >= 1
    # The cap is the principal's: another one streams, and plain GETs are not streams.
    third = RawStream(server.port, session, other.token)
    assert third.status() == 200
    plain = httpx.get(
        url, headers={"Authorization": f"Bearer {reader.token}"}, timeout=ANSWER_TIMEOUT_S
    )
    assert plain.status_code == 200

    # Both streams leave without closing; the streams' idle limit (300 s) is far off, so only
    # noticing that they left gives their places back.
    first.reset()
    second.half_close()
    again = wait_until(
        lambda: _accepted(RawStream(server.port, session, reader.token)),
        "a stream accepted again",
        timeout=60,
        interval=0.5,
    )
    assert b": keepalive" in _read_until(again, b": keepalive")
    for stream in (second, third, again):
        stream.sock.close()


def _accepted(stream: RawStream) -> RawStream | None:
    if stream.status() == 200:
        return stream
    stream.sock.close()
    return None


def _read_until(stream: RawStream, marker: bytes, timeout: float = 30) -> bytes:
    deadline = time.monotonic() + timeout
    stream.sock.settimeout(timeout)
    while marker not in stream.received and time.monotonic() < deadline:
        chunk = stream.sock.recv(65536)
        if not chunk:
            break
        stream.received += chunk
    return stream.received


def test_another_scopes_session_is_a_problem_before_any_stream(served):
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    url = f"{served['server'].url}/kvsp/sessions"
    headers = {"Authorization": f"Bearer {outsider.token}", "Accept": "text/event-stream"}
    hidden = httpx.get(f"{url}/{served['sessions'][0]}/output", headers=headers, timeout=5)
    absent = httpx.get(f"{url}/{uuid.uuid4()}/output", headers=headers, timeout=5)
    assert hidden.status_code == absent.status_code == 404
    assert hidden.content == absent.content
    assert orjson.loads(hidden.content)["type"].endswith("/kvsp-not-found")
    assert not OpenStream.objects.exists()
