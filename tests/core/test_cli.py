"""``python -m kvsp`` as a subprocess: each command's output, and one stderr line on bad input."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp.blockkeys import block_keys
from kvsp.compat import compat_id_hex
from tests.support.descriptors import descriptor

ROOT = Path(__file__).resolve().parents[2]
KEY = bytes(range(32, 64))
COMPAT = hashlib.sha256(b"cli").digest()
DESCRIPTOR = descriptor(
    model="example/cli",
    model_digest="sha-256:" + "ab" * 32,
    tokenizer_digest="sha-256:" + "cd" * 32,
    layers=2,
    head_dim=4,
    block_tokens=4,
)


def kvsp(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvsp", *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    return result.stdout.decode()


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """Exit status 2, nothing on stdout, exactly one line on stderr and no traceback."""
    stderr = result.stderr.decode()
    assert result.returncode == 2, (result.returncode, stderr)
    assert result.stdout == b""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and "usage:" not in stderr
    return stderr.rstrip("\n")


def container_bytes(first_layer: int, token_count: int, layers: list[tuple[bytes, bytes]]) -> bytes:
    """A KV Block Container written out from DESIGN.md section 5, independent of kvsp.container."""
    header = b"KVB1" + struct.pack(">BBHIII", 1, 0, 1, first_layer, len(layers), token_count)
    lengths = b"".join(struct.pack(">QQ", len(k), len(v)) for k, v in layers)
    return header + lengths + b"".join(k + v for k, v in layers)


@pytest.fixture
def descriptor_file(tmp_path) -> Path:
    path = tmp_path / "descriptor.json"
    path.write_text(json.dumps(DESCRIPTOR, indent=2))
    return path


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(list(range(100, 111)) + [2**32 - 1]))
    return path


# -- happy paths ---------------------------------------------------------------------------------


def test_compat_id(descriptor_file):
    assert ok(kvsp("compat-id", str(descriptor_file))) == compat_id_hex(DESCRIPTOR) + "\n"
    stdin = json.dumps(DESCRIPTOR).encode()
    assert ok(kvsp("compat-id", "-", stdin=stdin)) == compat_id_hex(DESCRIPTOR) + "\n"


def test_scope_id():
    expected = hashlib.sha256(b"KVSP-SCOPE-1\x00" + KEY).digest()[:16].hex()
    assert ok(kvsp("scope-id", "--key-hex", KEY.hex())) == expected + "\n"
    assert ok(kvsp("scope-id", "--key-hex", KEY.hex().upper())) == expected + "\n"


def test_block_keys(tokens_file):
    tokens = json.loads(tokens_file.read_text())
    expected = "".join(k.hex() + "\n" for k in block_keys(KEY, COMPAT, tokens, 5))
    args = ("block-keys", "--key-hex", KEY.hex(), "--compat-id", COMPAT.hex(), "--block-tokens")
    output = ok(kvsp(*args, "5", str(tokens_file)))
    assert output == expected and output.count("\n") == 2
    assert ok(kvsp(*args, "5", "-", stdin=tokens_file.read_bytes())) == expected
    assert ok(kvsp(*args, "16", str(tokens_file))) == ""


def test_container_inspect(tmp_path):
    layers = [(b"k" * 16, b"v" * 16), (bytes(range(16)), bytes(range(16, 32)))]
    data = container_bytes(first_layer=3, token_count=2, layers=layers)
    path = tmp_path / "block.kvb"
    path.write_bytes(data)
    layer_digests = [hashlib.sha256(k + v).digest() for k, v in layers]
    expected = {
        "version": 1,
        "codec": 1,
        "first_layer": 3,
        "layer_count": 2,
        "token_count": 2,
        "layer_digests": [d.hex() for d in layer_digests],
        "digest": "sha-256:" + hashlib.sha256(b"".join(layer_digests)).hexdigest(),
    }
    assert json.loads(ok(kvsp("container", "inspect", str(path)))) == expected
    assert json.loads(ok(kvsp("container", "inspect", "-", stdin=data))) == expected


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A Hugging Face style directory: the descriptor reads the config and hashes the files."""
    directory = tmp_path / "model"
    directory.mkdir()
    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 128,
        "dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "tokenizer.json").write_bytes(b"tokenizer")
    return directory


