"""The Celery app of both roles. How tasks are declared and sent is in ``common/tasks.py``."""

from __future__ import annotations

import os
import socket

from celery import Celery
from kombu import Queue

from common.tasks import BEAT_SCHEDULE, CONTROL_QUEUE, kvsp_task

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

app = Celery("kvsp")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_default_queue=CONTROL_QUEUE,
    task_queues=[Queue(CONTROL_QUEUE)],
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_schedule=BEAT_SCHEDULE,
)
app.autodiscover_tasks()


@kvsp_task(ignore_result=False, name="kvsp.ping", time_limit=30)
def ping(payload=None):
    """Round trip through the broker: which worker answered, and the payload back."""
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "payload": payload}
