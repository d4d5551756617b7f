"""Path converters for identifiers (DESIGN.md section 3): a malformed id never matches a route."""

from django.urls import register_converter


class Hex16Converter:
    regex = "[0-9a-f]{32}"

    def to_python(self, value: str) -> bytes:
        return bytes.fromhex(value)

    def to_url(self, value: bytes | str) -> str:
        return value.hex() if isinstance(value, bytes) else value


class Hex32Converter(Hex16Converter):
    regex = "[0-9a-f]{64}"


register_converter(Hex16Converter, "hex16")
register_converter(Hex32Converter, "hex32")
