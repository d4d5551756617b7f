"""The server application of either role: ``gunicorn kvspsite.asgi:application -k asgi``.

Requests run in ``KVSP_HTTP_THREADS`` threads per process, as under gthread; output event
streams wait on the event loop instead of a thread each (``common/asgibridge.py``). On a node,
the block GETs a loader sends are answered without Django's handler (``workers/blockpath.py``),
and a request body may be as large as a block.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

from common.asgibridge import WsgiOnLoop  # noqa: E402

_wsgi = get_wsgi_application()
if settings.KVSP_ROLE == "node":
    from workers.blockpath import LeanBlockRequests

    application = WsgiOnLoop(
        _wsgi,
        threads=settings.KVSP_HTTP_THREADS,
        body_limit=max(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, settings.KVSP_MAX_BLOCK_OCTETS),
        lean=LeanBlockRequests(),
    )
else:
    application = WsgiOnLoop(
        _wsgi,
        threads=settings.KVSP_HTTP_THREADS,
        body_limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
    )
