"""URLs of a node: the holder and inference-instance endpoints."""

from kvspsite.urls_common import urlpatterns as common

urlpatterns = [
    *common,
]
