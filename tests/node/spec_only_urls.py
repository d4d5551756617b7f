"""An Index Service without the batch forms the spec does not have (``POST replicas``, ``POST
replicas/withdrawals``): every other route of the Index Service, and liveness and metrics."""

from django.urls import include, path

from index.api.urls import urlpatterns as index_routes
from kvspsite import urls_common

BATCH_ROUTES = ("replicas", "replica-withdrawals")

urlpatterns = [
    *urls_common.urlpatterns,
    path("kvsp/", include([route for route in index_routes if route.name not in BATCH_ROUTES])),
]
