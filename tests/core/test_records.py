"""Tests for kvsp.records: the JSON records of spec 4.4, 6.2, 6.4-6.6 and 6.9."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import msgspec
import msgspec.structs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp.container import replica_digest
from kvsp.problems import ProtocolError
from kvsp.records import (
    DEFAULT_LIMITS,
    MAX_DEADLINE_MS,
    MAX_OUTPUT_TOKENS_PER_POST,
    MAX_SAFE_INTEGER,
    UINT32_MAX,
    UINT64_MAX,
    DirectiveBlock,
    DirectiveStatusRecord,
    FetchRange,
    GenerateRequest,
    InstanceStatusRecord,
    InvalidRecord,
    JsonObject,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    Limits,
    Link,
    LookupRequest,
    OutputToken,
    PlacementRequest,
    PrefetchDirective,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    ReshardRequest,
    ResidencyEntry,
    ResumeRequest,
    Sampler,
    SessionCheckpoint,
    Shard,
    ShardMap,
    StateChange,
    encode_moqt_namespace,
    parse_moqt_namespace,
    parse_output_post,
    parse_reshard_body,
)

K1, K2, K3 = "a1" * 32, "b2" * 32, "c3" * 32
COMPAT = "0f" * 32
SCOPE = "5e" * 16
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
II7 = "https://ii7.example/kvsp/"
SESSION = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"
DIRECTIVE = "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10"
LAYER_DIGESTS = [hashlib.sha256(bytes([layer])).hexdigest() for layer in range(32)]
DIGEST = replica_digest(bytes.fromhex(d) for d in LAYER_DIGESTS)
NAMESPACE = encode_moqt_namespace((b"kvsp", b"1", COMPAT.encode()[:8], b"s", b"k"))

DELETE = object()


# --- The spec's examples, completed with real values ------------------------------------------


def replica_doc() -> dict:
    return {
        "block_key": K1,
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "holder": H1,
        "codec": 1,
        "size": 2097152,
        "digest": DIGEST,
        "layer_digests": list(LAYER_DIGESTS),
        "residency": [
            {"tier": "device", "layers": [0, 15]},
            {"tier": "host", "layers": [16, 31], "read_mbit_per_s": 400000},
        ],
        "ttl_ms": 600000,
    }


def status_doc() -> dict:
    return {
        "instance": II7,
        "epoch": 12,
        "state": "active",
        "running": 18,
        "queued": 3,
        "batch_size": 32,
        "kv_utilization": 0.71,
        "prefill_tokens_per_s": 42000,
        "decode_tokens_per_s": 3100,
        "links": [{"holder": H1, "mbit_per_s": 200000, "rtt_us": 12}],
        "requested_state": None,
        "ttl_ms": 3000,
    }


def checkpoint_doc() -> dict:
    return {
        "session": SESSION,
        "epoch": 1,
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "prompt_blocks": [K1, K2],
        "prompt_tail": [374, 264],
        "generated": [1296, 315, 279],
        "output_offset": 3,
        "sampler": {
            "method": "top-p",
            "params": {"p": 0.9},
            "seed": 7,
            "step": 3,
            "deterministic": False,
        },
    }


def directive_doc() -> dict:
    return {
        "directive": DIRECTIVE,
        "request_ref": "opaque-value-from-PC",
        "scope_id": SCOPE,
        "compat_id": COMPAT,
        "blocks": [{"block_key": K1, "sources": [H1]}],
        "layer_order": "ascending",
        "deadline_ms": 50,
        "lease_ms": 2000,
    }


def directive_status_doc() -> dict:
    return {"directive": DIRECTIVE, "state": "partial", "loaded": [K1], "reason": "deadline"}


def lease_request_doc() -> dict:
    return {"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": [K1, K2], "ttl_ms": 2000}


def lease_grant_doc() -> dict:
    return {
        "lease": "l-0001",
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "block_keys": [K1],
        "ttl_ms": 2000,
        "expires_ms": 1_700_000_002_000,
    }


def shard_map_doc() -> dict:
    return {
        "map": "c3f8...e1",
        "version": 4,
        "shards": [
            {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
            {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"},
            {"tokens": [65536, 98304], "instance": "https://ii3.example/kvsp/"},
        ],
    }


def plan_doc() -> dict:
    return {
        "map": "c3f8...e1",
        "from": 4,
        "to": 5,
        "deadline_ms": 200,
        "retain": [[0, 32768]],
        "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}],
        "release": [],
    }


def lookup_doc() -> dict:
    return {
        "scope_id": SCOPE,
        "compat_id": COMPAT,
        "block_keys": [K1, K2, K3],
        "targets": [II7, "https://ii9.example/kvsp/"],
    }


def placement_doc() -> dict:
    return {"scope_id": SCOPE, "compat_id": COMPAT, "tokens": [1, 2, 3], "request_ref": "r-1"}


DOCS = {
    ReplicaRecord: replica_doc,
    InstanceStatusRecord: status_doc,
    SessionCheckpoint: checkpoint_doc,
    PrefetchDirective: directive_doc,
    DirectiveStatusRecord: directive_status_doc,
    LeaseRequest: lease_request_doc,
    LeaseRenewal: lambda: {"ttl_ms": 5000},
    LeaseGrant: lease_grant_doc,
    ShardMap: shard_map_doc,
    ReshardPlan: plan_doc,
    ReshardCommit: lambda: {"map": "c3f8...e1", "commit": 5},
    ReshardAbort: lambda: {"map": "c3f8...e1", "abort": 5},
    ReshardRequest: lambda: {"shards": shard_map_doc()["shards"], "deadline_ms": 30000},
    StateChange: lambda: {"state": "draining"},
    OutputToken: lambda: {"epoch": 2, "index": 17, "token": 4099},
    LookupRequest: lookup_doc,
    PlacementRequest: placement_doc,
}


def edited(doc: dict, path: tuple, value: object) -> dict:
    """A deep copy of ``doc`` with the member at ``path`` replaced (or removed, for DELETE)."""
    out = copy.deepcopy(doc)
    target = out
    for segment in path[:-1]:
        target = target[segment]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


def rejects(cls, doc: object, detail: str, limits: Limits = DEFAULT_LIMITS) -> InvalidRecord:
    with pytest.raises(ProtocolError) as caught:
        cls.from_json(doc, limits)
    error = caught.value
    assert isinstance(error, InvalidRecord)
    assert error.problem == "kvsp-invalid-record"
    assert error.status == 422
    assert detail in error.detail, error.detail
    return error


# --- The examples are accepted and reproduced -------------------------------------------------


@pytest.mark.parametrize("cls", list(DOCS), ids=lambda c: c.__name__)
def test_example_round_trips_exactly(cls):
    doc = DOCS[cls]()
    record = cls.from_json(doc)
    assert record.to_json() == doc
    assert cls.from_json(record.to_json()) == record
    hash(record)  # frozen records of tuples are hashable: they can key a dict


@pytest.mark.parametrize("cls", list(DOCS), ids=lambda c: c.__name__)
def test_unknown_members_are_ignored(cls):
    doc = DOCS[cls]()
    noisy = dict(doc, x_vendor={"nested": [1, 2]}, another=None)
    assert cls.from_json(noisy) == cls.from_json(doc)
    assert cls.from_json(noisy).to_json() == doc


@pytest.mark.parametrize(
    ("cls", "path"),
    [
        (ReplicaRecord, ("residency", 1)),
        (InstanceStatusRecord, ("links", 0)),
        (SessionCheckpoint, ("sampler",)),
        (PrefetchDirective, ("blocks", 0)),
        (ShardMap, ("shards", 2)),
        (ReshardPlan, ("fetch", 0)),
    ],
)
def test_unknown_members_of_nested_objects_are_ignored(cls, path):
    doc = DOCS[cls]()
    noisy = edited(doc, (*path, "x_vendor"), {"anything": [None]})
    assert cls.from_json(noisy) == cls.from_json(doc)
    assert cls.from_json(noisy).to_json() == doc


@pytest.mark.parametrize("cls", list(DOCS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [None, [], "x", 1, 1.5, True])
def test_a_record_must_be_an_object(cls, value):
    rejects(cls, value, "must be a JSON object")


@pytest.mark.parametrize("cls", list(DOCS), ids=lambda c: c.__name__)
def test_every_member_of_the_example_is_required_unless_optional(cls):
    optional = {"layer_digests", "requested_state", "request_ref", "layer_order", "targets"}
    optional |= {"reason"}
    for name in DOCS[cls]():
        doc = edited(DOCS[cls](), (name,), DELETE)
        if name in optional:
            cls.from_json(doc)
        else:
            rejects(cls, doc, f"{name}: required member is missing")


def test_records_are_frozen_and_validated_when_built_in_code():
    record = ReplicaRecord.from_json(replica_doc())
    with pytest.raises(AttributeError):
        record.size = 1
    assert ReplicaRecord(**_fields(record)) == record
    # A Replica Record built in code keeps every rule that spans members or values (its
    # members' bounds are the types', checked as a record is decoded).
    with pytest.raises(InvalidRecord, match="layer_digests: do not reproduce digest"):
        ReplicaRecord(**{**_fields(record), "digest": "sha-256:" + "a" * 64})
    with pytest.raises(InvalidRecord, match="block_key: must be hex32"):
        ReplicaRecord(**{**_fields(record), "block_key": K1.upper()})
    with pytest.raises(InvalidRecord, match="holder: must be an http, https or moqt URL"):
        ReplicaRecord(**{**_fields(record), "holder": "ftp://h1.example/kvsp/"})
    with pytest.raises(InvalidRecord, match="residency: must be an array"):
        ReplicaRecord(**{**_fields(record), "residency": list(record.residency)})
    with pytest.raises(InvalidRecord, match=r"residency\[0\]: must be a residency entry"):
        ReplicaRecord(**{**_fields(record), "residency": ({"tier": "host", "layers": [0, 1]},)})
    with pytest.raises(InvalidRecord, match="layers: the first layer must not be after the last"):
        ResidencyEntry("host", (3, 1))
    with pytest.raises(InvalidRecord, match="codec: must be an integer from 1 to 65535"):
        ReplicaRecord.from_json(ReplicaRecord(**{**_fields(record), "codec": 0}).to_json())


def _fields(record) -> dict:
    if isinstance(record, msgspec.Struct):
        return msgspec.structs.asdict(record)
    return {field.name: getattr(record, field.name) for field in dataclasses.fields(record)}


# --- Replica Record (4.4) ---------------------------------------------------------------------

REPLICA_REJECTS = [
    (("block_key",), K1.upper(), "block_key: must be hex32: 64 lowercase hex digits"),
    (("block_key",), K1[:-2], "block_key: must be hex32"),
    (("block_key",), 5, "block_key: must be hex32"),
    (("compat_id",), "zz" * 32, "compat_id: must be hex32"),
    (("scope_id",), K1, "scope_id: must be hex16: 32 lowercase hex digits"),
    (("holder",), "ftp://h1.example/kvsp/", "holder: must be an http, https or moqt URL"),
    (("holder",), "https://h1.example/kvsp", 'holder: must end with "/"'),
    (("holder",), "https://h1.example", 'holder: must end with "/"'),
    (("holder",), "https://user:pw@h1.example/", "holder: must not carry user information"),
    (("holder",), "https://h1.example/?a=1", "holder: must not have a query or a fragment"),
    (("holder",), "https://h1.example/#top", "holder: must not have a query or a fragment"),
    (("holder",), "/kvsp/", "holder: must be an absolute URL"),
    (("holder",), "HTTPS://h1.example/", "holder: must be an absolute URL with a lowercase"),
    (("holder",), "https:///kvsp/", "holder: must name a host"),
    (("holder",), "https://h1.example:99999/", "holder: is not a valid URL"),
    (("holder",), "https://[::1/", "holder: is not a valid URL"),
    (("holder",), "https://h1.example/a b/", "holder: must be ASCII without spaces"),
    (("holder",), "https://hé.example/", "holder: must be ASCII"),
    (
        ("holder",),
        'https://h1.example/"><svg/onload=alert(1)>/',
        "holder: must have only the characters RFC 3986 allows",
    ),
    (
        ("holder",),
        "https://h1.example/a%zz/",
        "holder: must have only the characters RFC 3986 allows",
    ),
    (
        ("holder",),
        "https://h1.example/{x}/",
        "holder: must have only the characters RFC 3986 allows",
    ),
    (("holder",), "https://h1.example/" + "a/" * 1100, "holder: must be at most 2048"),
    (("holder",), ["https://h1.example/"], "holder: must be a URL string"),
    (("codec",), 0, "codec: must be an integer from 1 to 65535"),
    (("codec",), 65536, "codec: must be an integer from 1 to 65535"),
    (("codec",), 1.0, "codec: must be an integer"),
    (("codec",), True, "codec: must be an integer"),
    (("codec",), "1", "codec: must be an integer"),
    (("size",), -1, "size: must be an integer from 0"),
    (("size",), MAX_SAFE_INTEGER + 1, "size: must be an integer from 0 to 9007199254740991"),
    (("digest",), "sha256:" + "0" * 64, 'digest: must be "sha-256:"'),
    (("digest",), DIGEST.upper(), 'digest: must be "sha-256:"'),
    (("digest",), "sha-256:" + "a" * 64, "layer_digests: do not reproduce digest"),
    (("layer_digests",), [], "layer_digests: must be a non-empty array"),
    (("layer_digests",), "abc", "layer_digests: must be a non-empty array"),
    (("layer_digests", 1), "x", "layer_digests[1]: must be hex32"),
    (("layer_digests", 0), LAYER_DIGESTS[1], "layer_digests: do not reproduce digest"),
    (("residency",), [], "residency: must be a non-empty array"),
    (("residency",), {"tier": "host"}, "residency: must be a non-empty array"),
    (("residency", 0), "device", "residency[0]: must be a JSON object"),
    (("residency", 0, "tier"), "Device", "residency[0].tier: must be a lowercase tier name"),
    (("residency", 0, "tier"), "", "residency[0].tier: must be a lowercase tier name"),
    (("residency", 0, "tier"), 1, "residency[0].tier: must be a lowercase tier name"),
    (("residency", 0, "tier"), DELETE, "residency[0].tier: required member is missing"),
    (("residency", 0, "layers"), [3, 2], "residency[0].layers: the first layer must not be"),
    (("residency", 0, "layers"), [0], "residency[0].layers: must be [first, last]"),
    (("residency", 0, "layers"), [0, 1, 2], "residency[0].layers: must be [first, last]"),
    (("residency", 0, "layers"), [-1, 2], "residency[0].layers[0]: must be an integer from 0"),
    (("residency", 0, "layers"), [0, 2**32], "residency[0].layers[1]: must be an integer"),
    (("residency", 0, "layers"), [0, "15"], "residency[0].layers[1]: must be an integer"),
    (
        ("residency", 1, "read_mbit_per_s"),
        0,
        "residency[1].read_mbit_per_s: must be a number greater than 0",
    ),
    (
        ("residency", 1, "read_mbit_per_s"),
        -5.5,
        "residency[1].read_mbit_per_s: must be a number greater than 0",
    ),
    (("residency", 1, "read_mbit_per_s"), "fast", "residency[1].read_mbit_per_s: must be a num"),
    (
        ("residency", 1, "read_mbit_per_s"),
        float("nan"),
        "read_mbit_per_s: must be a number greater than 0",
    ),
    (
        ("residency", 1, "read_mbit_per_s"),
        float("inf"),
        "read_mbit_per_s: must be a number greater than 0",
    ),
    (
        ("residency", 1, "read_mbit_per_s"),
        2**60,
        "read_mbit_per_s: must be a number greater than 0 and at most",
    ),
    (("residency", 1, "layers"), [15, 31], "residency[1].layers: overlaps residency[0].layers"),
    (("residency", 1, "layers"), [0, 3], "residency[1].layers: overlaps residency[0].layers"),
    (("residency", 1, "layers"), [16, 32], "residency[1].layers: layer 32 is beyond the 32"),
    (("ttl_ms",), 0, "ttl_ms: must be an integer from 1"),
    (("ttl_ms",), None, "ttl_ms: must be an integer"),
    (
        ("moqt_namespace",),
        NAMESPACE,
        "moqt_namespace: is only allowed when the holder is a moqt URI",
    ),
]


@pytest.mark.parametrize(("path", "value", "detail"), REPLICA_REJECTS)
def test_replica_record_rejects(path, value, detail):
    rejects(ReplicaRecord, edited(replica_doc(), path, value), detail)


def test_replica_overlap_is_reported_at_the_later_entry_in_any_order():
    doc = replica_doc()
    del doc["layer_digests"]
    doc["digest"] = "sha-256:" + "00" * 32
    doc["residency"] = [
        {"tier": "disk", "layers": [40, 50]},
        {"tier": "device", "layers": [0, 9]},
        {"tier": "host", "layers": [10, 19]},
        {"tier": "disk", "layers": [45, 60]},
    ]
    rejects(ReplicaRecord, doc, "residency[3].layers: overlaps residency[0].layers")


def test_replica_accepts_what_the_spec_allows():
    doc = replica_doc()
    # layer_digests is optional in general; then any residency ranges are fine.
    del doc["layer_digests"]
    doc["residency"] = [{"tier": "disk", "layers": [100, 200], "read_mbit_per_s": 1.5}]
    record = ReplicaRecord.from_json(doc)
    assert record.layer_count is None
    assert not record.servable_by_layer_range
    # A tier this implementation does not store in is still a tier name.
    ReplicaRecord.from_json(edited(replica_doc(), ("residency", 0, "tier"), "cxl-2"))
    # Residency need not cover every layer; size zero is a size.
    partial = edited(replica_doc(), ("residency",), [{"tier": "device", "layers": [0, 7]}])
    ReplicaRecord.from_json(edited(partial, ("size",), 0))
    # Adjacent inclusive ranges do not overlap; null optional members are absent.
    doc = edited(replica_doc(), ("residency", 1, "read_mbit_per_s"), None)
    assert ReplicaRecord.from_json(doc).residency[1].read_mbit_per_s is None
    assert "read_mbit_per_s" not in ReplicaRecord.from_json(doc).to_json()["residency"][1]
    assert (
        ReplicaRecord.from_json(edited(replica_doc(), ("layer_digests",), None)).layer_count is None
    )


def test_replica_helpers():
    record = ReplicaRecord.from_json(replica_doc())
    assert record.block_key_bytes == bytes.fromhex(K1)
    assert record.compat_id_bytes == bytes.fromhex(COMPAT)
    assert record.scope_id_bytes == bytes.fromhex(SCOPE)
    assert record.digest_bytes == bytes.fromhex(DIGEST[8:])
    assert record.layer_digest_bytes[3] == bytes.fromhex(LAYER_DIGESTS[3])
    assert record.layer_count == 32
    assert record.servable_by_layer_range
    assert record.identity == (COMPAT, SCOPE, K1, H1)
    assert record.residency[0].layer_count == 16
    assert record.layer_range_digests(14, 17) == tuple(LAYER_DIGESTS[14:18])
    assert record.holds_layers(0, 31) and record.holds_layers(16, 16)
    assert record.with_ttl(5).ttl_ms == 5 and record.with_ttl(5).digest == record.digest
    with pytest.raises(InvalidRecord):
        record.with_ttl(0)


def test_layer_ranges_a_replica_cannot_serve():
    doc = edited(replica_doc(), ("residency",), [{"tier": "device", "layers": [0, 7]}])
    record = ReplicaRecord.from_json(doc)
    assert not record.holds_layers(6, 9)
    with pytest.raises(ProtocolError) as caught:
        record.layer_range_digests(6, 9)
    assert caught.value.problem == "kvsp-layers-unavailable"
    with pytest.raises(ProtocolError) as caught:
        record.layer_range_digests(0, 40)
    assert caught.value.problem == "kvsp-layers-unavailable"
    without = ReplicaRecord.from_json(edited(replica_doc(), ("layer_digests",), DELETE))
    with pytest.raises(ProtocolError) as caught:
        without.layer_range_digests(0, 0)
    assert caught.value.problem == "kvsp-layers-unavailable"


def test_moqt_holder():
    doc = edited(replica_doc(), ("holder",), "moqt://relay.example:4433/kvsp")
    rejects(ReplicaRecord, doc, "moqt_namespace: is required when the holder is a moqt URI")
    record = ReplicaRecord.from_json(dict(doc, moqt_namespace=NAMESPACE))
    assert record.moqt_namespace_fields == (b"kvsp", b"1", COMPAT.encode()[:8], b"s", b"k")
    assert record.to_json()["moqt_namespace"] == NAMESPACE
    four = encode_moqt_namespace((b"a", b"b", b"c", b"d", b"e"))[:-2]
    for bad in [NAMESPACE + "=", "a", four, NAMESPACE + "+", "", 7]:
        rejects(ReplicaRecord, dict(doc, moqt_namespace=bad), "moqt_namespace: must be unpadded")
    # Five empty fields are five zero octets.
    assert encode_moqt_namespace((b"",) * 5) == "AAAAAAA"
    assert parse_moqt_namespace("AAAAAAA") == (b"",) * 5
    assert parse_moqt_namespace("AAAAAAAA") is None  # six fields
    assert parse_moqt_namespace("AAAABQ") is None  # the fifth field claims 5 octets it lacks
    with pytest.raises(ValueError):
        encode_moqt_namespace((b"x",) * 4)


def test_moqt_namespace_rejects_non_canonical_base64():
    # Five octets take seven characters, whose last two bits are unused and must be zero.
    canonical = encode_moqt_namespace((b"", b"", b"", b"", b""))
    assert canonical == "AAAAAAA"
    assert parse_moqt_namespace(canonical) == (b"",) * 5
    # "B" sets only the unused bits: the same octets, spelt another way.
    assert parse_moqt_namespace("AAAAAAB") is None


def test_array_limits_are_checked_before_entries():
    limits = Limits(max_layers=4)
    rejects(ReplicaRecord, replica_doc(), "layer_digests: has 32 entries; at most 4", limits)
    big = edited(replica_doc(), ("layer_digests",), DELETE)
    big["residency"] = [{"tier": "host", "layers": [i, i]} for i in range(5)] + ["junk"]
    rejects(ReplicaRecord, big, "residency: has 6 entries; at most 4", limits)


# --- Instance Status Record (4.4, 6.3) --------------------------------------------------------

STATUS_REJECTS = [
    (("instance",), "https://ii7.example/kvsp", 'instance: must end with "/"'),
    (("instance",), "moqt://ii7.example/kvsp/", "instance: must be an http or https URL"),
    (("epoch",), -1, "epoch: must be an integer from 0"),
    (("epoch",), 1.5, "epoch: must be an integer"),
    (("state",), "sleepy", 'state: must be one of "active", "draining", "failed", "sleeping"'),
    (("state",), ["active"], "state: must be one of"),
    (("running",), -1, "running: must be an integer from 0"),
    (("queued",), 1.5, "queued: must be an integer"),
    (("batch_size",), False, "batch_size: must be an integer"),
    (("kv_utilization",), 1.2, "kv_utilization: must be at most 1"),
    (("kv_utilization",), -0.1, "kv_utilization: must be at least 0"),
    (("kv_utilization",), "71%", "kv_utilization: must be a number"),
    (("prefill_tokens_per_s",), 0, "prefill_tokens_per_s: must be greater than 0"),
    (("decode_tokens_per_s",), -1, "decode_tokens_per_s: must be greater than 0"),
    (("links",), {}, "links: must be an array"),
    (("links", 0), [H1, 1, 1], "links[0]: must be a JSON object"),
    (("links", 0, "holder"), "h1.example", "links[0].holder: must be an absolute URL"),
    (
        ("links", 0, "holder"),
        'http://evil.test/"><svg/onload=alert(1)>/',
        "links[0].holder: must have only the characters RFC 3986 allows",
    ),
    (
        ("instance",),
        "http://ii1.example/a|b/",
        "instance: must have only the characters RFC 3986 allows",
    ),
    (
        ("instance",),
        "http://ii1.example/a\\b/",
        "instance: must have only the characters RFC 3986 allows",
    ),
    (("links", 0, "mbit_per_s"), 0, "links[0].mbit_per_s: must be greater than 0"),
    (("links", 0, "rtt_us"), -1, "links[0].rtt_us: must be at least 0"),
    (("links", 0, "rtt_us"), DELETE, "links[0].rtt_us: required member is missing"),
    (("requested_state",), "draining", 'requested_state: must be one of "sleeping"'),
    (("requested_state",), "active", 'requested_state: must be one of "sleeping"'),
    (("requested_state",), 3, 'requested_state: must be one of "sleeping"'),
    (("ttl_ms",), 0, "ttl_ms: must be an integer from 1"),
    (("compat_ids",), [COMPAT, "x"], "compat_ids[1]: must be hex32"),
    (("compat_ids",), [COMPAT, COMPAT], "compat_ids[1]: duplicates compat_ids[0]"),
    (("compat_ids",), COMPAT, "compat_ids: must be an array"),
]


@pytest.mark.parametrize(("path", "value", "detail"), STATUS_REJECTS)
def test_status_record_rejects(path, value, detail):
    rejects(InstanceStatusRecord, edited(status_doc(), path, value), detail)


def test_status_record_rejects_two_links_to_one_holder():
    doc = status_doc()
    doc["links"].append({"holder": H2, "mbit_per_s": 1, "rtt_us": 0})
    doc["links"].append({"holder": H1, "mbit_per_s": 1, "rtt_us": 0})
    rejects(InstanceStatusRecord, doc, "links[2].holder: duplicates links[0].holder")


def test_status_record_accepts():
    record = InstanceStatusRecord.from_json(edited(status_doc(), ("requested_state",), DELETE))
    assert record.requested_state is None
    assert record.to_json() == status_doc()  # requested_state is written as null
    sleepy = InstanceStatusRecord.from_json(edited(status_doc(), ("requested_state",), "sleeping"))
    assert sleepy.requested_state == "sleeping"
    for state in ("active", "draining", "sleeping", "failed"):
        InstanceStatusRecord.from_json(edited(status_doc(), ("state",), state))
    record = InstanceStatusRecord.from_json(edited(status_doc(), ("links",), []))
    assert record.link_to(H1) is None
    record = InstanceStatusRecord.from_json(status_doc())
    assert record.link_to(H1) == Link(H1, 200000, 12)
    # A moqt relay can be a holder the instance has a link to.
    InstanceStatusRecord.from_json(edited(status_doc(), ("links", 0, "holder"), "moqt://r.example"))
    InstanceStatusRecord.from_json(edited(status_doc(), ("kv_utilization",), 1))
    # Percent-encodings and the reserved characters are what RFC 3986 allows.
    allowed = "http://h1.example/a%7Eb/!$&'()*+,;=:@-._~/"
    InstanceStatusRecord.from_json(edited(status_doc(), ("links", 0, "holder"), allowed))


def test_status_record_compat_ids_and_engine():
    plain = InstanceStatusRecord.from_json(status_doc())
    assert plain.compat_ids is None and plain.serves(COMPAT) and plain.serves(K1)
    assert plain.engine and "engine" not in plain.to_json()
    # An instance that lists no compat ids serves any.
    empty = InstanceStatusRecord.from_json(dict(status_doc(), compat_ids=[]))
    assert empty.serves(K1) and empty.serves(COMPAT)
    listed = InstanceStatusRecord.from_json(dict(status_doc(), compat_ids=[COMPAT]))
    assert listed.serves(COMPAT) and not listed.serves(K1)
    assert listed.to_json()["compat_ids"] == [COMPAT]
    # A node without an engine serves nothing, whatever its compat ids; true is the default.
    for compat_ids in (None, [], [COMPAT]):
        doc = dict(status_doc(), engine=False)
        if compat_ids is not None:
            doc["compat_ids"] = compat_ids
        holder = InstanceStatusRecord.from_json(doc)
        assert not holder.engine and not holder.serves(COMPAT) and not holder.serves(K1)
        assert holder.to_json() == doc
    assert InstanceStatusRecord.from_json(dict(status_doc(), engine=True)).serves(COMPAT)
    for bad in ("false", 0, [], {}):
        with pytest.raises(ProtocolError, match="engine: must be true or false"):
            InstanceStatusRecord.from_json(dict(status_doc(), engine=bad))


# --- Session Checkpoint (4.4, 6.8) ------------------------------------------------------------

CHECKPOINT_REJECTS = [
    (("session",), "6f1d0a9e2c554d7e9a0e5b7f2f9f6a11", "session: must be a UUID"),
    (("session",), "not-a-uuid", "session: must be a UUID"),
    (("session",), 12, "session: must be a UUID"),
    (("epoch",), 0, "epoch: must be an integer from 1"),
    (("compat_id",), SCOPE, "compat_id: must be hex32"),
    (("scope_id",), COMPAT, "scope_id: must be hex16"),
    (("prompt_blocks", 1), "K2", "prompt_blocks[1]: must be hex32"),
    (("prompt_tail", 1), UINT32_MAX + 1, "prompt_tail[1]: must be an integer from 0 to 4294967295"),
    (("prompt_tail", 0), -1, "prompt_tail[0]: must be an integer from 0"),
    (("generated", 2), True, "generated[2]: must be an integer"),
    (("generated", 2), 279.0, "generated[2]: must be an integer"),
    (("generated",), "1296", "generated: must be an array"),
    (("output_offset",), 4, "output_offset: covers 4 output tokens but generated holds 3"),
    (("output_offset",), -1, "output_offset: must be an integer from 0"),
    (("sampler",), "top-p", "sampler: must be a JSON object"),
    (("sampler", "method"), "beam", 'sampler.method: must be one of "greedy"'),
    (("sampler", "method"), "TOP-P", "sampler.method: must be one of"),
    (("sampler", "params"), [], "sampler.params: must be a JSON object"),
    (("sampler", "params"), {}, 'sampler.params.p: is required by method "top-p"'),
    (("sampler", "params", "p"), 0, "sampler.params.p: must be greater than 0"),
    (("sampler", "params", "p"), 1.5, "sampler.params.p: must be at most 1"),
    (("sampler", "params", "p"), "0.9", "sampler.params.p: must be a number"),
    (("sampler", "params", "temperature"), 0, "sampler.params.temperature: must be greater"),
    (("sampler", "params", "x"), float("nan"), "sampler.params.x: must be a finite number"),
    (("sampler", "seed"), -1, "sampler.seed: must be an integer from 0 to"),
    (("sampler", "seed"), UINT64_MAX + 1, "sampler.seed: must be an integer from 0 to"),
    (("sampler", "step"), -3, "sampler.step: must be an integer from 0"),
    (("sampler", "deterministic"), "yes", "sampler.deterministic: must be true or false"),
    (("sampler", "deterministic"), 0, "sampler.deterministic: must be true or false"),
    (("sampler", "seed"), DELETE, "sampler.seed: required member is missing"),
]


@pytest.mark.parametrize(("path", "value", "detail"), CHECKPOINT_REJECTS)
def test_checkpoint_rejects(path, value, detail):
    rejects(SessionCheckpoint, edited(checkpoint_doc(), path, value), detail)


@pytest.mark.parametrize(
    ("method", "params", "detail"),
    [
        ("greedy", {}, None),
        ("greedy", {"anything": [1, {"a": None}]}, None),
        ("temperature", {"temperature": 0.7}, None),
        ("temperature", {}, 'sampler.params.temperature: is required by method "temperature"'),
        ("top-k", {"k": 40}, None),
        ("top-k", {"k": 40, "temperature": 0.5}, None),
        ("top-k", {"k": 0}, "sampler.params.k: must be an integer from 1"),
        ("top-k", {"k": 4.0}, "sampler.params.k: must be an integer"),
        ("top-p", {"p": 1}, None),
        ("min-p", {"p": 0.05, "repetition_penalty": 1.1}, None),
        ("min-p", {"p": 0}, "sampler.params.p: must be greater than 0"),
    ],
)
def test_sampler_methods(method, params, detail):
    doc = edited(checkpoint_doc(), ("sampler",), dict(checkpoint_doc()["sampler"], method=method))
    doc = edited(doc, ("sampler", "params"), params)
    if detail is None:
        record = SessionCheckpoint.from_json(doc)
        assert record.sampler.params.to_json() == params
        assert record.to_json() == doc
    else:
        rejects(SessionCheckpoint, doc, detail)


def test_sampler_params_are_bounded():
    deep: object = 1
    for _ in range(10):
        deep = {"d": deep}
    doc = edited(checkpoint_doc(), ("sampler", "params", "deep"), deep)
    rejects(SessionCheckpoint, doc, "is nested deeper than 8 levels")
    doc = edited(checkpoint_doc(), ("sampler", "params", "many"), list(range(100)))
    rejects(SessionCheckpoint, doc, "sampler.params.many[62]: has too many values")
    doc = edited(checkpoint_doc(), ("sampler", "params", "s"), "x" * 2000)
    rejects(SessionCheckpoint, doc, "sampler.params.s: must be at most 1024 characters")
    doc = edited(checkpoint_doc(), ("sampler", "params", "many"), list(range(100)))
    assert (
        len(SessionCheckpoint.from_json(doc, Limits(max_params=200)).sampler.params["many"]) == 100
    )


def test_sampler_params_are_frozen_and_hashable():
    doc = edited(checkpoint_doc(), ("sampler", "params", "bias"), {"50256": -100, "l": [1, 2]})
    record = SessionCheckpoint.from_json(doc)
    assert isinstance(record.sampler.params, JsonObject)
    assert record.sampler.params["bias"]["l"] == (1, 2)
    assert record.to_json() == doc
    hash(record)
    with pytest.raises(TypeError):
        record.sampler.params["p"] = 0.5
    built = Sampler("top-p", {"p": 0.9, "n": {"a": [1]}}, 7, 3, False)
    assert built.params == JsonObject({"p": 0.9, "n": JsonObject({"a": (1,)})})
    assert built == Sampler.from_json(built.to_json())


def test_checkpoint_accepts():
    doc = edited(checkpoint_doc(), ("session",), SESSION.upper())
    record = SessionCheckpoint.from_json(doc)
    assert record.session == SESSION  # kept in lowercase
    doc = edited(checkpoint_doc(), ("output_offset",), 2)
    record = SessionCheckpoint.from_json(doc)
    assert record.covered_generated == (1296, 315)
    empty = edited(checkpoint_doc(), ("prompt_blocks",), [])
    empty = edited(empty, ("generated",), [])
    empty = edited(empty, ("output_offset",), 0)
    SessionCheckpoint.from_json(empty)
    tokens = edited(checkpoint_doc(), ("prompt_tail",), [0, UINT32_MAX])
    SessionCheckpoint.from_json(tokens)


def test_checkpoint_token_limits():
    limits = Limits(max_tokens=2)
    rejects(SessionCheckpoint, checkpoint_doc(), "generated: has 3 entries; at most 2", limits)
    limits = Limits(max_block_keys=1)
    rejects(SessionCheckpoint, checkpoint_doc(), "prompt_blocks: has 2 entries; at most 1", limits)


# --- Prefetch directive and directive status (6.5) ---------------------------------------------

DIRECTIVE_REJECTS = [
    (("directive",), "a2b7c9e0", "directive: must be a UUID"),
    (("request_ref",), 5, "request_ref: must be a string"),
    (("request_ref",), "r" * 1025, "request_ref: must be at most 1024 characters"),
    (("blocks",), [], "blocks: must not be empty"),
    (("blocks", 0), K1, "blocks[0]: must be a JSON object"),
    (("blocks", 0, "block_key"), "k", "blocks[0].block_key: must be hex32"),
    (("blocks", 0, "sources"), [], "blocks[0].sources: must not be empty"),
    (("blocks", 0, "sources"), [H1, H1], "blocks[0].sources[1]: duplicates blocks[0].sources[0]"),
    (("blocks", 0, "sources"), ["h1"], "blocks[0].sources[0]: must be an absolute URL"),
    (("layer_order",), "descending", 'layer_order: must be one of "ascending"'),
    (("layer_order",), 0, 'layer_order: must be one of "ascending"'),
    (("deadline_ms",), 0, "deadline_ms: must be an integer from 1"),
    (("lease_ms",), -5, "lease_ms: must be an integer from 1"),
]


@pytest.mark.parametrize(("path", "value", "detail"), DIRECTIVE_REJECTS)
def test_directive_rejects(path, value, detail):
    rejects(PrefetchDirective, edited(directive_doc(), path, value), detail)


def test_directive_rejects_a_block_listed_twice():
    doc = directive_doc()
    doc["blocks"] += [{"block_key": K2, "sources": [H2]}, {"block_key": K1, "sources": [H2]}]
    rejects(PrefetchDirective, doc, "blocks[2].block_key: duplicates blocks[0].block_key")
    rejects(PrefetchDirective, doc, "blocks: has 3 entries; at most 2", Limits(max_block_keys=2))
    doc = edited(directive_doc(), ("blocks", 0, "sources"), [H1, H2])
    rejects(PrefetchDirective, doc, "blocks[0].sources: has 2 entries", Limits(max_sources=1))


def test_directive_accepts():
    doc = edited(edited(directive_doc(), ("request_ref",), DELETE), ("layer_order",), DELETE)
    record = PrefetchDirective.from_json(doc)
    assert record.request_ref is None and record.layer_order == "ascending"
    assert record.block_keys == (K1,)
    assert record.to_json() == dict(doc, layer_order="ascending")
    assert DirectiveBlock(K1, (H1, "moqt://relay.example/x")).sources[1].startswith("moqt")


@pytest.mark.parametrize(
    ("path", "value", "detail"),
    [
        (("state",), "done", 'state: must be one of "complete", "failed", "partial", "pending"'),
        (("loaded",), [K1, K1], "loaded[1]: duplicates loaded[0]"),
        (("loaded", 0), "k", "loaded[0]: must be hex32"),
        (("reason",), 3, "reason: must be a string"),
        (("directive",), "x", "directive: must be a UUID"),
    ],
)
def test_directive_state_rejects(path, value, detail):
    rejects(DirectiveStatusRecord, edited(directive_status_doc(), path, value), detail)


def test_directive_state_accepts():
    for state in ("pending", "partial", "complete", "failed"):
        DirectiveStatusRecord.from_json(edited(directive_status_doc(), ("state",), state))
    record = DirectiveStatusRecord.from_json(edited(directive_status_doc(), ("reason",), DELETE))
    assert record.reason is None
    assert record.to_json()["reason"] is None  # the member is always there (DESIGN.md 3)
    DirectiveStatusRecord.from_json(edited(directive_status_doc(), ("loaded",), []))


# --- Leases (6.6) -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "doc", "path", "value", "detail"),
    [
        (LeaseRequest, lease_request_doc, ("block_keys",), [], "block_keys: must not be empty"),
        (LeaseRequest, lease_request_doc, ("block_keys",), [K1, K1], "block_keys[1]: duplicates"),
        (LeaseRequest, lease_request_doc, ("ttl_ms",), 0, "ttl_ms: must be an integer from 1"),
        (LeaseRequest, lease_request_doc, ("scope_id",), DELETE, "scope_id: required member"),
        (LeaseRequest, lease_request_doc, ("compat_id",), DELETE, "compat_id: required member"),
        (LeaseGrant, lease_grant_doc, ("lease",), "a/b", "lease: must be 1 to 128 characters"),
        (LeaseGrant, lease_grant_doc, ("lease",), "", "lease: must be 1 to 128 characters"),
        (LeaseGrant, lease_grant_doc, ("lease",), "x" * 129, "lease: must be 1 to 128"),
        (LeaseGrant, lease_grant_doc, ("expires_ms",), -1, "expires_ms: must be an integer"),
        (LeaseGrant, lease_grant_doc, ("ttl_ms",), 0, "ttl_ms: must be an integer from 1"),
        (LeaseGrant, lease_grant_doc, ("block_keys",), [], "block_keys: must not be empty"),
        (LeaseRenewal, lambda: {"ttl_ms": 1}, ("ttl_ms",), 0, "ttl_ms: must be an integer from 1"),
    ],
)
def test_lease_records_reject(cls, doc, path, value, detail):
    rejects(cls, edited(doc(), path, value), detail)


def test_lease_limits():
    rejects(LeaseRequest, lease_request_doc(), "block_keys: has 2", Limits(max_block_keys=1))


# --- Lookup and placement requests (6.2, 6.4) -------------------------------------------------


def test_lookup_request():
    record = LookupRequest.from_json(edited(lookup_doc(), ("targets",), DELETE))
    assert record.targets is None
    assert LookupRequest.from_json(dict(lookup_doc(), block_keys=[])).block_keys == ()
    rejects(LookupRequest, edited(lookup_doc(), ("block_keys", 2), "x"), "block_keys[2]: must be")
    doc = edited(lookup_doc(), ("targets",), [II7, II7])
    rejects(LookupRequest, doc, "targets[1]: duplicates targets[0]")
    doc = edited(lookup_doc(), ("targets", 0), "https://ii7.example")
    rejects(LookupRequest, doc, 'targets[0]: must end with "/"')
    rejects(LookupRequest, lookup_doc(), "block_keys: has 3 entries", Limits(max_block_keys=2))
    rejects(LookupRequest, lookup_doc(), "targets: has 2 entries", Limits(max_targets=1))


def test_lookup_request_max_keys_parameter():
    assert len(LookupRequest.from_json(lookup_doc(), max_keys=3).block_keys) == 3
    with pytest.raises(InvalidRecord, match="block_keys: has 3 entries; at most 2 are accepted"):
        LookupRequest.from_json(lookup_doc(), max_keys=2)


def test_placement_request():
    record = PlacementRequest.from_json(edited(placement_doc(), ("request_ref",), DELETE))
    assert record.request_ref is None and record.tokens == (1, 2, 3)
    rejects(PlacementRequest, dict(placement_doc(), tokens=[]), "tokens: must not be empty")
    rejects(PlacementRequest, dict(placement_doc(), tokens=[1, -2]), "tokens[1]: must be")
    rejects(PlacementRequest, dict(placement_doc(), tokens=[2**32]), "tokens[0]: must be")
    rejects(PlacementRequest, dict(placement_doc(), request_ref=[]), "request_ref: must be a str")
    rejects(PlacementRequest, placement_doc(), "tokens: has 3 entries", Limits(max_tokens=2))


# --- Generate request (DESIGN.md section 3) ----------------------------------------------------


def generate_doc() -> dict:
    return {
        "session": SESSION,
        "scope_id": SCOPE,
        "compat_id": COMPAT,
        "prompt": [1, 2, 3],
        "max_tokens": 8,
        "sampler": {"method": "top-k", "params": {"k": 40}, "seed": 7},
        "request_ref": "r-1",
    }


def test_generate_request_round_trips_and_defaults_its_sampler():
    record = GenerateRequest.from_json(generate_doc())
    assert record.to_json() == generate_doc()
    assert record.sampler.record().params == JsonObject({"k": 40})
    for absent in (DELETE, None):
        doc = edited(edited(generate_doc(), ("sampler",), absent), ("request_ref",), absent)
        record = GenerateRequest.from_json(doc)
        assert record.request_ref is None
        greedy = {"method": "greedy", "params": {}, "seed": 0}
        stated = {name: value for name, value in doc.items() if value is not None}
        assert record.to_json() == {**stated, "sampler": greedy}
    upper = edited(generate_doc(), ("session",), SESSION.upper())
    assert GenerateRequest.from_json(upper).session == SESSION


@pytest.mark.parametrize(
    ("path", "value", "detail"),
    [
        (("prompt",), [], "prompt: must not be empty"),
        (("prompt", 1), -2, "prompt[1]: must be an integer from 0"),
        (("max_tokens",), 0, "max_tokens: must be an integer from 1"),
        (("scope_id",), COMPAT, "scope_id: must be hex16"),
        (("request_ref",), "", "request_ref: must be a string of 1 to 1024 characters"),
        (("sampler", "method"), "beam", 'sampler.method: must be one of "greedy"'),
        (
            ("sampler", "params"),
            {"k": 40, "n": 1},
            "sampler.params: method 'top-k' here takes no n",
        ),
        (("sampler", "params", "k"), 0, "sampler.params.k: must be an integer from 1"),
        (("sampler", "params", "max_tokens"), 4, "sampler.params: give max_tokens beside"),
        (("sampler", "seed"), UINT64_MAX + 1, "sampler.seed: must be an integer from 0 to"),
    ],
)
def test_generate_request_rejects(path, value, detail):
    rejects(GenerateRequest, edited(generate_doc(), path, value), detail)


@pytest.mark.parametrize("doc", [[generate_doc()], dict(generate_doc(), session="7")])
def test_generate_request_without_an_object_or_a_session_is_malformed(doc):
    with pytest.raises(ProtocolError) as caught:
        GenerateRequest.from_json(doc)
    assert caught.value.problem == "kvsp-malformed-request"


# --- Resume request (6.8) ---------------------------------------------------------------------


def resume_doc() -> dict:
    return {
        "session": SESSION,
        "epoch": 3,
        "checkpoint": checkpoint_doc(),
        "blocks": [{"block_key": K1, "sources": [H1]}],
        "resident": [K2],
        "deadline_ms": 200,
        "lease_ms": 2000,
    }


def test_resume_request_round_trips_and_leaves_the_prefetch_bounds_to_the_node():
    record = ResumeRequest.from_json(resume_doc())
    assert record.to_json() == resume_doc()
    assert record.with_prefetch_bounds(1, 1) == record
    bare = {"session": SESSION.upper(), "epoch": 3, "checkpoint": checkpoint_doc()}
    for absent in (DELETE, None):
        doc = bare if absent is DELETE else dict(bare, blocks=None, lease_ms=None)
        record = ResumeRequest.from_json(doc).with_prefetch_bounds(50, 60)
        assert record.session == SESSION and record.blocks == () and record.resident == ()
        assert (record.deadline_ms, record.lease_ms) == (50, 60)


@pytest.mark.parametrize(
    ("path", "value", "detail"),
    [
        (("epoch",), 1, "epoch: must be above the checkpoint's epoch 1"),
        (("epoch",), 0, "epoch: must be an integer from 1"),
        (("checkpoint",), DELETE, "checkpoint: required member is missing"),
        (
            ("checkpoint", "session"),
            "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a12",
            "checkpoint.session: not the session resumed",
        ),
        (("checkpoint", "prompt_tail", 0), -1, "checkpoint.prompt_tail[0]: must be an integer"),
        (("checkpoint", "sampler", "params", "q"), 1, "checkpoint.sampler.params: method 'top-p'"),
        (("blocks", 0, "sources"), [], "blocks[0].sources: must not be empty"),
        (("resident", 0), "k", "resident[0]: must be hex32"),
        (("lease_ms",), 0, "lease_ms: must be an integer from 1"),
    ],
)
def test_resume_request_rejects(path, value, detail):
    rejects(ResumeRequest, edited(resume_doc(), path, value), detail)


def test_resume_request_needs_a_token_to_compute_from():
    doc = edited(
        edited(resume_doc(), ("checkpoint", "prompt_tail"), []), ("checkpoint", "generated"), []
    )
    doc = edited(doc, ("checkpoint", "output_offset"), 0)
    rejects(ResumeRequest, doc, "checkpoint: no token after the prompt blocks")


def test_resume_request_bounds_what_it_nests():
    limits = Limits(max_tokens=2, max_sources=0)
    rejects(ResumeRequest, resume_doc(), "checkpoint.generated: has 3 entries", limits)
    rejects(ResumeRequest, resume_doc(), "blocks[0].sources: has 1 entries", Limits(max_sources=0))


# --- Shard Map and reshard messages (6.9) -----------------------------------------------------

SHARD_MAP_REJECTS = [
    (("map",), "a/b", "map: must be 1 to 128 characters"),
    (("map",), 4, "map: must be 1 to 128 characters"),
    (("version",), -1, "version: must be an integer from 0"),
    (("shards",), [], "shards: must not be empty"),
    (("shards", 0, "tokens"), [0, 0], "shards[0].tokens: start must be less than end"),
    (("shards", 0, "tokens"), [5, 1], "shards[0].tokens: start must be less than end"),
    (("shards", 0, "tokens"), [-1, 32768], "shards[0].tokens[0]: must be an integer from 0"),
    (("shards", 0, "tokens"), [0], "shards[0].tokens: must be [start, end]"),
    (("shards", 1, "tokens"), [32769, 65536], "shards[1].tokens: must start at 32768"),
    (("shards", 1, "tokens"), [30000, 65536], "shards[1].tokens: must start at 32768"),
    (("shards", 2, "instance"), "moqt://ii3/", "shards[2].instance: must be an http or https"),
]


@pytest.mark.parametrize(("path", "value", "detail"), SHARD_MAP_REJECTS)
def test_shard_map_rejects(path, value, detail):
    rejects(ShardMap, edited(shard_map_doc(), path, value), detail)


def test_shard_map_order_and_helpers():
    doc = shard_map_doc()
    doc["shards"].reverse()  # contiguous means in list order
    rejects(ShardMap, doc, "shards[1].tokens: must start at 98304")
    doc = shard_map_doc()
    for shard in doc["shards"]:
        shard["tokens"] = [t + 1000 for t in shard["tokens"]]
    doc["shards"].append({"tokens": [99304, 99400], "instance": "https://ii1.example/kvsp/"})
    record = ShardMap.from_json(doc)  # the first start need not be 0
    assert record.covered == (1000, 99400)
    assert record.instances == tuple(f"https://ii{i}.example/kvsp/" for i in (1, 2, 3))
    assert record.ranges_of("https://ii1.example/kvsp/") == [(1000, 33768), (99304, 99400)]
    assert record.ranges_of(II7) == []
    rejects(ShardMap, doc, "shards: has 4 entries", Limits(max_shards=3))


PLAN_REJECTS = [
    (("to",), 6, "to: must be from + 1 = 5"),
    (("to",), 4, "to: must be from + 1 = 5"),
    (("from",), -1, "from: must be an integer from 0"),
    (("deadline_ms",), 0, "deadline_ms: must be an integer from 1"),
    (("retain",), [[0, 10], [5, 20]], "retain[1]: overlaps retain[0]"),
    (("retain",), [[0, 10], [10, 10]], "retain[1]: start must be less than end"),
    (("retain",), [[0, 32768], "x"], "retain[1]: must be [start, end]"),
    (("fetch", 0, "tokens"), [30000, 40000], "fetch[0].tokens: overlaps retain[0]"),
    (("fetch", 0, "from"), "ii2", "fetch[0].from: must be an absolute URL"),
    (("fetch", 0, "from"), DELETE, "fetch[0].from: required member is missing"),
    (("release",), [[40000, 50000]], "release[0]: overlaps fetch[0].tokens"),
    (("release",), [[0, 1]], "release[0]: overlaps retain[0]"),
    (("fetch",), {}, "fetch: must be an array"),
]


@pytest.mark.parametrize(("path", "value", "detail"), PLAN_REJECTS)
def test_reshard_plan_rejects(path, value, detail):
    rejects(ReshardPlan, edited(plan_doc(), path, value), detail)


def test_reshard_plan_accepts():
    doc = plan_doc()
    doc["retain"] = [[60000, 70000], [0, 32768]]  # unsorted is fine
    doc["release"] = [[50000, 60000]]
    record = ReshardPlan.from_json(doc)
    assert record.retain == ((60000, 70000), (0, 32768))
    assert record.instance is None
    own = dict(plan_doc(), instance="https://ii1.example/kvsp/")
    assert ReshardPlan.from_json(own).to_json() == own
    fetch_self = edited(own, ("fetch", 0, "from"), "https://ii1.example/kvsp/")
    rejects(ReshardPlan, fetch_self, "fetch[0].from: is the plan's own instance")
    rejects(ReshardPlan, plan_doc(), "retain: has 1 entries; at most 0", Limits(max_ranges=0))
    assert FetchRange((1, 2), H1).to_json() == {"tokens": [1, 2], "from": H1}


def test_parse_reshard_body():
    assert isinstance(parse_reshard_body(plan_doc()), ReshardPlan)
    commit = parse_reshard_body({"map": "m", "commit": 5, "retain": "ignored"})
    assert commit == ReshardCommit("m", 5)
    assert parse_reshard_body({"map": "m", "abort": 5}) == ReshardAbort("m", 5)
    # null counts as absent here too: this is a plan, and a plan needs its members.
    with pytest.raises(InvalidRecord, match="from: required member is missing"):
        parse_reshard_body({"map": "m", "commit": None})
    with pytest.raises(InvalidRecord, match='cannot carry both "commit" and "abort"'):
        parse_reshard_body({"map": "m", "commit": 5, "abort": 5})
    with pytest.raises(InvalidRecord, match="commit: must be an integer from 1"):
        parse_reshard_body({"map": "m", "commit": 0})
    with pytest.raises(InvalidRecord, match="abort: must be an integer"):
        parse_reshard_body({"map": "m", "abort": "5"})
    with pytest.raises(InvalidRecord, match="a reshard body must be a JSON object"):
        parse_reshard_body([plan_doc()])


def test_reshard_request():
    shards = shard_map_doc()["shards"]
    asked = ReshardRequest.from_json({"shards": shards, "deadline_ms": MAX_DEADLINE_MS})
    assert asked.shards == ShardMap.from_json(shard_map_doc()).shards
    for doc, detail in [
        (
            {"shards": shards, "deadline_ms": 0},
            f"deadline_ms: must be an integer from 1 to {MAX_DEADLINE_MS}",
        ),
        (
            {"shards": shards, "deadline_ms": MAX_DEADLINE_MS + 1},
            "deadline_ms: must be an integer from 1",
        ),
        ({"shards": shards, "deadline_ms": 1.0}, "deadline_ms: must be an integer from 1"),
        ({"shards": shards, "deadline_ms": True}, "deadline_ms: must be an integer from 1"),
        ({"shards": shards}, "deadline_ms: required member is missing"),
        ({"shards": "x", "deadline_ms": 1}, "shards: must be an array of shards"),
        (
            {"shards": [{"tokens": [5, 1], "instance": H1}], "deadline_ms": 1},
            "shards[0].tokens: start must be less than end",
        ),
        (
            {"shards": [{"tokens": [0, 1], "instance": "moqt://h/"}], "deadline_ms": 1},
            "shards[0].instance: must be an http or https",
        ),
    ]:
        rejects(ReshardRequest, doc, detail)
    # That there is a shard, and that the shards are contiguous, are the next map's rules: the
    # PC checks them as it makes that map, after it has found the current one.
    assert ReshardRequest.from_json({"shards": [], "deadline_ms": 1}).shards == ()
    gap = [{"tokens": [0, 5], "instance": H1}, {"tokens": [6, 9], "instance": H2}]
    asked = ReshardRequest.from_json({"shards": gap, "deadline_ms": 1})
    with pytest.raises(InvalidRecord, match=r"shards\[1\].tokens: must start at 5"):
        ShardMap("m", 2, asked.shards)
    with pytest.raises(InvalidRecord, match=r"shards\[0\]: must be a shard"):
        ReshardRequest(((0, 5),), 1)
    too_many = [{"tokens": [i, i + 1], "instance": H1} for i in range(3)]
    rejects(
        ReshardRequest,
        {"shards": too_many, "deadline_ms": 1},
        "shards: has 3 entries; at most 2",
        Limits(max_shards=2),
    )


def test_state_change():
    assert StateChange.from_json({"state": "sleeping"}).state == "sleeping"
    for value in ["failed", "", "Active", None, 1, ["active"]]:
        rejects(
            StateChange, {"state": value}, 'state: must be one of "active", "draining", "sleeping"'
        )
    with pytest.raises(InvalidRecord, match='state: must be one of "active"'):
        StateChange("failed")


def test_output_post_is_one_token_or_an_array_of_them():
    one = {"epoch": 1, "index": 0, "token": 7}
    assert parse_output_post(one) == (OutputToken(1, 0, 7),)
    most = [{**one, "index": i} for i in range(MAX_OUTPUT_TOKENS_PER_POST)]
    assert len(parse_output_post(most)) == MAX_OUTPUT_TOKENS_PER_POST
    # A null "final" counts as absent: not the last token.
    assert parse_output_post([{**one, "final": None}, {**one, "final": True}]) == (
        OutputToken(1, 0, 7),
        OutputToken(1, 0, 7, True),
    )
    assert OutputToken(1, 0, 7, True).to_json() == {**one, "final": True}


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ([], "post 1 to 4096 output tokens"),
        ([{"epoch": 1, "index": 0, "token": 7}] * 4097, "post 1 to 4096 output tokens"),
        ("x", "[0]: must be a JSON object"),
        ([{"epoch": 1, "index": 0, "token": 7}, 5], "[1]: must be a JSON object"),
        ({"epoch": 1, "index": 0}, "[0].token: required member is missing"),
        (
            {"epoch": -1, "index": 0, "token": 7},
            "[0].epoch: must be an integer from 0 to 2147483647",
        ),
        (
            {"epoch": 2**31, "index": 0, "token": 7},
            "[0].epoch: must be an integer from 0 to 2147483647",
        ),
        (
            {"epoch": True, "index": 0, "token": 7},
            "[0].epoch: must be an integer from 0 to 2147483647",
        ),
        (
            {"epoch": 1, "index": 1.0, "token": 7},
            "[0].index: must be an integer from 0 to 2147483647",
        ),
        (
            {"epoch": 1, "index": 2**31, "token": 7},
            "[0].index: must be an integer from 0 to 2147483647",
        ),
        (
            {"epoch": 1, "index": 0, "token": 2**32},
            f"[0].token: must be an integer from 0 to {UINT32_MAX}",
        ),
        (
            {"epoch": 1, "index": 0, "token": "7"},
            f"[0].token: must be an integer from 0 to {UINT32_MAX}",
        ),
        ({"epoch": 1, "index": 0, "token": 7, "final": 1}, "[0].final: must be true or false"),
    ],
)
def test_output_post_rejects(body, detail):
    with pytest.raises(InvalidRecord) as caught:
        parse_output_post(body)
    assert caught.value.detail == detail


def test_shard_and_instance_urls_in_code():
    with pytest.raises(InvalidRecord, match="instance: must be an http or https URL"):
        Shard((0, 1), "moqt://x.example/")
    with pytest.raises(InvalidRecord, match="must be a shard"):
        ShardMap("m", 0, ({"tokens": [0, 1], "instance": II7},))


# --- Strategies that build valid records ------------------------------------------------------

hex16 = st.binary(min_size=16, max_size=16).map(bytes.hex)
hex32 = st.binary(min_size=32, max_size=32).map(bytes.hex)
uuids = st.uuids().map(str)
uint32 = st.integers(0, UINT32_MAX)
positive_ints = st.integers(1, MAX_SAFE_INTEGER)
non_negative = st.integers(0, MAX_SAFE_INTEGER)
positive_numbers = st.one_of(
    positive_ints, st.floats(min_value=1e-6, max_value=1e15, allow_nan=False)
)
texts = st.text(max_size=40)
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,12}(\.[a-z]{2,6}){0,2}", fullmatch=True)
ports = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))
segments = st.lists(st.from_regex(r"[A-Za-z0-9_~-]{1,8}", fullmatch=True), max_size=3)
base_urls = st.builds(
    lambda scheme, host, port, path: f"{scheme}://{host}{port}/" + "".join(s + "/" for s in path),
    st.sampled_from(["http", "https"]),
    hosts,
    ports,
    segments,
)
moqt_uris = st.builds(
    lambda host, port, path: f"moqt://{host}{port}/" + "/".join(path), hosts, ports, segments
)
holders = st.one_of(base_urls, moqt_uris)
namespaces = st.lists(st.binary(max_size=12), min_size=5, max_size=5).map(
    lambda fields: encode_moqt_namespace(tuple(fields))
)
tiers = st.one_of(
    st.sampled_from(["device", "host", "disk"]), st.from_regex(r"[a-z]{1,8}", fullmatch=True)
)


@st.composite
def residencies(draw, layers: int | None):
    """Disjoint inclusive layer ranges, shuffled, inside 0..layers-1 when layers is given."""
    top = layers if layers is not None else draw(st.integers(1, 300))
    cuts = sorted(draw(st.sets(st.integers(0, top), min_size=2, max_size=8)))
    ranges = [(a, b - 1) for a, b in zip(cuts, cuts[1:], strict=False)]
    ranges = [r for r in ranges if draw(st.booleans())] or ranges[:1]
    entries = [ResidencyEntry(draw(tiers), r, draw(st.none() | positive_numbers)) for r in ranges]
    return tuple(draw(st.permutations(entries)))


@st.composite
def replica_records(draw):
    holder = draw(holders)
    layer_digests = None
    if draw(st.booleans()):
        layer_digests = tuple(draw(st.lists(hex32, min_size=1, max_size=40)))
        digest = replica_digest(bytes.fromhex(d) for d in layer_digests)
    else:
        digest = "sha-256:" + draw(hex32)
    return ReplicaRecord(
        block_key=draw(hex32),
        compat_id=draw(hex32),
        scope_id=draw(hex16),
        holder=holder,
        codec=draw(st.integers(1, 0xFFFF)),
        size=draw(non_negative),
        digest=digest,
        residency=draw(residencies(None if layer_digests is None else len(layer_digests))),
        ttl_ms=draw(positive_ints),
        layer_digests=layer_digests,
        moqt_namespace=draw(namespaces) if holder.startswith("moqt:") else None,
    )


links = st.builds(
    Link, holders, positive_numbers, st.one_of(non_negative, st.floats(0, 1e9, allow_nan=False))
)
status_records = st.builds(
    InstanceStatusRecord,
    instance=base_urls,
    epoch=non_negative,
    state=st.sampled_from(["active", "draining", "sleeping", "failed"]),
    running=non_negative,
    queued=non_negative,
    batch_size=non_negative,
    kv_utilization=st.one_of(st.floats(0, 1), st.sampled_from([0, 1])),
    prefill_tokens_per_s=positive_numbers,
    decode_tokens_per_s=positive_numbers,
    links=st.lists(links, max_size=5, unique_by=lambda link: link.holder).map(tuple),
    ttl_ms=positive_ints,
    requested_state=st.sampled_from([None, "sleeping"]),
    compat_ids=st.none() | st.lists(hex32, max_size=4, unique=True).map(tuple),
    engine=st.booleans(),
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e15, max_value=1e15),
    texts,
)
# At most three levels, well inside the default limits on sampler parameters.
param_values = st.one_of(
    json_scalars,
    st.lists(json_scalars, max_size=3),
    st.dictionaries(texts, json_scalars | st.lists(json_scalars, max_size=2), max_size=3),
)


@st.composite
def samplers(draw):
    method = draw(st.sampled_from(["greedy", "temperature", "top-k", "top-p", "min-p"]))
    params = draw(
        st.dictionaries(st.from_regex(r"x_[a-z]{1,6}", fullmatch=True), param_values, max_size=3)
    )
    if method == "temperature" or (method != "greedy" and draw(st.booleans())):
        params["temperature"] = draw(st.floats(0.01, 5))
    if method == "top-k":
        params["k"] = draw(st.integers(1, 1000))
    if method in ("top-p", "min-p"):
        params["p"] = draw(st.floats(0.01, 1))
    return Sampler(
        method=method,
        params=params,
        seed=draw(st.integers(0, UINT64_MAX)),
        step=draw(non_negative),
        deterministic=draw(st.booleans()),
    )


@st.composite
def checkpoints(draw):
    generated = tuple(draw(st.lists(uint32, max_size=20)))
    return SessionCheckpoint(
        session=draw(uuids),
        epoch=draw(st.integers(1, MAX_SAFE_INTEGER)),
        compat_id=draw(hex32),
        scope_id=draw(hex16),
        prompt_blocks=tuple(draw(st.lists(hex32, max_size=5))),
        prompt_tail=tuple(draw(st.lists(uint32, max_size=20))),
        generated=generated,
        output_offset=draw(st.integers(0, len(generated))),
        sampler=draw(samplers()),
    )


directive_blocks = st.builds(
    DirectiveBlock, hex32, st.lists(holders, min_size=1, max_size=4, unique=True).map(tuple)
)
directives = st.builds(
    PrefetchDirective,
    directive=uuids,
    scope_id=hex16,
    compat_id=hex32,
    blocks=st.lists(directive_blocks, min_size=1, max_size=5, unique_by=lambda b: b.block_key).map(
        tuple
    ),
    deadline_ms=positive_ints,
    lease_ms=positive_ints,
    request_ref=st.none() | texts,
)
directive_statuses = st.builds(
    DirectiveStatusRecord,
    directive=uuids,
    state=st.sampled_from(["pending", "partial", "complete", "failed"]),
    loaded=st.lists(hex32, max_size=5, unique=True).map(tuple),
    reason=st.none() | texts,
)
key_lists = st.lists(hex32, min_size=1, max_size=5, unique=True).map(tuple)
lease_requests = st.builds(LeaseRequest, hex32, hex16, key_lists, positive_ints)
lease_grants = st.builds(
    LeaseGrant,
    st.from_regex(r"[A-Za-z0-9._~-]{1,128}", fullmatch=True),
    hex32,
    hex16,
    key_lists,
    positive_ints,
    non_negative,
)
map_ids = st.from_regex(r"[A-Za-z0-9._~-]{1,20}", fullmatch=True)


@st.composite
def shard_maps(draw):
    start = draw(st.integers(0, 10**6))
    cuts = sorted(draw(st.sets(st.integers(start + 1, start + 10**6), min_size=1, max_size=8)))
    bounds = [start, *cuts]
    shards = tuple(Shard((a, b), draw(base_urls)) for a, b in zip(bounds, bounds[1:], strict=False))
    return ShardMap(draw(map_ids), draw(non_negative), shards)


@st.composite
def reshard_plans(draw):
    # Disjoint ranges, dealt out at random to retain, fetch and release.
    cuts = sorted(draw(st.sets(st.integers(0, 10**6), max_size=12)))
    ranges = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if draw(st.booleans())]
    lists: dict[str, list] = {"retain": [], "fetch": [], "release": []}
    for r in draw(st.permutations(ranges)):
        kind = draw(st.sampled_from(sorted(lists)))
        lists[kind].append(FetchRange(r, draw(base_urls)) if kind == "fetch" else r)
    version = draw(st.integers(0, MAX_SAFE_INTEGER - 1))
    return ReshardPlan(
        map=draw(map_ids),
        from_version=version,
        to_version=version + 1,
        deadline_ms=draw(positive_ints),
        retain=tuple(lists["retain"]),
        fetch=tuple(lists["fetch"]),
        release=tuple(lists["release"]),
        instance=None,
    )


lookups = st.builds(
    LookupRequest,
    hex16,
    hex32,
    st.lists(hex32, max_size=6).map(tuple),
    st.none() | st.lists(base_urls, max_size=4, unique=True).map(tuple),
)
placements = st.builds(
    PlacementRequest,
    hex16,
    hex32,
    st.lists(uint32, min_size=1, max_size=30).map(tuple),
    st.none() | texts,
)

RECORD_STRATEGIES = {
    ReplicaRecord: replica_records(),
    InstanceStatusRecord: status_records,
    SessionCheckpoint: checkpoints(),
    Sampler: samplers(),
    PrefetchDirective: directives,
    DirectiveStatusRecord: directive_statuses,
    LeaseRequest: lease_requests,
    LeaseRenewal: st.builds(LeaseRenewal, positive_ints),
    LeaseGrant: lease_grants,
    ShardMap: shard_maps(),
    ReshardPlan: reshard_plans(),
    ReshardCommit: st.builds(ReshardCommit, map_ids, positive_ints),
    ReshardAbort: st.builds(ReshardAbort, map_ids, positive_ints),
    ReshardRequest: st.builds(
        ReshardRequest,
        shard_maps().map(lambda shard_map: shard_map.shards),
        st.integers(1, MAX_DEADLINE_MS),
    ),
    StateChange: st.builds(StateChange, st.sampled_from(["active", "draining", "sleeping"])),
    OutputToken: st.builds(
        OutputToken,
        st.integers(0, 2**31 - 1),
        st.integers(0, 2**31 - 1),
        uint32,
        st.none() | st.booleans(),
    ),
    LookupRequest: lookups,
    PlacementRequest: placements,
}
any_record = st.one_of(list(RECORD_STRATEGIES.values()))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(any_record)
def test_round_trip(record):
    cls = type(record)
    as_json = record.to_json()
    assert cls.from_json(as_json) == record
    # Through real JSON text as well: floats, big integers and strings survive it.
    again = cls.from_json(json.loads(json.dumps(as_json)))
    assert again == record
    assert again.to_json() == as_json
    hash(record)


@settings(max_examples=100)
@given(st.one_of(reshard_plans(), st.builds(ReshardCommit, map_ids, positive_ints)))
def test_reshard_body_round_trip(record):
    assert parse_reshard_body(record.to_json()) == record


# --- Fuzzing: garbage only ever produces the protocol's own error -----------------------------

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=12),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=25,
)


def decoders():
    return [cls.from_json for cls in RECORD_STRATEGIES] + [parse_reshard_body, parse_output_post]


def only_protocol_errors(decode, value) -> None:
    try:
        decode(value)
    except ProtocolError as error:
        assert error.problem == "kvsp-invalid-record"
        assert isinstance(error.detail, str) and error.detail


@settings(max_examples=300)
@given(json_values)
def test_fuzz_arbitrary_json(value):
    for decode in decoders():
        only_protocol_errors(decode, value)


def _member_names(cls) -> list[str]:
    names = set()
    for doc in [DOCS.get(cls, dict)()]:
        names |= set(doc)
    return sorted(
        names | {"from", "to", "commit", "abort", "moqt_namespace", "compat_ids", "engine"}
    )


@settings(max_examples=300)
@given(st.data())
def test_fuzz_objects_with_the_right_member_names(data):
    cls = data.draw(st.sampled_from(sorted(DOCS, key=lambda c: c.__name__)))
    value = data.draw(st.dictionaries(st.sampled_from(_member_names(cls)), json_values))
    only_protocol_errors(cls.from_json, value)
    only_protocol_errors(parse_reshard_body, value)


def _slots(doc, path=()):
    """Every (path) in a JSON document where a value sits."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield (*path, key)
            yield from _slots(value, (*path, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield (*path, index)
            yield from _slots(value, (*path, index))


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(any_record, st.data())
def test_fuzz_one_member_of_a_valid_record(record, data):
    doc = record.to_json()
    slots = list(_slots(doc))
    if not slots:
        return
    path = data.draw(st.sampled_from(slots))
    value = data.draw(st.one_of(st.just(DELETE), json_values))
    only_protocol_errors(type(record).from_json, edited(doc, path, value))
