"""The control plane's server application: ``gunicorn kvspsite.asgi:application -k asgi``.

Requests run in ``KVSP_HTTP_THREADS`` threads per process, as under gthread; output event
streams wait on the event loop instead of a thread each (``kvspsite/asgibridge.py``).
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

from kvspsite.asgibridge import WsgiOnLoop  # noqa: E402

application = WsgiOnLoop(
    get_wsgi_application(),
    threads=settings.KVSP_HTTP_THREADS,
    body_limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
)
