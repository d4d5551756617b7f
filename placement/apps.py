from django.apps import AppConfig


class PlacementConfig(AppConfig):
    name = "placement"
    verbose_name = "Placement Controller"

    def ready(self):
        from placement import metrics  # noqa: F401 -- registers the figures /metrics reads
