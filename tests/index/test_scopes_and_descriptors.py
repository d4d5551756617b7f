"""Scope keys for principals of the scope (4.2) and descriptors under computed ids (4.1)."""

import pytest

from index.models import Scope
from index.scopekeys import open_scope_key
from kvsp.blockkeys import scope_id
from kvsp.compat import compat_id_hex
from tests.support.descriptors import descriptor
from tests.support.fixtures import body, make_caller, make_scope, problem_name

pytestmark = pytest.mark.django_db

DESCRIPTOR = descriptor()


def test_scope_key_is_served_to_principals_of_the_scope_only():
    scope = make_scope("tenant-a")
    member = make_caller("member", scopes=[scope])
    outsider = make_caller("outsider", scopes=[make_scope("tenant-b")])
    response = member.get(f"/kvsp/scopes/{scope.scope_id_hex}/key")
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    key = bytes.fromhex(body(response)["scope_key"])
    assert len(key) == 32
    assert scope_id(key).hex() == scope.scope_id_hex
    hidden = outsider.get(f"/kvsp/scopes/{scope.scope_id_hex}/key")
    absent = outsider.get(f"/kvsp/scopes/{'ab' * 16}/key")
    assert hidden.status_code == absent.status_code == 404
    assert body(hidden) == body(absent)


def test_scope_keys_are_encrypted_at_rest_and_bound_to_their_scope():
    a, b = make_scope("tenant-a"), make_scope("tenant-b")
    key_a = open_scope_key(a.scope_id, a.key_ciphertext)
    assert key_a not in bytes(a.key_ciphertext)
    from cryptography.exceptions import InvalidTag

    with pytest.raises(InvalidTag):
        open_scope_key(b.scope_id, a.key_ciphertext)


def test_descriptor_registered_under_its_computed_id():
    caller = make_caller("engine")
    compat = compat_id_hex(DESCRIPTOR)
    assert caller.put(f"/kvsp/compat/{compat}", DESCRIPTOR).status_code == 201
    assert caller.put(f"/kvsp/compat/{compat}", DESCRIPTOR).status_code == 200
    assert body(caller.get(f"/kvsp/compat/{compat}")) == DESCRIPTOR


def test_descriptor_under_a_wrong_id_is_refused():
    caller = make_caller("engine")
    response = caller.put(f"/kvsp/compat/{'ab' * 32}", DESCRIPTOR)
    assert response.status_code == 422
    assert problem_name(response) == "kvsp-compat-mismatch"
    assert caller.get(f"/kvsp/compat/{'ab' * 32}").status_code == 404


@pytest.mark.parametrize(
    "change",
    [{"adapters": []}, {"kv_dtype": "int3"}, {"positional": "rope;theta=abc"}, {"layers": "4"}],
)
def test_invalid_descriptors_are_refused(change):
    caller = make_caller("engine")
    descriptor = {**DESCRIPTOR, **change}
    response = caller.put(f"/kvsp/compat/{'ab' * 32}", descriptor)
    assert response.status_code in (400, 422)
    assert response["Content-Type"] == "application/problem+json"


def test_scope_ids_are_unique_per_key():
    from index.services import do_create_scope
    from kvsp.problems import ProtocolError

    do_create_scope("a", scope_key=b"k" * 32)
    with pytest.raises(ProtocolError):
        do_create_scope("b", scope_key=b"k" * 32)
    with pytest.raises(ProtocolError):
        do_create_scope("c", scope_key=b"short")
    assert Scope.objects.count() == 1
