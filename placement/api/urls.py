from django.urls import path

from placement.api import views

urlpatterns = [
    path("lookup", views.LookupView.as_view(), name="lookup"),
    path("instances/", views.InstanceListView.as_view(), name="instances"),
    path("instances/<str:name>", views.InstanceDetailView.as_view(), name="instance"),
    path("instances/<str:name>/status", views.InstanceStatusView.as_view(), name="instance-status"),
    path("instances/<str:name>/state", views.InstanceStateView.as_view(), name="instance-state"),
    path("placements", views.PlacementView.as_view(), name="placements"),
    path("shardmaps/<str:map_id>", views.ShardMapView.as_view(), name="shardmap"),
    path("shardmaps/<str:map_id>/reshard", views.ReshardView.as_view(), name="reshard"),
    path(
        "shardmaps/<str:map_id>/reshards/<int:to_version>",
        views.ReshardOperationView.as_view(),
        name="reshard-operation",
    ),
]
