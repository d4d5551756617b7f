"""Schemathesis hooks for tests/reliability/test_schemathesis.py (loaded by schemathesis.toml).

Schemathesis knows how to write JSON bodies but not ``application/kvsp-block``: the node's
block PUT takes a KV Block Container. Its bodies are arbitrary octets or small well-formed
containers (codec raw, one to three layers), so that both the container parser's refusals and
the checks past it are reached.
"""

import re

import schemathesis
from hypothesis import strategies as st

from kvsp.container import RAW_CODEC, encode
from kvsp.reprdigest import repr_digest_of


@st.composite
def _container(draw) -> bytes:
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 4))
    section = st.binary(min_size=4 * tokens, max_size=4 * tokens)
    sections = [(draw(section), draw(section)) for _ in range(layers)]
    return encode(RAW_CODEC, 0, tokens, sections)


schemathesis.openapi.media_type(
    "application/kvsp-block", st.one_of(st.binary(min_size=1, max_size=512), _container())
)

_WELL_FORMED_DIGEST = re.compile(r"^sha-256=:[A-Za-z0-9+/]{43}=:$")


@schemathesis.hook
def map_case(context, case):
    """A well-formed Repr-Digest drawn for a block PUT becomes the digest of the drawn body, as
    a real client sends it, so that stores succeed with it too; a missing or malformed one is
    left as drawn (without one the body is checked as a container alone; a malformed one is
    refused, which is what the negative cases test)."""
    headers = case.headers or {}
    digest = headers.get("Repr-Digest")
    if (
        case.method.upper() == "PUT"
        and isinstance(case.body, bytes)
        and isinstance(digest, str)
        and _WELL_FORMED_DIGEST.match(digest)
    ):
        headers["Repr-Digest"] = repr_digest_of(case.body)
    return case
