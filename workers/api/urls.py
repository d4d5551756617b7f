from django.urls import path

import common.converters  # noqa: F401 - registers hex16 and hex32
from workers.api import views

urlpatterns = [
    path(
        "blocks/<hex32:compat_id>/<hex16:scope_id>/<hex32:block_key>",
        views.BlockView.as_view(),
        name="block",
    ),
    path(
        "blocks/<hex32:compat_id>/<hex16:scope_id>",
        views.BlockBatchView.as_view(),
        name="block-batch",
    ),
    path("leases", views.LeaseListView.as_view(), name="leases"),
    path("leases/<str:lease>", views.LeaseView.as_view(), name="lease"),
    path("prefetch", views.PrefetchView.as_view(), name="prefetch"),
    path("prefetch/<uuid:directive>", views.DirectiveView.as_view(), name="directive"),
    path("state", views.StateView.as_view(), name="state"),
    path("generate", views.GenerateView.as_view(), name="generate"),
    path("sessions/<str:session>/resume", views.ResumeView.as_view(), name="resume"),
    path("reshard", views.ReshardView.as_view(), name="reshard"),
]
