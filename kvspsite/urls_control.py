"""URLs of the control plane: Index Service, Placement Controller, front end, admin."""

from django.contrib import admin
from django.urls import path

from kvspsite.urls_common import urlpatterns as common

urlpatterns = [
    *common,
    path("admin/", admin.site.urls),
]
