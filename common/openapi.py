"""The OpenAPI description of both roles' API: the schemas of requests and responses, and how a
view states its contract (``operation``).

The views validate with the protocol core (``kvsp.records``), not with serializers, so
drf-spectacular cannot infer bodies. The schemas of the records, and of the answers declared
beside them as msgspec structs, are generated from their types (``RECORD_TYPES``), so the
description and the code share one definition; this module states the few others: problem
details (RFC 9457), the batch envelopes, whose items may be any value (each is judged as its
single request would be), and the one-or-many body of an output post. Each view method states
its request body, responses and parameters with ``operation`` (drf-spectacular's
``extend_schema``); ``describe``, a postprocessing hook, adds the schemas, the bearer scheme,
the links between operations, and problem details for every error status. Each role's URLconf
decides which of the operations its schema lists: the control plane's (DESIGN.md section 3,
"Control plane") or a node's ("Node"). The schemas say what a valid message looks like; the core
remains the judge (a document can match the schema and still break a rule, such as overlapping
ranges or a reshard plan whose ``to`` is not ``from + 1``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema

from kvsp.records import (
    MAX_DEADLINE_MS,
    MAX_OUTPUT_TOKENS_PER_POST,
    BlockBatchRequest,
    CheckpointAnswer,
    CompatibilityDescriptor,
    DeliveredOutput,
    DirectiveStatusRecord,
    GenerateRequest,
    InstanceAnswer,
    InstancesAnswer,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    LookupAnswer,
    LookupRequest,
    OutputAnswer,
    OutputToken,
    PlacementAnswer,
    PlacementRequest,
    PrefetchDirective,
    ReplicaBatchAnswer,
    ReplicaRecord,
    Replicas,
    ReshardAbort,
    ReshardCommit,
    ReshardMoveAnswer,
    ReshardOperationAnswer,
    ReshardPlan,
    ReshardRequest,
    ResumeRequest,
    ScopeKeyAnswer,
    SessionAdmitted,
    SessionAnswer,
    SessionCheckpoint,
    ShardMap,
    StateAnswer,
    StateChange,
    TokenGrant,
    TokenIntrospection,
    TokenIntrospectionRequest,
    TokenRequest,
)

JSON_TYPES = ("application/kvsp+json", "application/json")
BLOCK_TYPE = "application/kvsp-block"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _hex(octets: int) -> dict:
    return {"type": "string", "pattern": f"^[0-9a-f]{{{2 * octets}}}$"}


_INT = {"type": "integer", "minimum": 0, "maximum": 9007199254740991}
_ATTEMPT = {"type": "integer", "minimum": 1, "maximum": 4294967295}


# The records and answers whose schemas are generated from their types; the structs they nest
# come along.
RECORD_TYPES = (
    CompatibilityDescriptor,
    ReplicaRecord,
    LookupRequest,
    InstanceStatusRecord,
    PlacementRequest,
    BlockBatchRequest,
    LeaseRequest,
    LeaseRenewal,
    LeaseGrant,
    PrefetchDirective,
    DirectiveStatusRecord,
    SessionCheckpoint,
    GenerateRequest,
    ResumeRequest,
    TokenRequest,
    TokenGrant,
    TokenIntrospectionRequest,
    TokenIntrospection,
    StateChange,
    OutputToken,
    ShardMap,
    ReshardRequest,
    ReshardPlan,
    ReshardCommit,
    ReshardAbort,
    # Answers the views build.
    DeliveredOutput,
    ReplicaBatchAnswer,
    InstanceAnswer,
    InstancesAnswer,
    SessionAnswer,
    ReshardOperationAnswer,
    Replicas,
    LookupAnswer,
    PlacementAnswer,
    StateAnswer,
    ScopeKeyAnswer,
    CheckpointAnswer,
    OutputAnswer,
    SessionAdmitted,
    ReshardMoveAnswer,
)


def record_schemas(types: tuple[type, ...]) -> dict[str, dict]:
    """The component schemas of ``types`` (msgspec structs) and of the structs they nest."""
    _, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return {name: _openapi_30(schema) for name, schema in components.items()}


def _openapi_30(schema: Any) -> Any:
    """A JSON Schema as msgspec writes it (draft 2020-12) in the dialect of OpenAPI 3.0, which
    drf-spectacular describes: a null alternative becomes ``nullable`` (an optional member that
    is null counts as absent), an integer-or-number alternative a number, a numeric exclusive
    bound the 3.0 flag beside its bound, and a fixed-length tuple an array of its item type."""
    if isinstance(schema, list):
        return [_openapi_30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _openapi_30(member) for name, member in value.items()}
        elif key == "title" or (key == "default" and value is None):
            continue
        else:
            out[key] = _openapi_30(value)
    choices = out.pop("anyOf", None)
    if choices is not None:
        out = _without_null_choice(choices, out)
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = out.get(exclusive)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[bound], out[exclusive] = value, True
    prefix = out.pop("prefixItems", None)
    if prefix is not None:
        same = all(item == prefix[0] for item in prefix)
        out["items"] = prefix[0] if same else {"anyOf": prefix}
    return out


def _without_null_choice(choices: list[dict], schema: dict) -> dict:
    nullable = {"type": "null"} in choices
    choices = [choice for choice in choices if choice != {"type": "null"}]
    if {choice.get("type") for choice in choices} == {"integer", "number"}:
        choices = [choice for choice in choices if choice["type"] == "number"]
    if len(choices) != 1:
        schema["anyOf"] = choices
    elif "$ref" in choices[0]:
        schema["allOf"] = choices  # OpenAPI 3.0 ignores what stands beside a $ref
    else:
        schema = {**choices[0], **schema}
    return _nullable(schema) if nullable else schema


def _nullable(schema: dict) -> dict:
    # An enum lists every value allowed, null included, even beside "nullable".
    if "enum" in schema and None not in schema["enum"]:
        return {**schema, "nullable": True, "enum": [*schema["enum"], None]}
    return {**schema, "nullable": True}


def _object(properties: dict, required=(), **extra) -> dict:
    # A null optional member counts as absent (kvsp.records), so the schema admits null there.
    properties = {
        name: value if name in required or "$ref" in value else _nullable(value)
        for name, value in properties.items()
    }
    schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


_PROBLEM = _object(
    {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
    ["type", "title", "status", "detail"],
)

SCHEMAS = {
    "Problem": _PROBLEM,
    # Each item is judged on its own, as its single PUT or DELETE would judge it, and a refused
    # item is answered in its result: so any value is a valid item here, and only the envelope
    # is refused whole.
    "ReplicaBatch": _object(
        {"records": {"type": "array", "items": {"description": "a ReplicaRecord"}}},
        ["records"],
    ),
    "ReplicaWithdrawalBatch": _object(
        {
            "replicas": {
                "type": "array",
                "items": {"description": "{compat_id, scope_id, block_key, holder}"},
            }
        },
        ["replicas"],
    ),
    # One output token, or an array of them.
    "OutputPost": {
        "oneOf": [
            _ref("OutputToken"),
            {
                "type": "array",
                "items": _ref("OutputToken"),
                "minItems": 1,
                "maxItems": MAX_OUTPUT_TOKENS_PER_POST,
            },
        ]
    },
}

_SEGMENT = {"type": "string", "pattern": "^[A-Za-z0-9._~-]{1,128}$"}
_BINARY = {"type": "string", "format": "binary"}

# The node's messages (DESIGN.md section 3, "Node") that are not records.
SCHEMAS.update(
    {
        "BlockContainer": {
            **_BINARY,
            "description": "a KV Block Container (spec 4.3) holding every layer from layer 0",
        },
        # One part per block asked for, in order: the container (Content-Type
        # application/kvsp-block, Content-Length, Repr-Digest) or the block's problem details;
        # each part names its block resource in Content-Location (docs/api.md "Blocks in batches").
        "BlockBatch": _BINARY,
        # A body with "commit" is a commit and one with "abort" an abort; any other a plan.
        "ReshardBody": {
            "anyOf": [_ref("ReshardPlan"), _ref("ReshardCommit"), _ref("ReshardAbort")]
        },
    }
)

SCHEMAS.update(record_schemas(RECORD_TYPES))

# What this implementation's PC adds to the reshard messages it sends, and the node reads beyond
# the records (workers.resharding): a plan carries the Block Keys its ranges cover (scope_id,
# compat_id, block_tokens and blocks, an object from block indexes in decimal to Block Keys)
# and a deadline the node bounds; a plan, its commit and its abort carry the number of the PC's
# attempt at the move.
_ATTEMPT_MEMBER = {"attempt": {**_ATTEMPT, "nullable": True}}
SCHEMAS["ReshardPlan"]["properties"]["deadline_ms"]["maximum"] = MAX_DEADLINE_MS
SCHEMAS["ReshardPlan"]["properties"].update(
    {
        "scope_id": _nullable(_hex(16)),
        "compat_id": _nullable(_hex(32)),
        "block_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": 4294967295}),
        "blocks": _nullable(
            {"type": "object", "additionalProperties": _hex(32), "maxProperties": 131072}
        ),
        **_ATTEMPT_MEMBER,
    }
)
SCHEMAS["ReshardCommit"]["properties"].update(_ATTEMPT_MEMBER)
SCHEMAS["ReshardAbort"]["properties"].update(_ATTEMPT_MEMBER)

# Bodies that are not JSON, by schema name.
MEDIA_TYPES = {"BlockContainer": (BLOCK_TYPE,), "BlockBatch": ("multipart/mixed",)}
PROBLEM = "Problem"
PROBLEM_TYPE = "application/problem+json"


def _schema_name(schema: str | type) -> str:
    return schema if isinstance(schema, str) else schema.__name__


def operation(request=None, responses=None, *, parameters=()):
    """A view method's contract, stated on the method that serves it (drf-spectacular's
    ``extend_schema``): its request body and its responses by status, each a record type or a
    schema of ``SCHEMAS`` by name, ``PROBLEM`` for problem details, None for no content; its
    header and query ``parameters``, and its response headers (``OpenApiParameter`` with
    ``response=[status]``). ``describe`` adds problem details for the error statuses a method
    does not list."""
    described = {}
    for status, schema in (responses or {}).items():
        if schema is None:
            described[status] = OpenApiResponse(description="no content")
        elif schema == PROBLEM:
            described[(status, PROBLEM_TYPE)] = OpenApiResponse(
                _ref(PROBLEM), description="refused"
            )
        else:
            name = _schema_name(schema)
            media_types = MEDIA_TYPES.get(name, JSON_TYPES)
            described[(status, *media_types)] = OpenApiResponse(_ref(name), description="success")
    contract = {"responses": described, "parameters": list(parameters)}
    if request is not None:
        name = _schema_name(request)
        contract["request"] = {media: _ref(name) for media in MEDIA_TYPES.get(name, JSON_TYPES)}
    return extend_schema(**contract)


_REPR_DIGEST = {"type": "string", "pattern": "^sha-256=:[A-Za-z0-9+/]{43}=:$"}

# Header and query parameters of the block resource (6.7), which the views read themselves.
LAYERS_QUERY = OpenApiParameter(
    "layers",
    {"type": "string", "pattern": "^[0-9]{1,10}-[0-9]{1,10}$"},
    OpenApiParameter.QUERY,
    description="the inclusive layer range a-b (a <= b)",
)
CODEC_QUERY = OpenApiParameter(
    "codec",
    {"type": "string", "pattern": "^[0-9]{1,5}$"},
    OpenApiParameter.QUERY,
    description="the codec asked for; this holder does not transcode (406)",
)
REPR_DIGEST_HEADER = OpenApiParameter(
    "Repr-Digest",
    _REPR_DIGEST,
    OpenApiParameter.HEADER,
    description="RFC 9530: the SHA-256 of the body, checked when present (422 when it differs); "
    "without it the body is checked as a KV Block Container only",
)
# Required by this holder: without it the answer is 428 (a holder never replaces a replica, so
# the client must say it expects none).
IF_NONE_MATCH_HEADER = OpenApiParameter(
    "If-None-Match",
    {"type": "string", "enum": ["*"]},
    OpenApiParameter.HEADER,
    required=True,
    description="'*': store only where this holder has no replica of the key (else 412)",
)


def response_header(name: str, schema: dict, *statuses: int) -> OpenApiParameter:
    return OpenApiParameter(
        name, schema, OpenApiParameter.HEADER, required=True, response=list(statuses)
    )


def location_header(*statuses: int) -> OpenApiParameter:
    """Where the resource a request created is (201, or 202 for one still being made)."""
    return response_header("Location", {"type": "string"}, *statuses)


BLOCK_RESPONSE_HEADERS = (
    response_header("Repr-Digest", _REPR_DIGEST, 200),
    response_header("Cache-Control", {"type": "string"}, 200),
)


def _operation_ref(path: str, method: str) -> str:
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


# Links from a created resource to the operations on it (OpenAPI 3.0 "links").
LINKS = {
    ("/kvsp/leases", "post", 201): {
        "RenewLease": {
            "operationRef": _operation_ref("/kvsp/leases/{lease}", "put"),
            "parameters": {"lease": "$response.body#/lease"},
        },
        "ReleaseLease": {
            "operationRef": _operation_ref("/kvsp/leases/{lease}", "delete"),
            "parameters": {"lease": "$response.body#/lease"},
        },
    },
    ("/kvsp/prefetch", "post", 202): {
        "GetDirective": {
            "operationRef": _operation_ref("/kvsp/prefetch/{directive}", "get"),
            "parameters": {"directive": "$response.body#/directive"},
        },
    },
}

_COMMON_ERRORS = {
    400: "the request is malformed",
    401: "no valid bearer token",
    403: "not allowed for this principal",
    404: "no such resource (or one the principal may not see)",
    406: "no acceptable representation",
    413: "the request is too large",
    415: "unsupported media type",
    422: "the message breaks a rule of the protocol",
    429: "too many requests",
}


def _problem_response(description: str) -> dict:
    return {"description": description, "content": {PROBLEM_TYPE: {"schema": _ref(PROBLEM)}}}


# Path parameters as the URL converters accept them, so that a client or a fuzzer sends ids
# of the right form (others never match a route: 404).
PATH_PARAMETERS = {
    "compat_id": _hex(32),
    "block_key": _hex(32),
    "scope_id": _hex(16),
    "session": {"type": "string", "format": "uuid"},
    "to_version": _INT,
    "directive": {"type": "string", "format": "uuid"},
    "lease": _SEGMENT,
}


def describe(result, generator, request, public):
    """drf-spectacular postprocessing hook: the schemas, the bearer scheme, path parameters as
    the converters accept them, links, and problem details for every error status an operation
    (``operation``) does not list."""
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update(SCHEMAS)
    components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if method not in ("get", "put", "post", "delete"):
                continue
            # DRF's ?format= override is not part of this API: content negotiation is by Accept.
            operation["parameters"] = [
                p for p in operation.get("parameters", []) if p.get("name") != "format"
            ]
            for parameter in operation["parameters"]:
                if parameter.get("in") == "path" and parameter["name"] in PATH_PARAMETERS:
                    parameter["schema"] = PATH_PARAMETERS[parameter["name"]]
            if "requestBody" in operation:
                operation["requestBody"]["required"] = True
            responses = operation.setdefault("responses", {})
            for status, response in responses.items():
                links = LINKS.get((path, method, int(status)))
                if links:
                    response["links"] = links
            for status, description in _COMMON_ERRORS.items():
                responses.setdefault(str(status), _problem_response(description))
            operation["security"] = [{"bearer": []}]
    return result
