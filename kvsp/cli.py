"""``python -m kvsp``: the core's identifiers and containers from the command line (DESIGN.md 6).

    python -m kvsp compat-id FILE
    python -m kvsp scope-id --key-hex HEX
    python -m kvsp block-keys --key-hex HEX --compat-id HEX --block-tokens B FILE
    python -m kvsp container inspect FILE
    python -m kvsp descriptor MODEL_DIR --model NAME --block-tokens B [--kv-dtype TYPE]

FILE may be ``-`` for standard input. Bad input of any kind exits with status 2 and exactly one
line on standard error that says what is wrong: scripts read that line, so it is never a
traceback and never argparse's usage block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence

from kvsp.blockkeys import block_keys, scope_id_hex
from kvsp.compat import compat_id_hex, descriptor_from_model_dir, loads_json, parse_descriptor
from kvsp.hexids import parse_hex32
from kvsp.problems import ProtocolError

EXIT_BAD_INPUT = 2

_KEY_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


class BadInput(Exception):
    """Input a command cannot use, other than a ProtocolError; its message says what is wrong."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line, like every other error here."""

    def error(self, message: str) -> None:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:
        if message:
            _say(message)
        raise SystemExit(status)


def _say(message: str) -> None:
    sys.stderr.write(" ".join(message.split()) + "\n")


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as error:
        raise BadInput(f"cannot read {path}: {error.strerror}") from None


def _key(text: str) -> bytes:
    if _KEY_HEX.fullmatch(text) is None:
        raise BadInput("--key-hex must be an even number of hex digits")
    return bytes.fromhex(text)


def _compat_id(args: argparse.Namespace) -> None:
    print(compat_id_hex(parse_descriptor(_read(args.file))))


def _scope_id(args: argparse.Namespace) -> None:
    print(scope_id_hex(_key(args.key_hex)))


def _block_keys(args: argparse.Namespace) -> None:
    key = _key(args.key_hex)
    compat = parse_hex32(args.compat_id, "--compat-id", "kvsp-malformed-request")
    tokens = loads_json(_read(args.file), f"the token file {args.file}")
    if not isinstance(tokens, list):
        raise BadInput(f"{args.file} must hold a JSON array of token ids")
    keys = block_keys(key, compat, tokens, args.block_tokens)
    sys.stdout.write("".join(f"{block_key.hex()}\n" for block_key in keys))


def _container_inspect(args: argparse.Namespace) -> None:
    # Only this command needs the container codec; the identifier commands stay light.
    from kvsp import container

    decoded = container.decode(_read(args.file))
    digests = decoded.layer_digests()
    summary = {
        "version": decoded.version,
        "codec": decoded.codec,
        "first_layer": decoded.first_layer,
        "layer_count": decoded.layer_count,
        "token_count": decoded.token_count,
        "layer_digests": [digest.hex() for digest in digests],
        "digest": container.replica_digest(digests),
    }
    print(json.dumps(summary, indent=2))


def _descriptor(args: argparse.Namespace) -> None:
    descriptor = descriptor_from_model_dir(
        args.model_dir, model=args.model, block_tokens=args.block_tokens, kv_dtype=args.kv_dtype
    )
    print(json.dumps(descriptor, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvsp", description="KVSP protocol core: identifiers and containers.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    command = commands.add_parser(
        "compat-id", help="the Compatibility ID (hex32) of a descriptor (spec 4.1)"
    )
    command.add_argument("file", metavar="FILE", help="descriptor JSON file, or - for stdin")
    command.set_defaults(run=_compat_id, prog=command.prog)

    command = commands.add_parser("scope-id", help="the Scope ID (hex16) of a scope key (4.2)")
    command.add_argument("--key-hex", required=True, metavar="HEX", help="the scope key in hex")
    command.set_defaults(run=_scope_id, prog=command.prog)

    command = commands.add_parser(
        "block-keys", help="the Block Keys (hex32, one a line) of a token sequence (4.2)"
    )
    command.add_argument("--key-hex", required=True, metavar="HEX", help="the scope key in hex")
    command.add_argument("--compat-id", required=True, metavar="HEX", help="the compat id, hex32")
    command.add_argument(
        "--block-tokens", required=True, type=int, metavar="B", help="the block size in tokens"
    )
    command.add_argument("file", metavar="FILE", help="JSON array of token ids, or - for stdin")
    command.set_defaults(run=_block_keys, prog=command.prog)

    command = commands.add_parser("container", help="KV Block Containers (4.3)")
    actions = command.add_subparsers(dest="action", metavar="ACTION", required=True)
    action = actions.add_parser(
        "inspect", help="header, layer digests and replica digest of a container, as JSON"
    )
    action.add_argument("file", metavar="FILE", help="container file, or - for stdin")
    action.set_defaults(run=_container_inspect, prog=action.prog)

    command = commands.add_parser(
        "descriptor",
        help="the Compatibility Descriptor (JSON, 4.1) of a Hugging Face model directory",
    )
    command.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    command.add_argument(
        "--model", required=True, metavar="NAME", help="the model name every party uses"
    )
    command.add_argument(
        "--block-tokens", required=True, type=int, metavar="B", help="the block size in tokens"
    )
    command.add_argument(
        "--kv-dtype",
        metavar="TYPE",
        help="the element type of the cache, when it is not the config's dtype",
    )
    command.set_defaults(run=_descriptor, prog=command.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
        sys.stdout.flush()
    except (BadInput, ProtocolError) as error:
        detail = error.detail if isinstance(error, ProtocolError) else str(error)
        _say(f"{args.prog}: {detail}")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # The reader went away (``| head``); point stdout at nothing so the flush at exit is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
