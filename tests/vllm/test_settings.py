"""The connector's settings (``kv_connector_extra_config``): what is missing or wrong is named."""

from __future__ import annotations

import pytest

from kvsp_vllm.settings import ConnectorSettings

GOOD = {
    "control_url": "http://127.0.0.1:8000/kvsp/",
    "token": "secret",
    "scope_id": "ab" * 16,
    "holder_url": "http://127.0.0.1:8001/kvsp",
    "model": "example/llama",
}


def test_settings_are_read_and_unknown_members_ignored():
    settings = ConnectorSettings.from_extra_config({**GOOD, "shared_storage_path": "/tmp"})
    assert settings.control_url == GOOD["control_url"]
    assert settings.holder_url == "http://127.0.0.1:8001/kvsp/"  # a base URL ends with a slash
    assert settings.model == "example/llama" and settings.load_timeout_s == 10.0
    without_model = {key: value for key, value in GOOD.items() if key != "model"}
    assert ConnectorSettings.from_extra_config(without_model).model is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"token": None}, "token must be the bearer token"),
        ({"token": ""}, "token must be the bearer token"),
        ({"scope_id": "AB" * 16}, "scope_id must be the hex16 scope id"),
        ({"scope_id": "ab" * 8}, "scope_id must be the hex16 scope id"),
        ({"control_url": None}, "control_url must be an http(s) base URL, got None"),
        ({"holder_url": "ftp://x/"}, "holder_url must be an http(s) base URL"),
        ({"holder_url": "http://h.test/a|b/"}, "holder_url must be an http(s) base URL (must"),
        ({"control_url": "http://cp.test/?x=1"}, "control_url must be an http(s) base URL (must"),
        ({"model": ""}, "model must be a non-empty string"),
        ({"load_timeout_s": 0}, "load_timeout_s must be a positive number"),
        ({"load_timeout_s": True}, "load_timeout_s must be a positive number"),
    ],
)
def test_a_bad_setting_is_named(change, message):
    extra = {key: value for key, value in {**GOOD, **change}.items() if value is not None}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConnectorSettings.from_extra_config(extra)


def test_no_settings_at_all_is_explained():
    with pytest.raises(ValueError, match="token must be the bearer token"):
        ConnectorSettings.from_extra_config(None)
