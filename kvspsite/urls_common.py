"""URLs both roles serve: the OpenAPI schema, liveness, and problem-details error handlers."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from kvspsite import views

urlpatterns = [
    path("kvsp/schema", SpectacularAPIView.as_view(), name="schema"),
    path("healthz", views.healthz, name="healthz"),
]
