"""A node sends the output tokens a checkpoint covers with the checkpoint itself (the extension
member ``output`` of ``PUT CP sessions/{session}/checkpoint``), and posts them as the spec
does when the control plane did not take them: here a stand-in control plane that speaks
only the spec, over real HTTP."""

from __future__ import annotations

import uuid

import pytest

from kvsp.records import SessionCheckpoint
from tests.support.standin import StandinNode
from workers import control_plane


def checkpoint(session: str) -> SessionCheckpoint:
    return SessionCheckpoint.from_json(
        {
            "session": session,
            "epoch": 1,
            "compat_id": "ab" * 32,
            "scope_id": "cd" * 16,
            "prompt_blocks": [],
            "prompt_tail": [1, 2, 3],
            "generated": [7, 8],
            "output_offset": 2,
            "sampler": {
                "method": "greedy",
                "params": {},
                "seed": 0,
                "step": 2,
                "deterministic": True,
            },
        }
    )


TOKENS = [{"epoch": 1, "index": 0, "token": 7}, {"epoch": 1, "index": 1, "token": 8}]


@pytest.fixture
def standin(settings):
    with StandinNode() as standin:
        settings.KVSP_CONTROL_URL = standin.url
        settings.KVSP_TOKEN = "node-token"
        yield standin


def test_tokens_go_with_the_checkpoint_when_the_control_plane_takes_them(standin):
    session = str(uuid.uuid4())
    path = f"/kvsp/sessions/{session}/checkpoint"
    taken = {"session": session, "epoch": 1, "stored": [0, 1], "duplicates": [], "delivered": 2}
    answer = {"session": session, "epoch": 1, "output_offset": 2, "output": taken}
    standin.answers[("PUT", path)] = (200, answer)
    assert control_plane.put_checkpoint(checkpoint(session), release=TOKENS) == 2
    (sent,) = standin.received("PUT", path)
    assert sent["output"] == TOKENS and sent["output_offset"] == 2
    assert standin.received("POST", f"/kvsp/sessions/{session}/output") == []


def test_a_control_plane_that_ignores_them_gets_them_posted(standin):
    session = str(uuid.uuid4())
    path = f"/kvsp/sessions/{session}/checkpoint"
    answer = {"session": session, "epoch": 1, "output_offset": 2}
    standin.answers[("PUT", path)] = (200, answer)
    assert control_plane.put_checkpoint(checkpoint(session), release=TOKENS) == 2
    assert standin.received("POST", f"/kvsp/sessions/{session}/output") == [TOKENS]


def test_a_checkpoint_alone_carries_no_output(standin):
    session = str(uuid.uuid4())
    path = f"/kvsp/sessions/{session}/checkpoint"
    standin.answers[("PUT", path)] = (200, {"epoch": 1, "output_offset": 2})
    assert control_plane.put_checkpoint(checkpoint(session)) == 2
    (sent,) = standin.received("PUT", path)
    assert "output" not in sent
    assert standin.received("POST", f"/kvsp/sessions/{session}/output") == []
