from django.apps import AppConfig


class IndexConfig(AppConfig):
    name = "index"
    verbose_name = "Index Service"

    def ready(self):
        from index import metrics  # noqa: F401 -- registers the figures /metrics reads
