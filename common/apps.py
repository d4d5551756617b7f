from django.apps import AppConfig


class CommonConfig(AppConfig):
    name = "common"
    verbose_name = "Shared"

    def ready(self):
        from common import metrics

        metrics.connect_tally()
