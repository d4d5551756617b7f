"""Schemathesis hooks for tests/reliability/test_schemathesis.py (loaded by schemathesis.toml).

Schemathesis knows how to write JSON bodies but not ``application/kvsp-block``: the node's
block PUT takes a KV Block Container. Its bodies are arbitrary octets or small well-formed
containers (codec raw, one to three layers), so that both the container parser's refusals and
the checks past it are reached.
"""

import schemathesis
from hypothesis import strategies as st

from kvsp.container import RAW_CODEC, encode


@st.composite
def _container(draw) -> bytes:
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 4))
    section = st.binary(min_size=4 * tokens, max_size=4 * tokens)
    sections = [(draw(section), draw(section)) for _ in range(layers)]
    return encode(RAW_CODEC, 0, tokens, sections)


schemathesis.openapi.media_type(
    "application/kvsp-block", st.one_of(st.binary(max_size=512), _container())
)
