"""URLs of the operator dashboard, at the root of the control plane (the API is under /kvsp/)."""

from django.urls import path

from dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("instances/<str:name>", views.instance, name="instance"),
    path("instances/<str:name>/state", views.change_state, name="instance-state"),
    path("sessions/<str:session_id>", views.session, name="session"),
    path("holders/<int:holder_id>", views.holder, name="holder"),
    path("holders/<int:holder_id>/withdraw", views.withdraw_replicas, name="withdraw"),
    path("reshards/<int:operation_id>/abort", views.abort_reshard, name="abort-reshard"),
    path("live/", views.live_overview, name="live-overview"),
    path("live/instances/<str:name>", views.live_instance, name="live-instance"),
    path("live/sessions/<str:session_id>", views.live_session, name="live-session"),
    path("live/holders/<int:holder_id>", views.live_holder, name="live-holder"),
]
