"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

Plain Python (no vLLM import), so that bad settings are explained the same way everywhere.
Unknown members are ignored (DESIGN.md section 9).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvsp.records import base_url_rule_broken

_SCOPE_ID = re.compile(r"[0-9a-f]{32}")
DEFAULT_LOAD_TIMEOUT_S = 10.0


def _base_url(extra: Mapping, name: str) -> str:
    value = extra.get(name)
    if not isinstance(value, str) or not re.match(r"https?://[^/]", value):
        raise ValueError(
            f"kv_connector_extra_config.{name} must be an http(s) base URL, got {value!r}"
        )
    value = value if value.endswith("/") else value + "/"
    broken = base_url_rule_broken(value)
    if broken is not None:
        raise ValueError(
            f"kv_connector_extra_config.{name} must be an http(s) base URL ({broken}), "
            f"got {value!r}"
        )
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    control_url: str
    token: str
    scope_id: str
    holder_url: str
    model: str | None
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    @classmethod
    def from_extra_config(cls, extra: Mapping | None) -> ConnectorSettings:
        """The settings, or ValueError naming the first member that is missing or wrong."""
        extra = extra or {}
        token = extra.get("token")
        if not isinstance(token, str) or not token:
            raise ValueError("kv_connector_extra_config.token must be the bearer token")
        scope_id = extra.get("scope_id")
        if not isinstance(scope_id, str) or _SCOPE_ID.fullmatch(scope_id) is None:
            raise ValueError(
                "kv_connector_extra_config.scope_id must be the hex16 scope id "
                f"(32 lowercase hex digits), got {scope_id!r}"
            )
        model = extra.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("kv_connector_extra_config.model must be a non-empty string")
        timeout = extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError("kv_connector_extra_config.load_timeout_s must be a positive number")
        return cls(
            control_url=_base_url(extra, "control_url"),
            token=token,
            scope_id=scope_id,
            holder_url=_base_url(extra, "holder_url"),
            model=model,
            load_timeout_s=float(timeout),
        )
