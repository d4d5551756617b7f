"""URLs both roles serve: the OpenAPI schema, liveness, Prometheus metrics."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from common import metrics, views

urlpatterns = [
    path("kvsp/schema", SpectacularAPIView.as_view(), name="schema"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", metrics.metrics_view, name="metrics"),
]
