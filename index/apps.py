from django.apps import AppConfig


class IndexConfig(AppConfig):
    name = "index"
    verbose_name = "Index Service"
