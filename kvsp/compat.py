"""Compatibility Descriptor and Compatibility ID (spec 4.1).

    compat_id = SHA-256( "KVSP-COMPAT-1" || 0x00 || JCS(descriptor) )

Two caches may substitute for each other only when their Compatibility IDs are equal, so a
descriptor is validated against every MUST of 4.1 before it is hashed (its members and their
rules are ``kvsp.records.CompatibilityDescriptor``), and the id is always computed here from the
descriptor rather than taken from a peer.

``descriptor_from_model_dir`` builds a descriptor from a Hugging Face style model directory:
geometry, dtype and rotary parameters from ``config.json``, ``model_digest`` over the
``*.safetensors`` files concatenated in ascending byte order of their names, and
``tokenizer_digest`` over ``tokenizer.json`` (else ``tokenizer.model``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import rfc8785

from kvsp.container import DIGEST_PREFIX
from kvsp.hexids import parse_hex32
from kvsp.problems import ProtocolError
from kvsp.records import CompatibilityDescriptor
from kvsp.registries import ELEMENT_TYPES, LAYOUT_1, format_positional

COMPAT_TAG = b"KVSP-COMPAT-1\x00"
_CHUNK_OCTETS = 1 << 20


def _invalid(detail: str) -> ProtocolError:
    return ProtocolError("kvsp-invalid-record", detail)


def validate_descriptor(obj: object) -> dict:
    """A fresh copy of a Compatibility Descriptor that meets every MUST of spec 4.1.

    Raises ``InvalidRecord`` (``kvsp-invalid-record``) naming the first member that is wrong and
    the rule it breaks, or every member missing or not defined by 4.1.
    """
    return CompatibilityDescriptor.from_json(obj).to_json()


def canonical_form(descriptor: object) -> bytes:
    """JCS (RFC 8785) of the validated descriptor: the octets the Compatibility ID covers."""
    return rfc8785.dumps(validate_descriptor(descriptor))


def compat_id(descriptor: object) -> bytes:
    """The 32-octet Compatibility ID of a descriptor, validated first."""
    return hashlib.sha256(COMPAT_TAG + canonical_form(descriptor)).digest()


def compat_id_hex(descriptor: object) -> str:
    """The Compatibility ID as hex32."""
    return compat_id(descriptor).hex()


def verify_compat_id(descriptor: object, claimed_hex: object) -> bytes:
    """Check a peer's claimed id against the descriptor; return the id's octets.

    Raises ``kvsp-compat-mismatch`` when they differ: 4.1 requires the id to be computed, not taken.
    """
    claimed = parse_hex32(claimed_hex, "compat_id")
    actual = compat_id(descriptor)
    if claimed != actual:
        raise ProtocolError(
            "kvsp-compat-mismatch",
            f"compat_id {claimed.hex()} does not match the descriptor, whose compat_id is "
            f"{actual.hex()}",
        )
    return actual


def _unique_members(pairs: list[tuple[str, object]]) -> dict:
    members: dict = {}
    for key, value in pairs:
        if key in members:
            raise ProtocolError("kvsp-malformed-request", f"JSON member {key!r} appears twice")
        members[key] = value
    return members


def _no_constant(name: str) -> object:
    raise ProtocolError("kvsp-malformed-request", f"{name} is not a JSON number")


def loads_json(data: bytes | bytearray | memoryview | str, what: str) -> object:
    """Parse I-JSON (RFC 7493), the input JCS requires: UTF-8, unique member names, no NaN.

    Raises ``kvsp-malformed-request`` saying what is wrong and where.
    """
    if not isinstance(data, str):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ProtocolError(
                "kvsp-malformed-request", f"{what} is not UTF-8 (octet {error.start})"
            ) from None
    try:
        return json.loads(data, object_pairs_hook=_unique_members, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ProtocolError(
            "kvsp-malformed-request",
            f"{what} is not JSON: {error.msg} at line {error.lineno} column {error.colno}",
        ) from None
    except RecursionError:
        raise ProtocolError("kvsp-malformed-request", f"{what} is nested too deeply") from None
    except ValueError as error:
        # Integers longer than the interpreter converts (int_max_str_digits) land here.
        raise ProtocolError(
            "kvsp-malformed-request", f"{what} is not usable JSON: {error}"
        ) from None


def parse_descriptor(data: bytes | bytearray | memoryview | str) -> dict:
    """A validated descriptor from its JSON text."""
    return validate_descriptor(loads_json(data, "the descriptor"))


def _hash_files(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK_OCTETS)
    view = memoryview(buffer)
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as stream:
                while count := stream.readinto(buffer):
                    digest.update(view[:count])
        except OSError as error:
            raise _invalid(f"cannot read {path}: {error.strerror}") from None
    return DIGEST_PREFIX + digest.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """``sha-256:<hex>`` of one file, read in chunks."""
    return _hash_files([Path(path)])


def weights_digest(directory: str | os.PathLike) -> str:
    """``sha-256:<hex>`` of the ``*.safetensors`` files of a directory, as 4.1 defines it.

    The files are hashed as one stream, concatenated in ascending byte order of their names.
    Serves ``model_digest`` and adapter digests alike.
    """
    directory = Path(directory)
    try:
        names = [
            entry.name
            for entry in os.scandir(directory)
            if entry.name.endswith(".safetensors") and entry.is_file()
        ]
    except OSError as error:
        raise _invalid(f"cannot list {directory}: {error.strerror}") from None
    if not names:
        raise _invalid(f"{directory} holds no *.safetensors weight files")
    names.sort(key=os.fsencode)
    return _hash_files(directory / name for name in names)


def _config_integer(config: dict, name: str) -> int:
    if name not in config:
        raise _invalid(f"config.json lacks {name}")
    value = config[name]
    if type(value) is not int or value < 1:
        raise _invalid(f"config.json {name} must be a positive integer, got {value!r}")
    return value


def _config_geometry(config: dict) -> tuple[int, int, int]:
    layers = _config_integer(config, "num_hidden_layers")
    attention_heads = _config_integer(config, "num_attention_heads")
    if config.get("num_key_value_heads") is None:
        kv_heads = attention_heads
    else:
        kv_heads = _config_integer(config, "num_key_value_heads")
    if config.get("head_dim") is not None:
        head_dim = _config_integer(config, "head_dim")
    else:
        hidden_size = _config_integer(config, "hidden_size")
        if hidden_size % attention_heads:
            raise _invalid(
                f"config.json hidden_size {hidden_size} is not a multiple of "
                f"num_attention_heads {attention_heads}, and head_dim is absent"
            )
        head_dim = hidden_size // attention_heads
    return layers, kv_heads, head_dim


def _config_kv_dtype(config: dict) -> str:
    # Transformers 5 writes "dtype", earlier versions "torch_dtype".
    value = config.get("dtype", config.get("torch_dtype"))
    if value is None:
        raise _invalid("config.json has neither dtype nor torch_dtype; pass kv_dtype")
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name not in ELEMENT_TYPES:
        raise _invalid(
            f"config.json dtype {value!r} is not a registered element type; pass kv_dtype"
        )
    return name


def _config_positional(config: dict) -> str:
    # Transformers 5 nests the rotary settings in rope_parameters; earlier versions keep
    # rope_theta at the top and the scaling in rope_scaling.
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        theta = parameters["rope_theta"]
        scaling = parameters
    elif "rope_theta" in config:
        theta = config["rope_theta"]
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise _invalid(f"config.json rope_scaling must be an object or null, got {scaling!r}")
    else:
        raise _invalid("config.json has no rope_theta; pass positional")
    method = factor = None
    if scaling is not None:
        method = scaling.get("rope_type", scaling.get("type"))
        if method == "default":
            method = None
        factor = scaling.get("factor") if method is not None else None
    try:
        return format_positional("rope", theta=theta, scaling=method, factor=factor)
    except ProtocolError as error:
        raise _invalid(
            f"config.json rotary settings do not fit the registry ({error.detail}); pass positional"
        ) from None


def descriptor_from_model_dir(
    path: str | os.PathLike,
    *,
    model: str,
    kv_dtype: str | None = None,
    block_tokens: int,
    positional: str | None = None,
    adapters: Iterable[str] | None = None,
) -> dict:
    """The validated descriptor of a Hugging Face style model directory.

    ``kv_dtype`` defaults to the config's dtype and ``positional`` to ``rope;theta=...`` (with
    scaling and factor when the config scales the rotary embedding). ``adapters`` are adapter
    digests in order of application (``weights_digest`` of each adapter directory); none, or an
    empty list, leaves the member out as 4.1 requires.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise _invalid(f"{directory} is not a directory")
    config_path = directory / "config.json"
    try:
        config_text = config_path.read_bytes()
    except OSError as error:
        raise _invalid(f"cannot read {config_path}: {error.strerror}") from None
    try:
        config = loads_json(config_text, str(config_path))
    except ProtocolError as error:
        raise _invalid(error.detail) from None
    if not isinstance(config, dict):
        raise _invalid(f"{config_path} must hold a JSON object")

    for name in ("tokenizer.json", "tokenizer.model"):
        tokenizer = directory / name
        if tokenizer.is_file():
            break
    else:
        raise _invalid(f"{directory} holds neither tokenizer.json nor tokenizer.model")

    layers, kv_heads, head_dim = _config_geometry(config)
    descriptor = {
        "model": model,
        "model_digest": weights_digest(directory),
        "tokenizer_digest": file_digest(tokenizer),
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype": kv_dtype if kv_dtype is not None else _config_kv_dtype(config),
        "positional": positional if positional is not None else _config_positional(config),
        "block_tokens": block_tokens,
        "layout": LAYOUT_1,
    }
    adapters = list(adapters or ())
    if adapters:
        descriptor["adapters"] = adapters
    return validate_descriptor(descriptor)
