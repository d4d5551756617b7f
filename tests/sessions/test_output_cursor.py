"""The cursor of the output stream (``after``, ``Last-Event-ID``) is a number in ASCII digits:
``int()`` would also read other scripts' digits, a sign or spaces."""

import uuid

import pytest

from tests.sessions.test_checkpoints_and_output import checkpoint, post, put
from tests.support.fixtures import body, make_instance, problem_name, report, status_record

pytestmark = pytest.mark.django_db


def test_the_cursor_is_ascii_digits(cluster):
    node = make_instance("ii1", scopes=[cluster.scope])
    report(node, "ii1", status_record("http://ii1.test/kvsp/"))
    session_id = str(uuid.uuid4())
    put(node, session_id, checkpoint(cluster, session_id))
    post(node, session_id, [{"epoch": 1, "index": i, "token": 40 + i} for i in range(4)])
    output = f"/kvsp/sessions/{session_id}/output"
    assert [t["index"] for t in body(node.get(output, {"after": "2"}))["tokens"]] == [3]
    for after in ("२", "+2", " 2", "2_0", "-2"):
        refused = node.get(output, {"after": after})
        assert refused.status_code == 400, after
        assert problem_name(refused) == "kvsp-malformed-request"
        assert body(refused)["detail"].startswith("after must be")
    stream = {"HTTP_ACCEPT": "text/event-stream"}
    refused = node.get(output, **stream, HTTP_LAST_EVENT_ID="२")
    assert refused.status_code == 400 and problem_name(refused) == "kvsp-malformed-request"
    assert body(refused)["detail"].startswith("Last-Event-ID must be")