def test_descriptor(model_dir):
    args = ("descriptor", str(model_dir), "--model", "example/cli", "--block-tokens", "32")
    descriptor = json.loads(ok(kvsp(*args)))
    assert descriptor == {
        "model": "example/cli",
        "model_digest": "sha-256:" + hashlib.sha256(b"weights").hexdigest(),
        "tokenizer_digest": "sha-256:" + hashlib.sha256(b"tokenizer").hexdigest(),
        "layers": 3,
        "kv_heads": 2,
        "head_dim": 32,
        "kv_dtype": "float32",
        "positional": "rope;theta=10000",
        "block_tokens": 32,
        "layout": "kvsp-layout-1",
    }
    # What it prints is what an operator registers, so compat-id agrees with the descriptor.
    printed = ok(kvsp("compat-id", "-", stdin=json.dumps(descriptor).encode()))
    assert printed == compat_id_hex(descriptor) + "\n"
    half = json.loads(ok(kvsp(*args, "--kv-dtype", "float16")))
    assert half == {**descriptor, "kv_dtype": "float16"}


def test_descriptor_bad_input_gives_one_line(model_dir):
    def descriptor(*args: str) -> str:
        return one_line_error(kvsp("descriptor", *args))

    assert "required: --model" in descriptor(str(model_dir), "--block-tokens", "32")
    missing = descriptor("/nonexistent", "--model", "m", "--block-tokens", "32")
    assert "is not a directory" in missing
    line = descriptor(str(model_dir), "--model", "m", "--block-tokens", "0")
    assert line.startswith("kvsp descriptor: ")
    assert "block_tokens: must be an integer from 1 to" in line
    line = descriptor(str(model_dir), "--model", "m", "--block-tokens", "32", "--kv-dtype", "int8")
    assert "'int8' is not in the KVSP Element Types registry" in line
    (model_dir / "tokenizer.json").unlink()
    line = descriptor(str(model_dir), "--model", "m", "--block-tokens", "32")
    assert "holds neither tokenizer.json nor tokenizer.model" in line


@pytest.mark.parametrize(
    "args", [("--help",), ("block-keys", "--help"), ("container", "inspect", "--help")]
)
def test_help_still_works(args):
    output = ok(kvsp(*args))
    assert output.startswith("usage: kvsp") and output.count("\n") > 3


# -- bad input: exit 2, one line -----------------------------------------------------------------


