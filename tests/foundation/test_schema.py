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


def test_node_schema_states_bodies_headers_and_problems():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator(urlconf="kvspsite.urls_node").get_schema(request=None, public=True)
    block = schema["paths"]["/kvsp/blocks/{compat_id}/{scope_id}/{block_key}"]
    assert list(block["put"]["requestBody"]["content"]) == ["application/kvsp-block"]
    headers = {p["name"]: p for p in block["put"]["parameters"] if p["in"] == "header"}
    assert headers["If-None-Match"]["required"]
    # Spec 6.7 requires Repr-Digest of what holders return; a client may leave it out (an
    # OpenAPI parameter without "required" is optional).
    assert not headers["Repr-Digest"].get("required", False)
    assert "application/kvsp-block" in block["get"]["responses"]["200"]["content"]
    for path, method in [
        ("/kvsp/leases", "post"),
        ("/kvsp/leases/{lease}", "put"),
        ("/kvsp/prefetch", "post"),
        ("/kvsp/state", "put"),
        ("/kvsp/generate", "post"),
        ("/kvsp/sessions/{session}/resume", "post"),
        ("/kvsp/reshard", "post"),
    ]:
        operation = schema["paths"][path][method]
        assert "application/kvsp+json" in operation["requestBody"]["content"], path
        assert "application/problem+json" in operation["responses"]["422"]["content"], path


def test_control_plane_schema_states_batch_publication():
    """``POST replicas`` and ``POST replicas/withdrawals``: the envelope is the request's
    schema; each item is judged on its own, so the answer lists an outcome, with its problem
    details, per item."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator(urlconf="kvspsite.urls_control").get_schema(request=None, public=True)
    for path, envelope in [
        ("/kvsp/replicas", "ReplicaBatch"),
        ("/kvsp/replicas/withdrawals", "ReplicaWithdrawalBatch"),
    ]:
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/kvsp+json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{envelope}"}
        for status in ("400", "413"):
            assert "application/problem+json" in operation["responses"][status]["content"]
        answer = operation["responses"]["200"]["content"]["application/kvsp+json"]["schema"]
        assert answer == {"$ref": "#/components/schemas/ReplicaBatchAnswer"}
    components = schema["components"]["schemas"]
    results = components["ReplicaBatchAnswer"]["properties"]["results"]
    assert results["items"] == {"$ref": "#/components/schemas/BatchResult"}
    result = components["BatchResult"]
    assert result["required"] == ["block_key", "holder", "status", "problem"]
    assert result["properties"]["problem"]["nullable"]


@pytest.mark.parametrize("urlconf", ["kvspsite.urls_control", "kvspsite.urls_node"])
def test_every_operation_states_its_body_and_its_answers(urlconf):
    # What a view method leaves unstated, drf-spectacular fills with an empty 200 ("No response
    # body"): each must state its contract with common.openapi.operation.
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator(urlconf=urlconf).get_schema(request=None, public=True)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            answers = {s: r for s, r in operation["responses"].items() if s.startswith("2")}
            assert answers, (path, method)
            for answer in answers.values():
                assert answer["description"] in ("success", "no content"), (path, method)
            if method in ("put", "post"):
                assert operation["requestBody"]["required"], (path, method)


def test_descriptor_schema_is_closed_and_requires_what_4_1_requires():
    """The Compatibility Descriptor refuses members 4.1 does not define and null in place of
    an absent member (kvsp.records.CompatibilityDescriptor); the schema generated from it says
    the same, so that a client written from the description cannot send either."""
    from drf_spectacular.generators import SchemaGenerator

    from kvsp.registries import ELEMENT_TYPES, LAYOUTS
    from tests.support.descriptors import SMALL_MODEL

    schema = SchemaGenerator(urlconf="kvspsite.urls_control").get_schema(request=None, public=True)
    put = schema["paths"]["/kvsp/compat/{compat_id}"]["put"]
    body = put["requestBody"]["content"]["application/kvsp+json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompatibilityDescriptor"}
    descriptor = schema["components"]["schemas"]["CompatibilityDescriptor"]
    assert descriptor["additionalProperties"] is False
    # The small model's descriptor has every required member, and only those.
    assert descriptor["required"] == list(SMALL_MODEL)
    members = descriptor["properties"]
    assert members["adapters"]["minItems"] == 1
    assert not any(member.get("nullable") for member in members.values())
    assert members["kv_dtype"]["enum"] == list(ELEMENT_TYPES)
    assert members["layout"]["enum"] == list(LAYOUTS)
    assert members["layers"]["maximum"] == members["block_tokens"]["maximum"] == 2**32 - 1
