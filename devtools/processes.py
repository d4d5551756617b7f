"""Role processes on loopback: gunicorn servers, Celery workers and beat, each with its output
in a log file. The local cluster (``manage.py kvsp_cluster``) and the multi-process tests start
them the same way."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies, however it
    dies (a SIGKILL included), so that no role process outlives its launcher. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A child process with its output in a log file; stopped (and its group killed) on exit.

    A kind of process that takes a while to be of use names ``ready_sign``, what shows that it
    is, and checks for it in ``ready``; ``start`` returns once it shows.
    """

    ready_sign = ""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def ready(self) -> bool:
        return True

    def start(self, timeout: float = 30) -> Self:
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> None:
        """Start the process without waiting for it to be ready."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        log.close()

    def wait_ready(self, timeout: float = 30) -> None:
        if self.ready_sign:
            self.wait_for(self.ready, self.ready_sign, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def wait_for(self, predicate, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            if predicate():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {what} after {timeout}s:\n{self.log()}")


def stop_all(processes: list[Process], *, grace: float = 5.0) -> None:
    """SIGTERM every process at once, then SIGKILL every group still there after ``grace``
    seconds, all at once too, and reap them: stopping many takes as long as the slowest, not
    their sum."""
    started = [process for process in processes if process.proc is not None]
    for process in started:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    lingering = []
    for process in started:
        try:
            process.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            lingering.append(process)
    for process in lingering:
        process.signal(signal.SIGKILL)
    for process in lingering:
        process.proc.wait()


def server_argv(bind: str, *, workers: int, threads: int) -> tuple[list[str], dict]:
    """The gunicorn command line of a role and what it adds to the environment. Both roles run
    under the ASGI worker (``kvspsite/asgi.py``): requests in ``threads`` threads per worker,
    the control plane's output event streams and a node's block GETs on the event loop."""
    argv = [str(BIN / "gunicorn"), "--bind", bind, "--workers", str(workers)]
    argv += ["kvspsite.asgi:application", "--worker-class", "asgi"]
    return argv, {"KVSP_HTTP_THREADS": str(threads)}


class Server(Process):
    """A gunicorn-served role of the Django project on a loopback port."""

    def __init__(
        self, name, env, log_dir, *, workers: int = 2, port: int | None = None, threads: int = 4
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv, extra = server_argv(f"127.0.0.1:{self.port}", workers=workers, threads=threads)
        argv += ["--timeout", "120", "--graceful-timeout", "3"]
        super().__init__(name, argv, {**extra, **env}, log_dir)

    ready_sign = "answer on /healthz"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


class CeleryProcess(Process):
    """A Celery program of the project (``celery -A kvspsite ...``), ready once its log shows
    ``ready_line``."""

    ready_line = ""

    def __init__(self, name, env, log_dir, program_args: list[str]):
        argv = [str(BIN / "celery"), "-A", "kvspsite", *program_args, "--loglevel", "INFO"]
        super().__init__(name, argv, env, log_dir)
        self.ready_sign = f"line {self.ready_line!r} in its log"

    def ready(self) -> bool:
        return self.ready_line in self.log()


class Worker(CeleryProcess):
    """A Celery worker consuming the given queues (solo pool unless ``pool`` says otherwise; a
    node's worker runs ``threads``)."""

    ready_line = " ready."

    def __init__(
        self, name, env, log_dir, *, queues: list[str], pool: str = "solo", concurrency: int = 1
    ):
        program_args = ["worker", "--pool", pool, "--concurrency", str(concurrency)]
        program_args += ["--queues", ",".join(queues), "--hostname", f"{name}@%h"]
        program_args += ["--without-gossip", "--without-mingle"]
        super().__init__(name, env, log_dir, program_args)


class Beat(CeleryProcess):
    """Celery beat, sending the housekeeping schedule; its schedule file lives in ``log_dir``."""

    ready_line = "beat: Starting"

    def __init__(self, name, env, log_dir):
        super().__init__(
            name, env, log_dir, ["beat", "--schedule", str(log_dir / f"{name}-schedule")]
        )


def run_manage(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def register_node(manage: Callable[..., dict], name: str, url: str, scope: str) -> str:
    """Register instance ``name`` at ``url`` and create its node principal, of ``scope`` and
    bound to the instance and to ``url`` as its holder; the principal's token."""
    manage("kvsp_instance", "add", name, "--url", url)
    return manage(
        "kvsp_principal",
        "create",
        f"node-{name}",
        "--scope",
        scope,
        "--instance",
        name,
        "--holder",
        url,
    )["token"]
