"""URLs of the control plane: Index Service, Placement Controller, front end, admin, and the
operator dashboard."""

from django.contrib import admin
from django.urls import include, path

from dashboard.views import favicon
from kvspsite import urls_common

urlpatterns = [
    *urls_common.urlpatterns,
    path("kvsp/", include("index.api.urls")),
    path("kvsp/", include("placement.api.urls")),
    path("kvsp/", include("sessions.api.urls")),
    path("admin/", admin.site.urls),
    path("favicon.ico", favicon, name="favicon"),
    path("", include("dashboard.urls")),
]

admin.site.site_header = admin.site.site_title = "KVSP administration"
admin.site.site_url = "/"
