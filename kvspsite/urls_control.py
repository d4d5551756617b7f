"""URLs of the control plane: Index Service, Placement Controller, front end, admin."""

from django.contrib import admin
from django.urls import include, path

from kvspsite.urls_common import urlpatterns as common

urlpatterns = [
    *common,
    path("kvsp/", include("index.api.urls")),
    path("kvsp/", include("placement.api.urls")),
    path("kvsp/", include("sessions.api.urls")),
    path("admin/", admin.site.urls),
]
