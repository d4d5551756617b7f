from django.apps import AppConfig


class PlacementConfig(AppConfig):
    name = "placement"
    verbose_name = "Placement Controller"

    def ready(self):
        from index import authz
        from placement import metrics  # noqa: F401 -- registers the figures /metrics reads
        from placement.selectors import instance_urls

        # The index learns an instance's URLs from here, never by importing placement.
        authz.answer_instance_urls_with(instance_urls)
