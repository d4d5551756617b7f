"""An Index Service without ``POST replicas``, the batch form the spec does not have: every
other route of the Index Service, and liveness and metrics."""

from django.urls import include, path

from index.api.urls import urlpatterns as index_routes
from kvspsite.urls_common import urlpatterns as common

urlpatterns = [
    *common,
    path("kvsp/", include([route for route in index_routes if route.name != "replicas"])),
]
