"""The worker process of a node (DESIGN.md section 1): one Celery worker per instance, consuming
queue ``ii.<name>`` with a pool of threads, that owns the instance's tensors.

When the worker is ready it begins a new incarnation (a new epoch, 6.3), reconciles the tier
store with its files (blocks whose serving copy is gone are faults: their records are withdrawn
first), and starts two threads:

- the status reporter, which sends the Instance Status Record every third of its TTL with the
  load the worker sees (tasks running, tasks waiting), and
- the keeper, which refreshes Replica Records half way through their TTL, delivers withdrawals
  owed to the Index Service, deletes expired leases and drops working copies of blocks that
  another process evicted.

An engine is loaded when ``KVSP_MODEL_DIR`` names a model; without one the node is a
storage-only holder. Once loaded it is warmed up (``KVSP_ENGINE_WARM_UP``): it runs a short
prompt through each step a session takes, keeping nothing, so that the first session on the
node does not pay for the engine's first run. Only then is what it serves written to the node's
row, for the HTTP process to admit sessions by, and offered in the status record. Its prefill
and decode rates are measured next and reported instead of the configured ones. Sessions a
previous incarnation was serving when it stopped are marked failed: the PC resumes them
elsewhere.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from celery import signals
from django.conf import settings
from django.db import close_old_connections

from common.peers import tls_context
from common.tasks import instance_queue
from workers import admission, eviction, instance, replicas, tiers

log = logging.getLogger(__name__)


class Load:
    """Tasks this worker has received and not started (queued here), and those running."""

    def __init__(self):
        self._received: set[str] = set()
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def received(self, task_id: str) -> None:
        with self._lock:
            self._received.add(task_id)

    def started(self, task_id: str) -> None:
        with self._lock:
            self._received.discard(task_id)
            self._running.add(task_id)

    def ended(self, task_id: str) -> None:
        with self._lock:
            self._received.discard(task_id)
            self._running.discard(task_id)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._received)


class NodeRuntime:
    """What the worker process of instance ``name`` holds."""

    def __init__(self, name: str, app=None):
        self.name = name
        self.app = app
        self.load = Load()
        self.device_tier = (
            tiers.DeviceTier(settings.KVSP_TIER_DEVICE_OCTETS)
            if settings.KVSP_TIER_DEVICE_OCTETS
            else None
        )
        self.tier_store = tiers.TierStore(name, self.device_tier)
        self.epoch = 0
        self.rates = {
            "prefill_tokens_per_s": settings.KVSP_PREFILL_TOKENS_PER_S,
            "decode_tokens_per_s": settings.KVSP_DECODE_TOKENS_PER_S,
        }
        self._engine = None
        self._engine_lock = threading.Lock()
        # The engine's warm-up before it was published: forward passes and milliseconds (None:
        # none ran, or it failed).
        self.warm_up: dict | None = None
        self._threads: list[threading.Thread] = []
        self.stopping = threading.Event()

    # -- the engine ------------------------------------------------------------------------

    @property
    def has_engine(self) -> bool:
        return bool(settings.KVSP_MODEL_DIR)

    def engine(self):
        """The engine adapter, loaded (and warmed up) on first use; None for a storage-only
        holder. The node says what it serves only once this has returned."""
        if not self.has_engine:
            return None
        with self._engine_lock:
            if self._engine is None:
                from workers.engines.reference import ReferenceEngine

                engine = ReferenceEngine(
                    settings.KVSP_MODEL_DIR, block_tokens=settings.KVSP_BLOCK_TOKENS
                )
                if settings.KVSP_ENGINE_WARM_UP:
                    self._warm_up(engine)
                instance.do_note_engine(
                    self.name,
                    {
                        "compat_id": engine.compat_id,
                        "block_tokens": engine.block_tokens,
                        "vocab_size": engine.vocab_size,
                        "max_positions": engine.max_positions,
                    },
                )
                self._engine = engine
            return self._engine

    def _warm_up(self, engine) -> None:
        """A forward pass of every kind before the engine is published, so that the first
        session does not pay for the engine's first run. A failure is logged and the node
        serves cold."""
        begin = time.perf_counter()
        try:
            passes = engine.warm_up()
        except Exception:
            log.exception("node %s: the engine's warm-up failed; it serves cold", self.name)
            return
        self.warm_up = {
            "forward_passes": passes,
            "ms": (time.perf_counter() - begin) * 1000,
        }
        log.info(
            "node %s: engine warmed up (%d forward passes, %.0f ms)",
            self.name,
            passes,
            self.warm_up["ms"],
        )

    def measure_engine(self, decode_steps: int = 32) -> dict:
        """Prefill four blocks of tokens and decode ``decode_steps`` tokens greedily, one
        sequence at a time; the rates become the reported ones."""
        engine = self.engine()
        if engine is None:
            return {"engine": False, **self.rates}
        text = "KV caches kept beyond a request are found again and loaded before it arrives. "
        tokens = []
        while len(tokens) < 4 * engine.block_tokens:
            tokens += engine.tokenize(text)
        tokens = tokens[: 4 * engine.block_tokens]
        started = time.time()
        begin = time.perf_counter()
        sequence = engine.prefill(tokens)
        prefill_s = time.perf_counter() - begin
        token = int(sequence.logits.argmax())
        steps = []
        for _ in range(decode_steps):
            begin = time.perf_counter()
            token = int(engine.decode(sequence, token).argmax())
            steps.append(time.perf_counter() - begin)
        figures = {"prefill_tokens_per_s": len(tokens) / prefill_s}
        figures["decode_tokens_per_s"] = (
            len(steps) / sum(steps) if steps else self.rates["decode_tokens_per_s"]
        )
        self.rates = figures
        return {
            "engine": True,
            **figures,
            "step_ms": [step * 1000 for step in steps],
            "started": started,
            "finished": time.time(),
        }

    def engine_state(self) -> dict:
        """What the engine has run, without loading it: ``warm_up`` is None when no warm-up
        ran before the engine was published (turned off, or it failed)."""
        engine = self._engine
        return {
            "engine": engine is not None,
            "warm_up": self.warm_up,
            "forward_passes": engine.forward_passes if engine is not None else 0,
        }

    @property
    def runs_engine(self) -> bool:
        """Whether the status record offers the instance to placement (``"engine"``, DESIGN.md
        section 3): only once its engine is loaded. A storage-only holder never is; a node whose
        engine still loads (or failed to) would refuse what it is sent (503) until then."""
        return self._engine is not None

    @property
    def compat_ids(self) -> tuple[str, ...] | None:
        """What the instance serves: its engine's Compatibility ID; none without an engine."""
        engine = self._engine
        return (engine.compat_id,) if engine is not None else None

    # -- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        from workers.status import Keeper, StatusReporter

        instance.ensure_node(self.name)
        # The HTTP process admits sessions only once this worker's engine says what it serves.
        instance.do_note_engine(self.name, None)
        admission.do_reset_device_residency(self.name)
        self.begin_incarnation()
        interrupted = instance.do_fail_interrupted_sessions(self.name, self.epoch)
        if interrupted:
            log.warning("node %s: %d sessions were cut short by a restart", self.name, interrupted)
        checked = eviction.do_check_tier_store(self.name)
        if checked["lost"]:
            log.error("node %s: lost blocks withdrawn: %s", self.name, checked["lost"])
        close_old_connections()
        self._threads = [StatusReporter(self), Keeper(self)]
        if self.device_tier is not None:
            # torch takes a second to import: not in the first prefetch's way.
            self._threads.append(
                threading.Thread(target=self._import_torch, name="kvsp-torch", daemon=True)
            )
        if self.has_engine:
            self._threads.append(
                threading.Thread(target=self._load_engine, name="kvsp-engine", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        settle_heap()
        log.info("node %s: epoch %d, worker ready", self.name, self.epoch)

    def begin_incarnation(self) -> int:
        """A new epoch (6.3): when the worker starts, and again when the PC has written the
        running one off (its record expired during a pause, a stall or a lock), so that such
        a pause costs a failover but never the node. Every record is published again at once
        (records may have expired meanwhile). Sessions still running from before a pause are
        the PC's to have resumed elsewhere under higher session epochs: their next message is
        refused as stale and they stop (superseded), sending nothing more."""
        self.epoch = instance.do_begin_incarnation(self.name)
        replicas.do_republish_all(self.name)
        return self.epoch

    def _import_torch(self) -> None:
        _ = self.device_tier.device
        settle_heap()

    def _load_engine(self) -> None:
        try:
            self.measure_engine()
        except Exception:
            log.exception("node %s: the engine could not be loaded", self.name)
        settle_heap()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)


def settle_heap() -> None:
    """Keep what the process has loaded so far (Django, Celery, torch, the engine: hundreds of
    thousands of objects that live as long as it) out of the garbage collector's full passes.
    Each full pass over them held the GIL for about 150 ms, several times a directive, with
    every fetcher stopped; frozen, a pass looks only at what was made since. Nothing is
    collected first: that would be one more such pass (145 ms of CPU at every start), to free
    start-up garbage of no consequence."""
    gc.freeze()


_runtime: NodeRuntime | None = None


def current() -> NodeRuntime | None:
    """The runtime of this worker process, or None outside a node's worker."""
    return _runtime


@signals.worker_ready.connect
def _on_worker_ready(sender=None, **kwargs) -> None:
    global _runtime
    name = settings.KVSP_INSTANCE
    if settings.KVSP_ROLE != "node" or not name:
        return
    queues = set(sender.app.amqp.queues.consume_from) if sender is not None else set()
    if instance_queue(name) not in queues:
        return
    # The TLS context of the node's peer clients, built once before the heap is settled: a
    # directive's loader would otherwise build it before its first request.
    tls_context()
    _runtime = NodeRuntime(name, sender.app)
    _runtime.start()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**kwargs) -> None:
    if _runtime is not None:
        _runtime.stop()


@signals.task_received.connect
def _on_task_received(request=None, **kwargs) -> None:
    if _runtime is not None and request is not None:
        _runtime.load.received(request.id)


@signals.task_prerun.connect
def _on_task_prerun(task_id=None, **kwargs) -> None:
    if _runtime is not None and task_id:
        _runtime.load.started(task_id)


@signals.task_postrun.connect
def _on_task_postrun(task_id=None, **kwargs) -> None:
    if _runtime is not None and task_id:
        _runtime.load.ended(task_id)


@signals.task_revoked.connect
def _on_task_revoked(request=None, **kwargs) -> None:
    if _runtime is not None and request is not None:
        _runtime.load.ended(request.id)
