"""A constructed cluster for placement tests: a descriptor, a scope, a prompt and its blocks."""

from dataclasses import dataclass

import pytest

from index.scopekeys import open_scope_key
from index.services import do_register_descriptor
from kvsp.blockkeys import block_keys
from kvsp.compat import compat_id_hex
from tests.support.descriptors import descriptor
from tests.support.fixtures import make_caller, make_scope, replica_json

HOLDER = "http://holder.test/kvsp/"
BLOCK_TOKENS = 16

DESCRIPTOR = descriptor(block_tokens=BLOCK_TOKENS)


@dataclass
class Cluster:
    scope: object
    compat: str
    tokens: list[int]
    keys: list[str]
    router: object
    holder: object

    def publish(self, count: int, *, size: int = 1_000_000, holder: str = HOLDER, caller=None):
        caller = caller or self.holder
        for key in self.keys[:count]:
            record = replica_json(self.scope.scope_id_hex, self.compat, key, holder, size=size)
            path = f"/kvsp/replicas/{self.compat}/{self.scope.scope_id_hex}/{key}"
            assert caller.put(path, record).status_code in (200, 201)

    def place(self, tokens=None, request_ref="req-1"):
        return self.router.post(
            "/kvsp/placements",
            {
                "scope_id": self.scope.scope_id_hex,
                "compat_id": self.compat,
                "tokens": tokens or self.tokens,
                "request_ref": request_ref,
            },
        )


@pytest.fixture
def cluster():
    scope = make_scope("tenant-a")
    compat = compat_id_hex(DESCRIPTOR)
    do_register_descriptor(DESCRIPTOR, compat)
    tokens = list(range(100, 100 + 4 * BLOCK_TOKENS + 5))  # 4 blocks and a tail of 5
    key = open_scope_key(scope.scope_id, scope.key_ciphertext)
    keys = [k.hex() for k in block_keys(key, bytes.fromhex(compat), tokens, BLOCK_TOKENS)]
    router = make_caller("router", scopes=[scope])
    holder = make_caller("holder", scopes=[scope], holders=[HOLDER])
    return Cluster(scope, compat, tokens, keys, router, holder)
