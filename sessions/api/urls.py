from django.urls import path

from sessions.api import views

urlpatterns = [
    path("sessions/<str:session>", views.SessionView.as_view(), name="session"),
    path("sessions/<str:session>/checkpoint", views.CheckpointView.as_view(), name="checkpoint"),
    path("sessions/<str:session>/output", views.OutputView.as_view(), name="output"),
]
