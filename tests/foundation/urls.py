"""Views that exercise each error path of the REST plumbing; mounted only by these tests."""

from django.http import HttpResponse
from django.urls import include, path
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from kvsp.problems import ProtocolError
from kvspsite.urls_control import urlpatterns as control


class Echo(APIView):
    permission_classes = [AllowAny]

    def post(self, request):
        return Response({"echo": request.data})


class Private(APIView):
    def get(self, request):
        return Response({"principal": request.user.name})


class Crash(APIView):
    permission_classes = [AllowAny]

    def get(self, request):
        raise RuntimeError("secret internal state 0xdeadbeef")


class Stale(APIView):
    permission_classes = [AllowAny]

    def get(self, request):
        raise ProtocolError("kvsp-stale-epoch", "epoch 3 is lower than 5")


def _create_twice() -> None:
    """Creates the same uniquely named row twice, as two racing requests would."""
    from django.db import transaction

    from index.models import Scope

    with transaction.atomic():
        Scope.objects.create(name="twice", scope_id=b"\x01" * 16, key_ciphertext=b"k")
        Scope.objects.create(name="twice", scope_id=b"\x02" * 16, key_ciphertext=b"k")


class Twice(APIView):
    permission_classes = [AllowAny]

    def post(self, request):
        _create_twice()
        return Response({"created": 2})


def plain_twice(request):
    _create_twice()
    return HttpResponse("created")


def plain_crash(request):
    raise ValueError("secret internal state 0xdeadbeef")


def plain_ok(request):
    return HttpResponse("ok")


test_api = [
    path("echo", Echo.as_view()),
    path("private", Private.as_view()),
    path("crash", Crash.as_view()),
    path("stale", Stale.as_view()),
    path("twice", Twice.as_view()),
    path("plain-crash", plain_crash),
    path("plain-twice", plain_twice),
]

urlpatterns = [path("kvsp/test/", include(test_api)), *control]
