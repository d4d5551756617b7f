"""An answer checked against the type that describes it (``kvsp.records``), for the answers the
index and the PC write on their hot paths without building the type."""

from __future__ import annotations

import orjson


def assert_answers_as(record_type, answer: dict) -> None:
    """``answer`` is what ``record_type`` describes: it decodes, every rule of the type holds,
    and it has no member the type leaves out."""
    decoded = record_type.from_json(answer).to_json()
    assert orjson.loads(orjson.dumps(decoded)) == answer
