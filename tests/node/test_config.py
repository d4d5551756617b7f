"""The node's configuration: bad values stop start-up with one line naming the variable, and
the links it reports are the measured ones where it has them and the configured ones elsewhere."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings
from django.utils import timezone

from kvsp.records import Link
from tests.foundation.test_settings import NODE_SETTINGS, manage_check
from tests.support.processes import Server
from workers import selectors
from workers.models import MeasuredLink

A, B = "http://a.test/kvsp/", "http://b.test/kvsp/"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"KVSP_LINKS": "{not json"}, "KVSP_LINKS"),
        ({"KVSP_LINKS": json.dumps([{"holder": A, "mbit_per_s": 0, "rtt_us": 5}])}, "KVSP_LINKS"),
        ({"KVSP_PUBLIC_URL": "http://ii1:8001/kvsp"}, "KVSP_PUBLIC_URL"),
        ({"KVSP_DECODE_TOKENS_PER_S": "0"}, "KVSP_DECODE_TOKENS_PER_S"),
        ({"KVSP_TIER_HOST_READ_MBIT_PER_S": "fast"}, "KVSP_TIER_HOST_READ_MBIT_PER_S"),
        ({"KVSP_SCOPE_QUOTA_OCTETS": "-1"}, "KVSP_SCOPE_QUOTA_OCTETS"),
    ],
)
def test_bad_node_settings_stop_start_up_in_one_line(tmp_path, values, named):
    result = manage_check(tmp_path, **{**NODE_SETTINGS, **values})
    assert_stopped_in_one_line(result, named)


def assert_stopped_in_one_line(result, named: str) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr


REQUIRED = ("KVSP_INSTANCE", "KVSP_PUBLIC_URL", "KVSP_CONTROL_URL", "KVSP_TOKEN")


@pytest.mark.parametrize("missing", REQUIRED)
def test_a_node_without_its_name_urls_or_token_stops_at_start_up(tmp_path, missing):
    assert manage_check(tmp_path, **NODE_SETTINGS).returncode == 0
    without = {name: value for name, value in NODE_SETTINGS.items() if name != missing}
    assert_stopped_in_one_line(manage_check(tmp_path, **without), missing)
    # Set but empty is missing too.
    assert_stopped_in_one_line(manage_check(tmp_path, **{**NODE_SETTINGS, missing: ""}), missing)


def test_a_node_server_without_its_public_url_never_serves(role_env, tmp_path):
    """The HTTP process stops before it serves a request, instead of refusing every PUT."""
    env = role_env(**{**NODE_SETTINGS, "KVSP_PUBLIC_URL": ""})
    server = Server("node-without-url", env, tmp_path, workers=1)
    with pytest.raises(RuntimeError, match="exited"):
        server.start()
    server.stop()
    assert "KVSP_PUBLIC_URL must be set" in server.log()


@pytest.mark.django_db
def test_measured_links_replace_configured_ones():
    configured = (Link(A, 1000, 50), Link(B, 2000, 60))
    MeasuredLink.objects.create(
        instance="ii1", holder=B, mbit_per_s=4321.0, rtt_us=7.0, measured_at=timezone.now()
    )
    with override_settings(KVSP_LINKS=configured):
        assert selectors.links("ii1") == (Link(A, 1000, 50), Link(B, 4321.0, 7.0))
        assert selectors.links("ii2") == configured
