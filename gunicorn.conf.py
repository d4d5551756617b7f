"""Settings gunicorn reads from the working directory when it starts a role of this project.

Each server gets a directory of its own for prometheus-client's multiprocess mode, so that
``/metrics`` adds up the requests of all its workers instead of answering for whichever worker
took the scrape (``common/metrics.py``). The directory lives under ``var/metrics/`` named by
the server's process id; it is emptied at start-up and removed at exit, and directories left by
servers that were killed are removed by the next server that starts. A directory named by the
environment (``PROMETHEUS_MULTIPROC_DIR``) is used as it is.
"""

import gc
import os
import shutil
from pathlib import Path

_VAR_DIR = Path(os.environ.get("KVSP_VAR_DIR") or Path(__file__).resolve().parent / "var")
_METRICS_DIR = _VAR_DIR / "metrics"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _metrics_dir() -> Path:
    _METRICS_DIR.mkdir(parents=True, exist_ok=True)
    for left in _METRICS_DIR.iterdir():
        if left.name.isdigit() and not _alive(int(left.name)):
            shutil.rmtree(left, ignore_errors=True)
    mine = _METRICS_DIR / str(os.getpid())
    shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir()
    return mine


# This file is read by the server's own process before it loads the application (even with
# --preload) and before it forks workers, so every process of the server sees the directory
# before it imports prometheus-client. A directory the environment names already is kept.
_OWN_DIR = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _OWN_DIR = _metrics_dir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_OWN_DIR)


# A kept-alive connection stays open longer than clients keep theirs idle (httpx: 5 s), so that
# a client never sends a request on a connection the server is closing at that very moment
# (gunicorn's 2 s made an idle connection's next request fail now and then with "server
# disconnected"). Idle connections cost the ASGI worker nothing but a socket.
keepalive = 30


def post_worker_init(worker):
    # What the application loaded lives as long as the worker: kept out of the garbage
    # collector's full passes, each of which would hold up every request thread of the worker
    # while it walked those objects again (workers.runtime.settle_heap does the same for a
    # node's Celery worker). The TLS context of its peer clients and the task publisher are
    # made ready first, so that no request's first call to a peer (a directive's send) or
    # first task pays for them.
    from django.conf import settings

    from common.peers import tls_context
    from common.tasks import CONTROL_QUEUE, instance_queue, warm_publisher

    control = settings.KVSP_ROLE == "control"
    tls_context()
    # Requests send tasks (a node's generate, resume or directive goes to its worker this way):
    # the first of them should not wait for the broker's client to load and connect.
    warm_publisher(CONTROL_QUEUE if control else instance_queue(settings.KVSP_INSTANCE))
    gc.freeze()
    # A request makes thousands of short-lived objects (a placement's 32,768 tokens, its rows
    # and candidates): at the default threshold of 700 allocations the young generations were
    # collected a few times a request, about 2 ms of a placement's CPU. Collected every 20,000
    # they cost about 0.2 ms, and cyclic garbage waits a little longer to be freed.
    gc.set_threshold(20_000, 20, 20)
    # A worker of the control plane prices placements: compile the fetch plan as it starts.
    if control:
        from kvsp.fetchplan import warm_in_background

        warm_in_background()


def on_exit(server):
    if _OWN_DIR is not None:
        shutil.rmtree(_OWN_DIR, ignore_errors=True)
