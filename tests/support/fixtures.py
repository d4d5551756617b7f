"""Builders for protocol objects and principals used across the tests."""

from __future__ import annotations

import os
from dataclasses import dataclass

import orjson
from django.test import Client

from index import services
from index.models import Scope
from tests.support.replicas import HOLDER_A, HOLDER_B, replica_json  # noqa: F401


def random_key() -> str:
    return os.urandom(32).hex()


@dataclass
class Caller:
    """A principal's view of the API through Django's test client."""

    name: str
    token: str
    client: Client

    def _headers(self, headers: dict | None) -> dict:
        merged = {"HTTP_AUTHORIZATION": f"Bearer {self.token}"} if self.token else {}
        merged.update(headers or {})
        return merged

    def put(self, path: str, body, **headers):
        return self.client.put(
            path, orjson.dumps(body), content_type="application/json", **self._headers(headers)
        )

    def post(self, path: str, body, **headers):
        return self.client.post(
            path, orjson.dumps(body), content_type="application/json", **self._headers(headers)
        )

    def get(self, path: str, data=None, **headers):
        return self.client.get(path, data, **self._headers(headers))

    def delete(self, path: str, **headers):
        return self.client.delete(path, **self._headers(headers))


def make_scope(name: str) -> Scope:
    return services.do_create_scope(name)


def make_caller(name: str, *, scopes=(), holders=(), instance="", controller=False) -> Caller:
    issued = services.do_create_principal(
        name,
        scope_ids=[bytes(scope.scope_id) for scope in scopes],
        holder_urls=list(holders),
        instance=instance,
        controller=controller,
    )
    return Caller(name, issued.token, Client(raise_request_exception=False))


def anonymous() -> Caller:
    return Caller("anonymous", "", Client(raise_request_exception=False))


def body(response) -> dict:
    return orjson.loads(response.content)


def problem_name(response) -> str:
    assert response["Content-Type"] == "application/problem+json", response.content
    return body(response)["type"].rsplit("/", 1)[-1]


def status_record(url: str, epoch: int = 1, **figures) -> dict:
    """A valid Instance Status Record (spec 4.4) for an instance at ``url``."""
    record = {
        "instance": url,
        "epoch": epoch,
        "state": "active",
        "running": 0,
        "queued": 0,
        "batch_size": 32,
        "kv_utilization": 0.1,
        "prefill_tokens_per_s": 10_000,
        "decode_tokens_per_s": 1_000,
        "links": [],
        "requested_state": None,
        "ttl_ms": 3_000,
    }
    record.update(figures)
    return record


def make_instance(name: str, url: str | None = None, *, scopes=(), compat_ids=()) -> Caller:
    """Register an instance and return the caller that speaks for it (and holds for its URL)."""
    from placement.services import do_register_instance

    instance = do_register_instance(name, url or f"http://{name}.test/kvsp/", compat_ids=compat_ids)
    return make_caller(f"node-{name}", scopes=scopes, instance=name, holders=[instance.url])


def report(caller: Caller, name: str, record: dict):
    return caller.put(f"/kvsp/instances/{name}/status", record)
