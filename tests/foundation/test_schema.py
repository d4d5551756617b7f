import orjson
import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_openapi_schema_is_served_without_credentials():
    response = Client().get("/kvsp/schema", {"format": "json"})
    assert response.status_code == 200
    schema = orjson.loads(response.content)
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"].startswith("KVSP")
