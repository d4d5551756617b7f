"""A short soak (bench/soak.py runs it for minutes): simulated instances reporting, holders
publishing, lookups, and a node killed half way. No errors, nothing lost, the node failed."""

import pytest

from bench.soak import run

pytestmark = pytest.mark.slow


def test_soak_with_a_node_killed_half_way():
    result = run(seconds=24, instances=200)
    assert result["status_requests"] > 1000 and result["status_errors"] == 0
    for stream in (result["publishes"], result["lookups"]):
        assert len(stream.latencies) > 100, stream.name
        assert stream.errors == 0, stream.line()
    assert result["acknowledged"] > 0 and result["missing"] == 0
    assert result["killed_node_state"] == "failed"
    # Status TTL 1.5 s, failure check every 0.5 s: the PC notices within seconds.
    assert result["failed_after_s"] is not None and result["failed_after_s"] < 8