def block_keys_args(*, key=KEY.hex(), compat=COMPAT.hex(), size="4", file="-"):
    return ("block-keys", "--key-hex", key, "--compat-id", compat, "--block-tokens", size, file)


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        # usage
        ((), b"", "kvsp: the following arguments are required: COMMAND"),
        (("frobnicate",), b"", "kvsp: argument COMMAND: invalid choice: 'frobnicate'"),
        (("compat-id",), b"", "kvsp compat-id: the following arguments are required: FILE"),
        (("scope-id",), b"", "kvsp scope-id: the following arguments are required: --key-hex"),
        (("scope-id", "--key-hex", "00", "extra"), b"", "kvsp: unrecognized arguments: extra"),
        (("container",), b"", "kvsp container: the following arguments are required: ACTION"),
        (("container", "open", "x"), b"", "kvsp container: argument ACTION: invalid choice"),
        (block_keys_args(size="four"), b"[]", "argument --block-tokens: invalid int value"),
        # files and JSON
        (("compat-id", "/nonexistent/d.json"), b"", "cannot read /nonexistent/d.json: No such"),
        (("compat-id", "-"), b"", "the descriptor is not JSON: Expecting value at line 1"),
        (("compat-id", "-"), b'{"model": 1,', "the descriptor is not JSON"),
        (("compat-id", "-"), b"\xff\xfe", "the descriptor is not UTF-8"),
        (("compat-id", "-"), b'{"a": 1, "a": 2}', "JSON member 'a' appears twice"),
        (("compat-id", "-"), b"[" * 50_000, "nested too deeply"),
        # descriptor content
        (("compat-id", "-"), b"[]", "a Compatibility Descriptor must be a JSON object"),
        (
            ("compat-id", "-"),
            json.dumps({**DESCRIPTOR, "kv_dtype": "int8"}).encode(),
            "kv_dtype 'int8' is not in the KVSP Element Types registry",
        ),
        (
            ("compat-id", "-"),
            json.dumps({**DESCRIPTOR, "extra": 1}).encode(),
            "members that spec 4.1 does not define: 'extra'",
        ),
        # keys and ids
        (("scope-id", "--key-hex", "abc"), b"", "--key-hex must be an even number of hex digits"),
        (("scope-id", "--key-hex", "zz" * 32), b"", "--key-hex must be an even number"),
        (("scope-id", "--key-hex", "00" * 31), b"", "the scope key is 31 octets"),
        (block_keys_args(key="00" * 16), b"[1]", "the scope key is 16 octets"),
        (block_keys_args(compat="AB" * 32), b"[1]", "--compat-id must be hex32"),
        (block_keys_args(compat="ab" * 16), b"[1]", "--compat-id must be hex32"),
        (block_keys_args(size="0"), b"[1]", "block_tokens must be an integer in 1..4294967295"),
        # tokens
        (block_keys_args(), b'{"tokens": [1]}', "must hold a JSON array of token ids"),
        (block_keys_args(), b"[1, 2, -3]", "tokens[2] is -3: token ids are integers"),
        (block_keys_args(), b"[4294967296]", "tokens[0] is 4294967296"),
        (block_keys_args(), b"[1, true]", "tokens[1] is True"),
        (block_keys_args(), b"[1.5]", "tokens[0] is 1.5"),
        (block_keys_args(), b'["7"]', "tokens[0] is '7'"),
        (block_keys_args(), b"[NaN]", "NaN is not a JSON number"),
        (block_keys_args(file="/nonexistent/t.json"), b"", "cannot read /nonexistent/t.json"),
        # containers
        (("container", "inspect", "-"), b"", "kvsp container inspect: "),
        (("container", "inspect", "-"), b"garbage that is no container", "kvsp container inspect:"),
        (("container", "inspect", "/nonexistent/c.kvb"), b"", "cannot read /nonexistent/c.kvb"),
    ],
)
def test_bad_input_gives_one_line(args, stdin, message):
    assert message in one_line_error(kvsp(*args, stdin=stdin))


def test_errors_name_the_command():
    line = one_line_error(kvsp(*block_keys_args(), stdin=b"[-1]"))
    assert line.startswith("kvsp block-keys: ")


def test_a_raw_container_no_layout_1_can_have_gives_one_line():
    data = container_bytes(0, 2, [(b"k" * 8, b"v" * 8), (b"k" * 8, b"v" * 6)])
    line = one_line_error(kvsp("container", "inspect", "-", stdin=data))
    assert line.startswith("kvsp container inspect: ") and "layer 1" in line


@pytest.mark.parametrize(
    "mutate",
    [
        lambda data: data[:-1],  # truncated data
        lambda data: data + b"\x00",  # trailing octets
        lambda data: b"KVB2" + data[4:],  # wrong magic
        lambda data: data[:4] + b"\x02" + data[5:],  # version 2
        lambda data: data[:30],  # truncated length table
    ],
)
def test_bad_container_gives_one_line(mutate):
    data = container_bytes(0, 1, [(b"k" * 8, b"v" * 8)])
    line = one_line_error(kvsp("container", "inspect", "-", stdin=mutate(data)))
    assert line.startswith("kvsp container inspect: ")
