"""Compatibility Descriptor and Compatibility ID (spec 4.1)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from kvsp.compat import (
    COMPAT_TAG,
    canonical_form,
    compat_id,
    compat_id_hex,
    descriptor_from_model_dir,
    file_digest,
    loads_json,
    parse_descriptor,
    validate_descriptor,
    verify_compat_id,
    weights_digest,
)
from kvsp.problems import ProtocolError
from tests.support.descriptors import SMALL_MODEL
from tests.support.descriptors import descriptor as make_descriptor


def sha(text: str) -> str:
    return "sha-256:" + hashlib.sha256(text.encode()).hexdigest()


# -- RFC 8785 through the rfc8785 package --------------------------------------------------------

# RFC 8785 Appendix B: IEEE 754 bit patterns and their JCS serialization.
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_rfc8785_number_serialization(bits, expected):
    (number,) = struct.unpack(">d", bytes.fromhex(bits))
    assert rfc8785.dumps(number) == expected.encode()


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000"])
def test_rfc8785_rejects_nan_and_infinity(bits):
    (number,) = struct.unpack(">d", bytes.fromhex(bits))
    with pytest.raises(rfc8785.CanonicalizationError):
        rfc8785.dumps(number)


def test_rfc8785_property_sorting_example():
    # RFC 8785 section 3.2.3: members sort by UTF-16 code units, so U+1F600 (D83D DE00) sorts
    # before U+FB33, unlike code point order.
    source = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    values = [value for value in json.loads(rfc8785.dumps(source)).values()]
    assert values == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]


def test_rfc8785_canonicalization_example():
    # RFC 8785 sections 3.2.2 to 3.2.4: the input text, parsed, and its canonical UTF-8 octets.
    source = r"""{
      "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
      "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
      "literals": [null, true, false]
    }"""
    expected = bytes.fromhex(
        """
        7b 22 6c 69 74 65 72 61 6c 73 22 3a 5b 6e 75 6c 6c 2c 74 72
        75 65 2c 66 61 6c 73 65 5d 2c 22 6e 75 6d 62 65 72 73 22 3a
        5b 33 33 33 33 33 33 33 33 33 2e 33 33 33 33 33 33 33 2c 31
        65 2b 33 30 2c 34 2e 35 2c 30 2e 30 30 32 2c 31 65 2d 32 37
        5d 2c 22 73 74 72 69 6e 67 22 3a 22 e2 82 ac 24 5c 75 30 30
        30 66 5c 6e 41 27 42 5c 22 5c 5c 5c 5c 5c 22 2f 22 7d
        """
    )
    assert rfc8785.dumps(json.loads(source)) == expected


# -- validation: every MUST of 4.1 -------------------------------------------------------------


def test_valid_descriptor_is_returned_as_a_fresh_copy():
    source = make_descriptor(adapters=[sha("a1"), sha("a2")])
    validated = validate_descriptor(source)
    assert validated == source
    validated["adapters"].append(sha("a3"))
    assert len(source["adapters"]) == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "é-model \u20ac"},
        {"adapters": [sha("a1")]},
        {"adapters": (sha("a1"), sha("a1"))},
        {"kv_dtype": "float32"},
        {"kv_dtype": "float8_e5m2"},
        {"positional": "alibi"},
        {"positional": "none"},
        {"positional": "learned"},
        {"positional": "rope"},
        {"positional": "rope;theta=10000,scaling=linear,factor=2"},
        {"layers": 1, "kv_heads": 1, "head_dim": 1, "block_tokens": 1},
        {"layers": 2**32 - 1, "block_tokens": 2**32 - 1, "kv_heads": 2**53 - 1},
    ],
)
def test_accepts(changes):
    validate_descriptor(make_descriptor(**changes))


_DIGEST_RULE = '{}: must be "sha-256:" followed by 64 lowercase hex digits'
_ADAPTERS_RULE = "adapters: must be absent when no adapter is applied, else a non-empty array"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model": ""}, "model: must be a non-empty string"),
        ({"model": 7}, "model: must be a non-empty string"),
        ({"model": None}, "model: must be a non-empty string"),
        ({"model": "a\ud800b"}, "model: must be valid Unicode (it holds a lone surrogate)"),
        ({"model_digest": "sha-256:" + "A" * 64}, _DIGEST_RULE.format("model_digest")),
        ({"model_digest": "sha-256:" + "a" * 63}, _DIGEST_RULE.format("model_digest")),
        ({"model_digest": "sha256:" + "a" * 64}, _DIGEST_RULE.format("model_digest")),
        ({"model_digest": "SHA-256:" + "a" * 64}, _DIGEST_RULE.format("model_digest")),
        ({"model_digest": "a" * 64}, _DIGEST_RULE.format("model_digest")),
        ({"model_digest": "sha-256:" + "a" * 64 + "\n"}, _DIGEST_RULE.format("model_digest")),
        ({"tokenizer_digest": None}, _DIGEST_RULE.format("tokenizer_digest")),
        ({"adapters": []}, _ADAPTERS_RULE),
        ({"adapters": sha("a1")}, _ADAPTERS_RULE),
        ({"adapters": None}, _ADAPTERS_RULE),
        ({"adapters": [sha("a1"), "sha-256:xyz"]}, _DIGEST_RULE.format("adapters[1]")),
        ({"layers": 0}, "layers: must be an integer from 1 to 4294967295"),
        ({"layers": -3}, "layers: must be an integer from 1 to 4294967295"),
        ({"layers": 2**32}, "layers: must be an integer from 1 to 4294967295"),
        ({"layers": True}, "layers: must be an integer from 1 to 4294967295"),
        ({"layers": 32.0}, "layers: must be an integer from 1 to 4294967295"),
        ({"layers": "32"}, "layers: must be an integer from 1 to 4294967295"),
        ({"kv_heads": False}, "kv_heads: must be an integer from 1 to 9007199254740991"),
        ({"kv_heads": 2**53}, "kv_heads: must be an integer from 1 to 9007199254740991"),
        ({"head_dim": 0}, "head_dim: must be an integer from 1 to 9007199254740991"),
        ({"head_dim": None}, "head_dim: must be an integer from 1 to 9007199254740991"),
        ({"block_tokens": 0}, "block_tokens: must be an integer from 1 to 4294967295"),
        ({"block_tokens": [16]}, "block_tokens: must be an integer from 1 to 4294967295"),
        ({"kv_dtype": "float64"}, "kv_dtype 'float64' is not in the KVSP Element Types registry"),
        ({"kv_dtype": "BFLOAT16"}, "kv_dtype 'BFLOAT16' is not in the KVSP Element Types"),
        ({"positional": "rotary"}, "not in the KVSP Positional Encodings registry"),
        ({"positional": "rope;theta=5e5"}, "write theta=500000"),
        ({"positional": "alibi;theta=1"}, "alibi takes no parameters"),
        ({"positional": 10000}, "positional: must be a string"),
        ({"layout": "kvsp-layout-2"}, "layout 'kvsp-layout-2' is not registered"),
        ({"kv_dtype": 7}, "kv_dtype: must name an entry of the KVSP Element Types registry"),
        ({"layout": None}, "layout: must name a registered layout"),
    ],
)
def test_rejects(changes, reason):
    with pytest.raises(ProtocolError) as caught:
        validate_descriptor(make_descriptor(**changes))
    assert caught.value.problem == "kvsp-invalid-record"
    assert reason in caught.value.detail


def test_the_test_descriptor_has_the_members_4_1_requires_in_its_order():
    assert list(SMALL_MODEL) == [
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
    ]


@pytest.mark.parametrize("member", list(SMALL_MODEL))
def test_every_required_member_is_required(member):
    descriptor = make_descriptor()
    del descriptor[member]
    with pytest.raises(ProtocolError, match=f"lacks required members: {member}$"):
        validate_descriptor(descriptor)


def test_missing_members_are_listed_together():
    with pytest.raises(ProtocolError, match="lacks required members: layers, kv_heads, layout"):
        validate_descriptor(
            {
                k: v
                for k, v in make_descriptor().items()
                if k not in ("layers", "kv_heads", "layout")
            }
        )


@pytest.mark.parametrize(
    "extra", [{"adapter": [sha("a")]}, {"comment": "x"}, {"Model": "m"}, {1: "x"}]
)
def test_unknown_members_are_rejected(extra):
    descriptor = make_descriptor()
    descriptor.update(extra)
    with pytest.raises(ProtocolError) as caught:
        validate_descriptor(descriptor)
    assert "members that spec 4.1 does not define" in caught.value.detail
    assert repr(next(iter(extra))) in caught.value.detail


@pytest.mark.parametrize("value", [None, [], "descriptor", 3])
def test_descriptor_must_be_an_object(value):
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        validate_descriptor(value)


# -- the id --------------------------------------------------------------------------------------


def test_compat_id_is_sha256_of_tag_zero_and_jcs():
    descriptor = make_descriptor(adapters=[sha("a1")])
    # JCS of this descriptor written out: members in UTF-16 order, no whitespace.
    jcs = "".join(
        [
            f'{{"adapters":["{sha("a1")}"],"block_tokens":16,"head_dim":16,',
            '"kv_dtype":"float16","kv_heads":2,"layers":4,"layout":"kvsp-layout-1",',
            '"model":"test-llama",',
            f'"model_digest":"sha-256:{"1" * 64}","positional":"rope;theta=10000",',
            f'"tokenizer_digest":"sha-256:{"2" * 64}"}}',
        ]
    )
    assert canonical_form(descriptor) == jcs.encode()
    expected = hashlib.sha256(b"KVSP-COMPAT-1" + b"\x00" + jcs.encode()).digest()
    assert COMPAT_TAG == b"KVSP-COMPAT-1\x00"
    assert compat_id(descriptor) == expected
    assert len(compat_id(descriptor)) == 32
    assert compat_id_hex(descriptor) == expected.hex()


def test_non_ascii_model_is_hashed_as_utf8():
    descriptor = make_descriptor(model="modèle/€")
    assert '"model":"modèle/€"'.encode() in canonical_form(descriptor)


def test_every_member_changes_the_id():
    base = compat_id(make_descriptor())
    variants = [
        {"model": "example/other"},
        {"model_digest": sha("other weights")},
        {"tokenizer_digest": sha("other tokenizer")},
        {"adapters": [sha("a1")]},
        {"layers": 33},
        {"kv_heads": 4},
        {"head_dim": 64},
        {"kv_dtype": "bfloat16"},
        {"positional": "rope;theta=500000"},
        {"block_tokens": 32},
    ]
    ids = {compat_id(make_descriptor(**changes)) for changes in variants}
    assert base not in ids and len(ids) == len(variants)


def test_adapter_order_matters():
    one = compat_id(make_descriptor(adapters=[sha("a1"), sha("a2")]))
    other = compat_id(make_descriptor(adapters=[sha("a2"), sha("a1")]))
    assert one != other


def test_compat_id_validates_first():
    with pytest.raises(ProtocolError, match="adapters: must be absent when no adapter is applied"):
        compat_id(make_descriptor(adapters=[]))


def test_verify_compat_id():
    descriptor = make_descriptor()
    assert verify_compat_id(descriptor, compat_id_hex(descriptor)) == compat_id(descriptor)
    other = compat_id_hex(make_descriptor(layers=31))
    with pytest.raises(ProtocolError) as caught:
        verify_compat_id(descriptor, other)
    assert caught.value.problem == "kvsp-compat-mismatch"
    assert other in caught.value.detail and compat_id_hex(descriptor) in caught.value.detail


@pytest.mark.parametrize("claimed", ["AB" * 32, "ab" * 31, None, 5, "g" * 64])
def test_verify_compat_id_rejects_malformed_claims(claimed):
    with pytest.raises(ProtocolError) as caught:
        verify_compat_id(make_descriptor(), claimed)
    assert caught.value.problem == "kvsp-invalid-record"
    assert "compat_id must be hex32" in caught.value.detail


# -- parsing JSON text ---------------------------------------------------------------------------


def test_parse_descriptor_from_text_and_octets():
    text = json.dumps(make_descriptor(), indent=3)
    assert parse_descriptor(text) == make_descriptor()
    assert parse_descriptor(text.encode()) == make_descriptor()
    assert parse_descriptor(memoryview(text.encode())) == make_descriptor()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b'{"model": "a", "model": "b"}', "member 'model' appears twice"),
        (b'{"layers": NaN}', "NaN is not a JSON number"),
        (b'{"layers": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"model": "\xff"}', "not UTF-8 (octet 11)"),
        (b'{"model": "a",}', "is not JSON: Expecting property name"),
        (b"", "is not JSON: Expecting value at line 1 column 1"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"layers": ' + b"9" * 5000 + b"}", "is not usable JSON"),
    ],
)
def test_parse_descriptor_rejects_malformed_json(text, reason):
    with pytest.raises(ProtocolError) as caught:
        parse_descriptor(text)
    assert caught.value.problem == "kvsp-malformed-request"
    assert reason in caught.value.detail


def test_loads_json_names_what_it_parses():
    with pytest.raises(ProtocolError, match="^the token file is not JSON"):
        loads_json("[1,", "the token file")


_WHITESPACE = st.text(alphabet=" \t\r\n", max_size=3)


@st.composite
def descriptor_texts(draw):
    """A valid descriptor, and a JSON text of it with members shuffled and whitespace added."""
    descriptor = make_descriptor(
        model=draw(
            st.text(min_size=1).filter(lambda s: not any(0xD800 <= ord(c) < 0xE000 for c in s))
        ),
        layers=draw(st.integers(1, 2**32 - 1)),
        kv_heads=draw(st.integers(1, 2**53 - 1)),
        head_dim=draw(st.integers(1, 4096)),
        block_tokens=draw(st.integers(1, 2**32 - 1)),
        kv_dtype=draw(st.sampled_from(["float32", "float16", "bfloat16", "float8_e4m3fn"])),
        positional=draw(st.sampled_from(["rope;theta=10000", "alibi", "none", "rope"])),
    )
    if draw(st.booleans()):
        descriptor["adapters"] = [sha(str(i)) for i in range(draw(st.integers(1, 3)))]
    keys = draw(st.permutations(list(descriptor)))
    ensure_ascii = draw(st.booleans())
    members = []
    for key in keys:
        value = json.dumps(descriptor[key], ensure_ascii=ensure_ascii)
        if isinstance(descriptor[key], list):
            value = (
                "["
                + ",".join(
                    draw(_WHITESPACE) + json.dumps(item) + draw(_WHITESPACE)
                    for item in descriptor[key]
                )
                + "]"
            )
        members.append(
            draw(_WHITESPACE)
            + json.dumps(key)
            + draw(_WHITESPACE)
            + ":"
            + draw(_WHITESPACE)
            + value
        )
    text = draw(_WHITESPACE) + "{" + ",".join(members) + draw(_WHITESPACE) + "}" + draw(_WHITESPACE)
    return descriptor, text


@given(descriptor_texts())
def test_member_order_and_whitespace_never_change_the_id(case):
    descriptor, text = case
    assert compat_id(parse_descriptor(text)) == compat_id(descriptor)
    assert compat_id(parse_descriptor(text.encode("utf-8"))) == compat_id(descriptor)


# -- the builder ---------------------------------------------------------------------------------

LLAMA_CONFIG_V5 = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "head_dim": 32,
    "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}

DROP = object()


def config_with(**changes) -> dict:
    """LLAMA_CONFIG_V5 with members changed; a member changed to DROP is left out."""
    config = {**LLAMA_CONFIG_V5, **changes}
    return {key: value for key, value in config.items() if value is not DROP}


def make_model_dir(tmp_path, config=None, *, tokenizer=("tokenizer.json",)):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config or LLAMA_CONFIG_V5))
    # Created in an order different from the byte order of their names, which is
    # "B.safetensors" (0x42) < "a.safetensors" (0x61) < "model-00001..." < "model-00002...".
    files = {
        "model-00002-of-00002.safetensors": b"second shard " * 100,
        "a.safetensors": b"lowercase a",
        "model-00001-of-00002.safetensors": bytes(range(256)) * (5 * 4096 + 3),
        "B.safetensors": b"uppercase B",
    }
    for name, content in files.items():
        (directory / name).write_bytes(content)
    (directory / "model.safetensors.index.json").write_text("{}")
    (directory / "notes.txt").write_text("not a weight file")
    (directory / "sub.safetensors").mkdir()
    for name in tokenizer:
        (directory / name).write_bytes(name.encode() * 3)
    ordered = b"".join(files[name] for name in sorted(files, key=str.encode))
    return directory, "sha-256:" + hashlib.sha256(ordered).hexdigest()


def test_builder_reads_a_model_directory(tmp_path):
    directory, weights = make_model_dir(tmp_path)
    descriptor = descriptor_from_model_dir(directory, model="test/llama", block_tokens=16)
    assert descriptor == {
        "model": "test/llama",
        "model_digest": weights,
        "tokenizer_digest": "sha-256:" + hashlib.sha256(b"tokenizer.json" * 3).hexdigest(),
        "layers": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "kv_dtype": "bfloat16",
        "positional": "rope;theta=10000",
        "block_tokens": 16,
        "layout": "kvsp-layout-1",
    }
    assert weights_digest(directory) == weights


def test_weights_are_hashed_in_ascending_byte_order_not_creation_order(tmp_path):
    directory, weights = make_model_dir(tmp_path)
    creation_order = b"".join(
        (directory / name).read_bytes()
        for name in (
            "model-00002-of-00002.safetensors",
            "a.safetensors",
            "model-00001-of-00002.safetensors",
            "B.safetensors",
        )
    )
    case_insensitive = b"".join(
        (directory / name).read_bytes()
        for name in sorted(
            (p.name for p in directory.glob("*.safetensors") if p.is_file()), key=str.lower
        )
    )
    assert weights != "sha-256:" + hashlib.sha256(creation_order).hexdigest()
    assert weights != "sha-256:" + hashlib.sha256(case_insensitive).hexdigest()
    assert descriptor_from_model_dir(directory, model="m", block_tokens=16)["model_digest"] == (
        weights
    )


def test_builder_falls_back_to_tokenizer_model(tmp_path):
    directory, _ = make_model_dir(tmp_path, tokenizer=("tokenizer.model",))
    descriptor = descriptor_from_model_dir(directory, model="m", block_tokens=16)
    expected = "sha-256:" + hashlib.sha256(b"tokenizer.model" * 3).hexdigest()
    assert descriptor["tokenizer_digest"] == expected


def test_builder_prefers_tokenizer_json(tmp_path):
    directory, _ = make_model_dir(tmp_path, tokenizer=("tokenizer.model", "tokenizer.json"))
    descriptor = descriptor_from_model_dir(directory, model="m", block_tokens=16)
    assert descriptor["tokenizer_digest"] == file_digest(directory / "tokenizer.json")


def test_builder_arguments_override_the_config(tmp_path):
    directory, _ = make_model_dir(tmp_path)
    adapters = [sha("adapter 1"), sha("adapter 2")]
    descriptor = descriptor_from_model_dir(
        directory,
        model="m",
        kv_dtype="float8_e4m3fn",
        block_tokens=32,
        positional="rope;theta=20000",
        adapters=adapters,
    )
    assert descriptor["kv_dtype"] == "float8_e4m3fn"
    assert descriptor["positional"] == "rope;theta=20000"
    assert descriptor["block_tokens"] == 32
    assert descriptor["adapters"] == adapters


def test_builder_leaves_out_an_empty_adapter_list(tmp_path):
    directory, _ = make_model_dir(tmp_path)
    assert "adapters" not in descriptor_from_model_dir(
        directory, model="m", block_tokens=16, adapters=[]
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # Transformers 4: rope_theta at the top, scaling in rope_scaling, torch_dtype.
        (
            {
                "rope_parameters": DROP,
                "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
                "dtype": DROP,
                "torch_dtype": "float16",
            },
            {"positional": "rope;theta=500000,scaling=llama3,factor=8", "kv_dtype": "float16"},
        ),
        (
            {"rope_parameters": DROP, "rope_theta": 10000, "rope_scaling": None},
            {"positional": "rope;theta=10000"},
        ),
        (
            {
                "rope_parameters": DROP,
                "rope_theta": 1e6,
                "rope_scaling": {"type": "linear", "factor": 2},
            },
            {"positional": "rope;theta=1000000,scaling=linear,factor=2"},
        ),
        (
            {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}},
            {"positional": "rope;theta=10000,scaling=yarn,factor=4"},
        ),
        ({"rope_parameters": {"rope_theta": 0.5, "factor": 4.0}}, {"positional": "rope;theta=0.5"}),
        ({"head_dim": DROP}, {"head_dim": 32}),
        ({"head_dim": None, "hidden_size": 512}, {"head_dim": 64}),
        ({"num_key_value_heads": DROP}, {"kv_heads": 8}),
        ({"num_key_value_heads": None}, {"kv_heads": 8}),
        ({"dtype": "torch.float32"}, {"kv_dtype": "float32"}),
    ],
)
def test_builder_reads_config_variants(tmp_path, changes, expected):
    directory, _ = make_model_dir(tmp_path, config_with(**changes))
    descriptor = descriptor_from_model_dir(directory, model="m", block_tokens=16)
    assert {key: descriptor[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"num_hidden_layers": DROP}, "config.json lacks num_hidden_layers"),
        ({"num_attention_heads": DROP}, "config.json lacks num_attention_heads"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers must be a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
        ({"head_dim": DROP, "hidden_size": DROP}, "config.json lacks hidden_size"),
        ({"head_dim": DROP, "hidden_size": 250}, "not a multiple of num_attention_heads 8"),
        ({"dtype": DROP}, "neither dtype nor torch_dtype; pass kv_dtype"),
        ({"dtype": "float64"}, "'float64' is not a registered element type; pass kv_dtype"),
        ({"dtype": ["bfloat16"]}, "is not a registered element type; pass kv_dtype"),
        ({"rope_parameters": DROP}, "config.json has no rope_theta; pass positional"),
        ({"rope_parameters": {"full_attention": {}}}, "no rope_theta; pass positional"),
        ({"rope_parameters": {"rope_theta": "big"}}, "theta must be a number"),
        ({"rope_parameters": {"rope_theta": 0}}, "theta must be positive"),
        ({"rope_parameters": {"rope_theta": 1.0, "rope_type": "Dyn"}}, "is not a name"),
        (
            {"rope_parameters": DROP, "rope_theta": 10000.0, "rope_scaling": "linear"},
            "rope_scaling must be an object or null",
        ),
    ],
)
def test_builder_rejects_bad_configs(tmp_path, changes, reason):
    directory, _ = make_model_dir(tmp_path, config_with(**changes))
    with pytest.raises(ProtocolError) as caught:
        descriptor_from_model_dir(directory, model="m", block_tokens=16)
    assert caught.value.problem == "kvsp-invalid-record"
    assert reason in caught.value.detail


def test_builder_rejects_missing_files(tmp_path):
    with pytest.raises(ProtocolError, match="is not a directory"):
        descriptor_from_model_dir(tmp_path / "absent", model="m", block_tokens=16)

    directory, _ = make_model_dir(tmp_path)
    (directory / "config.json").unlink()
    with pytest.raises(ProtocolError, match=r"cannot read .*config\.json: No such file"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16)

    (directory / "config.json").write_text("{not json")
    with pytest.raises(ProtocolError, match=r"config\.json is not JSON"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16)

    (directory / "config.json").write_text("[]")
    with pytest.raises(ProtocolError, match="must hold a JSON object"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16)

    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG_V5))
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ProtocolError, match="neither tokenizer.json nor tokenizer.model"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16)

    (directory / "tokenizer.json").write_text("{}")
    for weights in directory.glob("*.safetensors"):
        if weights.is_file():
            weights.unlink()
    with pytest.raises(ProtocolError, match=r"holds no \*\.safetensors weight files"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16)


def test_builder_validates_its_result(tmp_path):
    directory, _ = make_model_dir(tmp_path)
    with pytest.raises(ProtocolError, match="model: must be a non-empty string"):
        descriptor_from_model_dir(directory, model="", block_tokens=16)
    with pytest.raises(ProtocolError, match="block_tokens: must be an integer from 1 to"):
        descriptor_from_model_dir(directory, model="m", block_tokens=0)
    with pytest.raises(ProtocolError, match="not in the KVSP Positional Encodings registry"):
        descriptor_from_model_dir(directory, model="m", block_tokens=16, positional="xpos")
    with pytest.raises(ProtocolError, match=r'adapters\[0\]: must be "sha-256:"'):
        descriptor_from_model_dir(directory, model="m", block_tokens=16, adapters=["lora"])


def test_file_digest_reads_past_the_chunk_size(tmp_path):
    path = tmp_path / "big.bin"
    content = bytes(range(251)) * 12_000  # about 2.9 MiB: several 1 MiB reads, a short last one
    path.write_bytes(content)
    assert file_digest(path) == "sha-256:" + hashlib.sha256(content).hexdigest()
    with pytest.raises(ProtocolError, match="cannot read"):
        file_digest(tmp_path / "absent.bin")
