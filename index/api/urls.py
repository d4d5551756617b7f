from django.urls import path

import common.converters  # noqa: F401 - registers hex16 and hex32
from index.api import views

urlpatterns = [
    path(
        "replicas/<hex32:compat_id>/<hex16:scope_id>/<hex32:block_key>",
        views.ReplicaView.as_view(),
        name="replica",
    ),
    path("replicas", views.ReplicaBatchView.as_view(), name="replicas"),
    path(
        "replicas/withdrawals",
        views.ReplicaWithdrawalBatchView.as_view(),
        name="replica-withdrawals",
    ),
    path("compat/<hex32:compat_id>", views.CompatView.as_view(), name="compat"),
    path("scopes/<hex16:scope_id>/key", views.ScopeKeyView.as_view(), name="scope-key"),
    path("tokens", views.TokenView.as_view(), name="tokens"),
    path("tokens/introspect", views.TokenIntrospectionView.as_view(), name="token-introspection"),
]
