"""vLLM engines in processes of their own, driven by ``engine_process.py`` in vLLM's environment
(``.venv-vllm``): what the vLLM tests and ``bench/bench_vllm.py`` start."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from tests.support.processes import ROOT

VLLM_PYTHON = Path(os.environ.get("KVSP_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
ENGINE_MODULE = "tests.vllm.engine_process"
REPLY = "kvsp-engine: "
ENGINE_START_S = 300
# A request of this suite takes well under a second; an engine silent this long is stuck.
REPLY_S = 120


def vllm_python() -> Path:
    """The interpreter of vLLM's environment; the tests fail (never skip) without it."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment")
    return VLLM_PYTHON


class EngineProcess:
    """A vLLM engine driven over its stdin and stdout; stderr goes to a log file."""

    def __init__(self, name: str, config: dict, log_dir: Path):
        self.name = name
        self.config = config
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> EngineProcess:
        python = vllm_python()
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        # The engine's own torch threads: one per engine, so that three share two cores fairly.
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(python), "-m", ENGINE_MODULE, json.dumps(self.config)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_replies, name=self.name, daemon=True).start()
        return self

    def _read_replies(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY) :]))
        self._replies.put(None)

    def _reply(self, timeout: float = REPLY_S) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise RuntimeError(
                f"engine {self.name} gave no answer in {timeout} s:\n{self.log()[-5000:]}"
            ) from None
        if reply is None:
            raise RuntimeError(
                f"engine {self.name} exited ({self.proc.wait()}):\n{self.log()[-5000:]}"
            )
        return reply

    def wait_ready(self) -> None:
        assert self._reply(ENGINE_START_S) == {"ready": True}

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict:
        return self.ask(op="generate", prompt=prompt, max_tokens=max_tokens)

    def drain(self) -> dict:
        return self.ask(op="drain")["counts"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # The end of its input: the engine finishes its stores and exits.
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's session: the engine, and what it started and left behind
        (multiprocessing's resource tracker outlives an engine that exits with ``os._exit``)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
