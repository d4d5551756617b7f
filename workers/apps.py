from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Node"

    def ready(self):
        from workers import metrics  # noqa: F401 -- registers the figures /metrics reads
