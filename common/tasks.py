"""How every KVSP task is declared, queued and sent; the Celery app itself is in
``kvspsite/celery.py``.

Queues: ``control`` for the Placement Controller's work, ``ii.<name>`` for the worker of
instance ``<name>`` (it owns that instance's tensors). Tasks acknowledge late, are rejected back
to the queue when their worker dies, take ids rather than objects, and are idempotent: a
redelivered task re-reads its row and returns early when the work is already done.
"""

from __future__ import annotations

import logging
import threading

from celery import current_app, shared_task
from kombu import Queue

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"

# Celery beat's schedule: filled by the apps' task modules as they are imported, read by beat.
BEAT_SCHEDULE: dict[str, dict] = {}


def instance_queue(instance_name: str) -> str:
    """The queue the worker of one inference instance consumes."""
    return f"ii.{instance_name}"


# Network trouble and a peer that is briefly gone are worth retrying; a bug is not.
RETRYABLE = (ConnectionError, TimeoutError, OSError)


def kvsp_task(*, time_limit: int = 300, max_retries: int = 5, **opts):
    """Declare a task with the project's delivery guarantees (see the module docstring).

    Tasks go to the ``control`` queue unless sent with ``queue=instance_queue(name)``.
    """
    options = {
        "acks_late": True,
        "reject_on_worker_lost": True,
        "autoretry_for": RETRYABLE,
        "retry_backoff": True,
        "retry_backoff_max": 30,
        "retry_jitter": True,
        "max_retries": max_retries,
        "soft_time_limit": max(time_limit - 5, 1),
        "time_limit": time_limit,
    }
    options.update(opts)
    return shared_task(**options)


def enqueue(task, *args, queue: str | None = None, **options) -> bool:
    """Send a task whose work is already recorded in a row; False when the broker is down.

    Callers send after their transaction commits, so the work is durable before the message:
    when the broker cannot take the message, a housekeeping sweep finds the row and sends it
    again. A request that committed its write therefore never fails because the broker did.
    """
    try:
        task.apply_async(args=args, queue=queue, **options)
    except Exception:  # any broker or connection failure: the row is the record of the work
        log.warning("could not send %s%r now; the sweep will", task.name, args, exc_info=True)
        return False
    return True


def run_now_by_name(name: str, *args) -> None:
    """Run the task registered as ``name`` in this process now; when it fails, ``enqueue`` it
    for a worker to retry.

    An app starts the task of an app above it this way (``placement`` that of ``sessions``,
    which it may not import: DESIGN.md section 2). Call it once the work is recorded (on
    commit): when the broker is down too, a housekeeping sweep finds the row, as with
    ``enqueue``.
    """
    app = current_app
    try:
        if name not in app.tasks:  # its app's task module is not imported yet in this process
            app.loader.import_default_modules()
        app.tasks[name](*args)
    except Exception:
        log.warning("%s%r failed at once; its task retries", name, args, exc_info=True)
        enqueue(app.signature(name), *args)


def warm_publisher(queue: str) -> None:
    """Make a serving process ready to send tasks before its first request does.

    A process's first task otherwise pays for importing the tasks' modules, the broker's
    transport (redis-py, about 90 ms) and the result backend, then for connecting and declaring
    its queue: 100-140 ms measured on the first generate, resume or directive a node's HTTP
    process admitted, every one of them the first hop of a request. The imports happen here;
    the connection is made on a thread, so that a broker that is down delays nothing (the
    first send then retries as any send does).
    """
    app = current_app
    app.loader.import_default_modules()
    app.backend  # noqa: B018 -- every send builds an AsyncResult, which loads the backend

    def connect() -> None:
        try:
            with app.producer_or_acquire() as producer:
                producer.connection.ensure_connection(max_retries=1)
                producer.maybe_declare(Queue(queue))
        except Exception:  # the broker is down: the first send will connect, or fail as usual
            log.debug("could not connect to the broker ahead of the first task", exc_info=True)

    threading.Thread(target=connect, name="kvsp-broker-warm", daemon=True).start()


def add_housekeeping(name: str, task: str, seconds: float, queue: str = CONTROL_QUEUE) -> None:
    """Register a periodic task with Celery beat; later modules call this at import."""
    BEAT_SCHEDULE[name] = {
        "task": task,
        "schedule": seconds,
        "options": {"queue": queue, "expires": seconds},
    }


@kvsp_task(name="common.prune_counter_minutes", time_limit=120, max_retries=0)
def prune_counter_minutes():
    from common import services  # models load after this module

    return services.do_prune_counter_minutes()


add_housekeeping("prune-counter-minutes", "common.prune_counter_minutes", 3600.0)
