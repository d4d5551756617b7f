from django.apps import AppConfig


class KvspSessionsConfig(AppConfig):
    # Django's own session framework already owns the label "sessions".
    name = "sessions"
    label = "kvsp_sessions"
    verbose_name = "Sessions"

    def ready(self):
        from sessions import metrics  # noqa: F401 -- registers the figures /metrics reads
