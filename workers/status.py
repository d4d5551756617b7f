"""The node's reports to the control plane (spec 6.3) and the upkeep of its records (6.1, 6.6),
as two threads of the worker process (see ``workers.runtime``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable

from django.conf import settings
from django.db import close_old_connections

from common.peers import PeerUnreachable
from common.tasks import instance_queue
from kvsp.problems import ProtocolError
from kvsp.records import InstanceStatusRecord
from workers import admission, control_plane, instance, leases, replicas, reshard_moves, selectors
from workers.models import NodeState

log = logging.getLogger(__name__)

# Reports go out at this share of the ttl/3 interval the spec allows, so that a slow round trip
# or a busy machine does not let the record expire at the PC.
REPORT_MARGIN = 0.8


def report_interval_s() -> float:
    return settings.KVSP_STATUS_TTL_MS / 3000 * REPORT_MARGIN


def keeper_interval_s() -> float:
    return max(min(5.0, settings.KVSP_REPLICA_TTL_MS / 8000), 0.2)


def broker_queue_length(app, queue: str) -> int:
    """Messages waiting in the broker for the instance's queue."""
    try:
        with app.connection_for_read() as connection:
            declared = connection.default_channel.queue_declare(queue=queue, passive=True)
            return int(declared.message_count)
    except Exception:  # a broker hiccup must not stop the reports
        log.debug("queue length of %s unavailable", queue, exc_info=True)
        return 0


def status_record(runtime, state: str, running: int, queued: int) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=settings.KVSP_PUBLIC_URL,
        epoch=runtime.epoch,
        state=state,
        running=running,
        queued=queued,
        batch_size=settings.KVSP_BATCH_SIZE,
        kv_utilization=selectors.kv_utilization(runtime.name),
        prefill_tokens_per_s=runtime.rates["prefill_tokens_per_s"],
        decode_tokens_per_s=runtime.rates["decode_tokens_per_s"],
        links=selectors.links(runtime.name),
        ttl_ms=settings.KVSP_STATUS_TTL_MS,
        compat_ids=runtime.compat_ids,
        engine=runtime.runs_engine,
    )


class _Loop(threading.Thread):
    """A round of work every ``interval()`` seconds of ``clock`` (the time a round takes
    counts), until the runtime is stopping."""

    interval_s = 1.0

    def __init__(self, runtime, name: str, clock: Callable[[], float] = time.monotonic):
        super().__init__(name=name, daemon=True)
        self.runtime = runtime
        self.clock = clock

    def run(self) -> None:
        while not self.runtime.stopping.is_set():
            started = self.clock()
            try:
                self.once()
            except Exception:
                log.exception("%s failed", self.name)
            finally:
                close_old_connections()
            wait = self.interval() - (self.clock() - started)
            self.runtime.stopping.wait(max(wait, 0.05))

    def interval(self) -> float:
        return self.interval_s

    @abstractmethod
    def once(self) -> None:
        """One round of the loop's work."""


class StatusWrites(threading.Thread):
    """The reporter's writes, in order, on a thread of their own, so that a report never
    waits for the database (on the embedded default's SQLite, for whichever process writes)."""

    def __init__(self):
        super().__init__(name="kvsp-status-writes", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, function, *args, **kwargs) -> None:
        self.jobs.put((function, args, kwargs))

    def run(self) -> None:
        while True:
            function, args, kwargs = self.jobs.get()
            try:
                function(*args, **kwargs)
            except Exception:
                log.exception("%s failed", getattr(function, "__name__", function))
            finally:
                close_old_connections()


class StatusReporter(_Loop):
    """Sends the Instance Status Record every ttl/3 at most, and applies the PC's answer.

    A report only reads the database (WAL on SQLite: a read never waits); what it writes (the
    PC's state, a drained node going to sleep, when it last reported) goes to ``StatusWrites``
    and shows in the next report. Only a new incarnation is written before the next report,
    since that report must carry its epoch."""

    def __init__(self, runtime, clock: Callable[[], float] = time.monotonic):
        super().__init__(runtime, "kvsp-status", clock)
        self.writes = StatusWrites()
        self.writes.start()

    def interval(self) -> float:
        return report_interval_s()

    def once(self) -> None:
        runtime = self.runtime
        running = runtime.load.running
        queued = runtime.load.waiting
        if runtime.app is not None:
            queued += broker_queue_length(runtime.app, instance_queue(runtime.name))
        node = instance.ensure_node(runtime.name)
        if node.state == NodeState.DRAINING and not running + queued:
            self.writes.submit(instance.do_enter_sleep_if_drained, runtime.name, 0)
        record = status_record(runtime, node.state, running, queued)
        try:
            state = control_plane.report_status(runtime.name, record)
        except ProtocolError as exc:
            self.writes.submit(instance.do_note_report, runtime.name, exc.detail)
            if exc.problem == "kvsp-stale-epoch":
                # The PC has written this incarnation off (its record expired, or it saw a
                # later one): rejoin as a new incarnation.
                runtime.begin_incarnation()
                log.warning("node %s: stale epoch, now epoch %d", runtime.name, runtime.epoch)
            else:
                log.warning("node %s: status report refused: %s", runtime.name, exc.detail)
            return
        except PeerUnreachable as exc:
            self.writes.submit(instance.do_note_report, runtime.name, str(exc))
            log.warning("node %s: status report failed: %s", runtime.name, exc)
            return
        if state != node.state:
            self.writes.submit(instance.do_apply_pc_state, runtime.name, state)
        self.writes.submit(instance.do_note_report, runtime.name)


class Keeper(_Loop):
    """Refreshes records, delivers owed withdrawals, forgets expired leases and stale working
    copies, and releases the blocks reshard moves owe once their leases have ended."""

    def __init__(self, runtime):
        super().__init__(runtime, "kvsp-keeper")

    def interval(self) -> float:
        return keeper_interval_s()

    def once(self) -> None:
        name = self.runtime.name
        replicas.do_refresh_replicas(name)
        replicas.do_retry_withdrawals(name)
        leases.do_delete_expired_leases(name)
        reshard_moves.do_release_owed(name)
        if self.runtime.device_tier is not None:
            admission.do_sync_device_tier(name, self.runtime.device_tier)
