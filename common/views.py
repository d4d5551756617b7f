"""Views that belong to no app: liveness for process supervisors and tests."""

from django.conf import settings
from django.http import JsonResponse


def healthz(request):
    return JsonResponse({"status": "ok", "role": settings.KVSP_ROLE})
