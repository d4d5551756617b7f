"""The OpenAPI description of both roles' API: request and response schemas in one table.

The views validate with the protocol core (``kvsp.records``), not with serializers, so
drf-spectacular cannot infer bodies; this module states them. ``describe`` is a
drf-spectacular postprocessing hook that puts each operation's request body and responses in
place from ``OPERATIONS``, declares the bearer scheme, and gives every error response the
problem-details schema. The schemas say what a valid message looks like; the core remains the
judge (a document can match the schema and still break a rule, such as overlapping ranges).
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension

JSON_TYPES = ("application/kvsp+json", "application/json")
BLOCK_TYPE = "application/kvsp-block"


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "kvspsite.api.BearerTokenAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _hex(octets: int) -> dict:
    return {"type": "string", "pattern": f"^[0-9a-f]{{{2 * octets}}}$"}


_URL = {"type": "string", "pattern": "^https?://[^/]+/.*/$", "maxLength": 2000}
_INT = {"type": "integer", "minimum": 0, "maximum": 9007199254740991}
_POSITIVE = {"type": "integer", "minimum": 1, "maximum": 9007199254740991}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": 4294967295}
_RANGE = {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}
# OpenAPI 3.0 spells an exclusive bound as a flag on the bound.
_POSITIVE_NUMBER = {"type": "number", "minimum": 0, "exclusiveMinimum": True}


def _object(properties: dict, required=(), **extra) -> dict:
    # A null optional member counts as absent (kvsp.records), so the schema admits null there.
    properties = {
        name: value if name in required or "$ref" in value else {**value, "nullable": True}
        for name, value in properties.items()
    }
    schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


SCHEMAS = {
    "Problem": _object(
        {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "instance": {"type": "string"},
        },
        ["type", "title", "status", "detail"],
    ),
    "CompatibilityDescriptor": _object(
        {
            "model": {"type": "string", "minLength": 1},
            "model_digest": {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"},
            "tokenizer_digest": {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"},
            "adapters": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"},
            },
            "layers": _POSITIVE,
            "kv_heads": _POSITIVE,
            "head_dim": _POSITIVE,
            "kv_dtype": {
                "type": "string",
                "enum": ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"],
            },
            "positional": {"type": "string"},
            "block_tokens": _POSITIVE,
            "layout": {"type": "string", "enum": ["kvsp-layout-1"]},
        },
        [
            "model",
            "model_digest",
            "tokenizer_digest",
            "layers",
            "kv_heads",
            "head_dim",
            "kv_dtype",
            "positional",
            "block_tokens",
            "layout",
        ],
    ),
    "ReplicaRecord": _object(
        {
            "block_key": _hex(32),
            "compat_id": _hex(32),
            "scope_id": _hex(16),
            "holder": {"type": "string", "maxLength": 2000},
            "codec": {"type": "integer", "minimum": 1, "maximum": 65535},
            "size": _INT,
            "digest": {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"},
            "layer_digests": {"type": "array", "items": _hex(32)},
            "residency": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "tier": {"type": "string"},
                        "layers": _RANGE,
                        "read_mbit_per_s": _POSITIVE_NUMBER,
                    },
                    ["tier", "layers"],
                ),
            },
            "ttl_ms": _POSITIVE,
            "moqt_namespace": {"type": "string"},
        },
        [
            "block_key",
            "compat_id",
            "scope_id",
            "holder",
            "codec",
            "size",
            "digest",
            "residency",
            "ttl_ms",
        ],
    ),
    "Replicas": _object(
        {"block_key": _hex(32), "replicas": {"type": "array", "items": _ref("ReplicaRecord")}},
        ["block_key", "replicas"],
    ),
    "LookupRequest": _object(
        {
            "scope_id": _hex(16),
            "compat_id": _hex(32),
            "block_keys": {"type": "array", "items": _hex(32)},
            "targets": {"type": "array", "items": _URL},
        },
        ["scope_id", "compat_id", "block_keys"],
    ),
    "LookupAnswer": _object(
        {
            "matched": _INT,
            "blocks": {"type": "array", "items": _ref("Replicas")},
            "estimates": {
                "type": "array",
                "items": _object(
                    {
                        "target": _URL,
                        "fetch_us": {"type": "number"},
                        "recompute_us": {"type": "number"},
                    },
                    ["target", "fetch_us", "recompute_us"],
                ),
            },
            "unpriced": {
                "type": "array",
                "items": _object(
                    {"target": _URL, "reason": {"type": "string"}}, ["target", "reason"]
                ),
            },
        },
        ["matched", "blocks"],
    ),
    "ScopeKey": _object(
        {"scope_id": _hex(16), "name": {"type": "string"}, "scope_key": {"type": "string"}},
        ["scope_id", "name", "scope_key"],
    ),
    "InstanceStatusRecord": _object(
        {
            "instance": _URL,
            "epoch": _INT,
            "state": {"type": "string", "enum": ["active", "draining", "sleeping", "failed"]},
            "running": _INT,
            "queued": _INT,
            "batch_size": _INT,
            "kv_utilization": {"type": "number", "minimum": 0, "maximum": 1},
            "prefill_tokens_per_s": _POSITIVE_NUMBER,
            "decode_tokens_per_s": _POSITIVE_NUMBER,
            "links": {
                "type": "array",
                "items": _object(
                    {
                        "holder": {"type": "string"},
                        "mbit_per_s": _POSITIVE_NUMBER,
                        "rtt_us": {"type": "number", "minimum": 0},
                    },
                    ["holder", "mbit_per_s", "rtt_us"],
                ),
            },
            "requested_state": {"type": "string", "enum": ["sleeping"], "nullable": True},
            "ttl_ms": _POSITIVE,
            "compat_ids": {"type": "array", "items": _hex(32)},
        },
        [
            "instance",
            "epoch",
            "state",
            "running",
            "queued",
            "batch_size",
            "kv_utilization",
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "links",
            "ttl_ms",
        ],
    ),
    "StateAnswer": _object(
        {"state": {"type": "string", "enum": ["active", "draining", "sleeping", "failed"]}},
        ["state"],
    ),
    "StateChange": _object(
        {"state": {"type": "string", "enum": ["active", "draining", "sleeping"]}}, ["state"]
    ),
    "Instance": _object(
        {
            "name": {"type": "string"},
            "url": _URL,
            "state": {"type": "string"},
            "epoch": {"type": "integer", "nullable": True},
        },
        ["name", "url", "state"],
    ),
    "Instances": _object(
        {"instances": {"type": "array", "items": _ref("Instance")}}, ["instances"]
    ),
    "PlacementRequest": _object(
        {
            "scope_id": _hex(16),
            "compat_id": _hex(32),
            "tokens": {"type": "array", "items": _TOKEN},
            "request_ref": {"type": "string", "maxLength": 400},
        },
        ["scope_id", "compat_id", "tokens"],
    ),
    "PlacementAnswer": _object(
        {
            "instance": _URL,
            "name": {"type": "string"},
            "matched": _INT,
            "directive": {"type": "string", "nullable": True},
            "woke": {"type": "boolean"},
            "candidates": {
                "type": "array",
                "items": _object(
                    {
                        "instance": _URL,
                        "name": {"type": "string"},
                        "state": {"type": "string"},
                        "wait_us": {"type": "number"},
                        "fetch_us": {"type": "number"},
                        "recompute_unmatched_us": {"type": "number"},
                        "recompute_all_us": {"type": "number"},
                        "cost_us": {"type": "number"},
                    },
                    ["instance", "name", "cost_us"],
                ),
            },
            "timings_us": {"type": "object"},
        },
        ["instance", "name", "matched", "directive", "candidates"],
    ),
    "SessionCheckpoint": _object(
        {
            "session": {"type": "string", "format": "uuid"},
            "epoch": _POSITIVE,
            "compat_id": _hex(32),
            "scope_id": _hex(16),
            "prompt_blocks": {"type": "array", "items": _hex(32)},
            "prompt_tail": {"type": "array", "items": _TOKEN},
            "generated": {"type": "array", "items": _TOKEN},
            "output_offset": _INT,
            "sampler": _object(
                {
                    "method": {"type": "string"},
                    "params": {"type": "object"},
                    "seed": _INT,
                    "step": _INT,
                    "deterministic": {"type": "boolean"},
                },
                ["method", "params", "seed", "step", "deterministic"],
            ),
        },
        [
            "session",
            "epoch",
            "compat_id",
            "scope_id",
            "prompt_blocks",
            "prompt_tail",
            "generated",
            "output_offset",
            "sampler",
        ],
    ),
    "CheckpointAnswer": _object(
        {"session": {"type": "string"}, "epoch": _INT, "output_offset": _INT},
        ["session", "epoch", "output_offset"],
    ),
    "OutputToken": _object(
        {"epoch": _INT, "index": _INT, "token": _TOKEN, "final": {"type": "boolean"}},
        ["epoch", "index", "token"],
    ),
    "OutputPost": {
        "oneOf": [
            _ref("OutputToken"),
            {"type": "array", "items": _ref("OutputToken"), "minItems": 1, "maxItems": 4096},
        ]
    },
    "OutputAnswer": _object(
        {
            "session": {"type": "string"},
            "epoch": _INT,
            "stored": {"type": "array", "items": _INT},
            "duplicates": {"type": "array", "items": _INT},
            "delivered": _INT,
        },
        ["session", "epoch", "stored", "duplicates", "delivered"],
    ),
    "Output": _object(
        {
            "session": {"type": "string"},
            "epoch": _INT,
            "state": {"type": "string"},
            "tokens": {"type": "array", "items": _ref("OutputToken")},
            "complete": {"type": "boolean"},
        },
        ["session", "epoch", "state", "tokens", "complete"],
    ),
    "Session": _object(
        {
            "session": {"type": "string"},
            "epoch": _INT,
            "state": {"type": "string"},
            "instance": {"type": "string", "nullable": True},
        },
        ["session", "epoch", "state"],
    ),
    "ShardMap": _object(
        {
            "map": {"type": "string", "pattern": "^[A-Za-z0-9._~-]{1,128}$"},
            "version": _INT,
            "shards": {
                "type": "array",
                "minItems": 1,
                "items": _object({"tokens": _RANGE, "instance": _URL}, ["tokens", "instance"]),
            },
        },
        ["map", "version", "shards"],
    ),
    "ReshardRequest": _object(
        {
            "shards": {
                "type": "array",
                "minItems": 1,
                "items": _object({"tokens": _RANGE, "instance": _URL}, ["tokens", "instance"]),
            },
            "deadline_ms": {"type": "integer", "minimum": 1, "maximum": 600000},
        },
        ["shards", "deadline_ms"],
    ),
    "ReshardOperation": _object(
        {
            "map": {"type": "string"},
            "from": _INT,
            "to": _INT,
            "state": {"type": "string", "enum": ["preparing", "committed", "aborted"]},
            "plans": {"type": "array", "items": {"type": "object"}},
            "acknowledged": {"type": "array", "items": _URL},
        },
        ["map", "from", "to", "state", "plans"],
    ),
}

# (path, method) -> (request schema or None, {status: response schema or None}).
# Error statuses besides those listed get problem details too (see ``describe``).
OPERATIONS = {
    ("/kvsp/compat/{compat_id}", "put"): (
        "CompatibilityDescriptor",
        {200: "CompatibilityDescriptor", 201: "CompatibilityDescriptor", 422: "Problem"},
    ),
    ("/kvsp/compat/{compat_id}", "get"): (None, {200: "CompatibilityDescriptor", 404: "Problem"}),
    ("/kvsp/replicas/{compat_id}/{scope_id}/{block_key}", "put"): (
        "ReplicaRecord",
        {200: "ReplicaRecord", 201: "ReplicaRecord", 403: "Problem", 422: "Problem"},
    ),
    ("/kvsp/replicas/{compat_id}/{scope_id}/{block_key}", "get"): (
        None,
        {200: "Replicas", 404: "Problem"},
    ),
    ("/kvsp/replicas/{compat_id}/{scope_id}/{block_key}", "delete"): (
        None,
        {204: None, 400: "Problem", 403: "Problem", 404: "Problem"},
    ),
    ("/kvsp/lookup", "post"): ("LookupRequest", {200: "LookupAnswer", 413: "Problem"}),
    ("/kvsp/scopes/{scope_id}/key", "get"): (None, {200: "ScopeKey", 404: "Problem"}),
    ("/kvsp/instances/", "get"): (None, {200: "Instances"}),
    ("/kvsp/instances/{name}", "get"): (None, {200: "Instance", 404: "Problem"}),
    ("/kvsp/instances/{name}/status", "put"): (
        "InstanceStatusRecord",
        {200: "StateAnswer", 403: "Problem", 404: "Problem", 409: "Problem"},
    ),
    ("/kvsp/instances/{name}/state", "put"): (
        "StateChange",
        {200: "Instance", 403: "Problem", 404: "Problem", 409: "Problem"},
    ),
    ("/kvsp/placements", "post"): (
        "PlacementRequest",
        {200: "PlacementAnswer", 404: "Problem", 503: "Problem"},
    ),
    ("/kvsp/sessions/{session}", "get"): (None, {200: "Session", 404: "Problem"}),
    ("/kvsp/sessions/{session}/checkpoint", "put"): (
        "SessionCheckpoint",
        {200: "CheckpointAnswer", 201: "CheckpointAnswer", 403: "Problem", 409: "Problem"},
    ),
    ("/kvsp/sessions/{session}/output", "post"): (
        "OutputPost",
        {200: "OutputAnswer", 403: "Problem", 404: "Problem", 409: "Problem"},
    ),
    ("/kvsp/sessions/{session}/output", "get"): (None, {200: "Output", 404: "Problem"}),
    ("/kvsp/shardmaps/{map_id}", "put"): (
        "ShardMap",
        {200: "ShardMap", 201: "ShardMap", 403: "Problem", 409: "Problem"},
    ),
    ("/kvsp/shardmaps/{map_id}", "get"): (None, {200: "ShardMap", 404: "Problem"}),
    ("/kvsp/shardmaps/{map_id}/reshard", "post"): (
        "ReshardRequest",
        {202: "ReshardOperation", 403: "Problem", 404: "Problem", 409: "Problem"},
    ),
    ("/kvsp/shardmaps/{map_id}/reshards/{to_version}", "get"): (
        None,
        {200: "ReshardOperation", 404: "Problem"},
    ),
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


def _json_content(schema: dict, media_types=JSON_TYPES) -> dict:
    return {media_type: {"schema": schema} for media_type in media_types}


def _problem_response(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": _ref("Problem")}},
    }


# Path parameters as the URL converters accept them, so that a client or a fuzzer sends ids
# of the right form (others never match a route: 404).
PATH_PARAMETERS = {
    "compat_id": _hex(32),
    "block_key": _hex(32),
    "scope_id": _hex(16),
    "session": {"type": "string", "format": "uuid"},
    "to_version": _INT,
}


def describe(result, generator, request, public):
    """drf-spectacular postprocessing hook: bodies, responses and security from the table."""
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
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter["name"] in PATH_PARAMETERS:
                    parameter["schema"] = PATH_PARAMETERS[parameter["name"]]
            request_schema, responses = OPERATIONS.get((path, method), (None, None))
            if request_schema is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": _json_content(_ref(request_schema)),
                }
            elif method in ("get", "delete"):
                operation.pop("requestBody", None)
            if responses is None:
                continue
            described = {}
            for status, schema in responses.items():
                if schema is None:
                    described[str(status)] = {"description": "no content"}
                elif schema == "Problem":
                    described[str(status)] = _problem_response("refused")
                else:
                    described[str(status)] = {
                        "description": "success",
                        "content": _json_content(_ref(schema)),
                    }
            for status, description in _COMMON_ERRORS.items():
                described.setdefault(str(status), _problem_response(description))
            operation["responses"] = described
            operation["security"] = [{"bearer": []}]
    return result
