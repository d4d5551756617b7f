"""URLs of a node: the holder and inference-instance endpoints."""

from django.urls import include, path

from kvspsite import urls_common

urlpatterns = [
    *urls_common.urlpatterns,
    path("kvsp/", include("workers.api.urls")),
]
