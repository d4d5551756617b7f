"""URLs of a node: the holder and inference-instance endpoints."""

from django.urls import include, path

from kvspsite.urls_common import urlpatterns as common

urlpatterns = [
    *common,
    path("kvsp/", include("workers.api.urls")),
]
