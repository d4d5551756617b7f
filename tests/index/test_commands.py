"""The management commands of DESIGN.md section 6: JSON out, bad input in one line, exit 2."""

import json

import pytest

from index.authentication import principal_for_token
from index.models import Principal, Scope
from kvsp.blockkeys import scope_id
from placement.models import Instance
from tests.support.processes import run_manage

pytestmark = pytest.mark.django_db(transaction=True)


def manage(role_env, *args):
    return run_manage(*args, env=role_env())


def test_scope_principal_instance(role_env):
    key = "ab" * 32
    created = manage(role_env, "kvsp_scope", "create", "tenant-a", "--key-hex", key)
    assert created.returncode == 0, created.stderr
    scope = json.loads(created.stdout)
    assert scope == {"scope_id": scope_id(bytes.fromhex(key)).hex(), "name": "tenant-a"}

    added = manage(
        role_env,
        "kvsp_instance",
        "add",
        "ii1",
        "--url",
        "http://ii1.test/kvsp/",
        "--compat",
        "cd" * 32,
    )
    assert json.loads(added.stdout) == {"name": "ii1", "url": "http://ii1.test/kvsp/"}
    assert Instance.objects.get(name="ii1").compat_ids == ["cd" * 32]

    issued = manage(
        role_env,
        "kvsp_principal",
        "create",
        "node-ii1",
        "--scope",
        scope["scope_id"],
        "--instance",
        "ii1",
        "--holder",
        "http://ii1.test/kvsp/",
    )
    assert issued.returncode == 0, issued.stderr
    answer = json.loads(issued.stdout)
    assert answer["name"] == "node-ii1" and answer["token"].startswith("kvsp_")
    principal = principal_for_token(answer["token"])
    assert principal.instance == "ii1"
    assert principal.scope_ids == {bytes.fromhex(scope["scope_id"])}
    assert answer["token"].encode() not in bytes(Principal.objects.get().token_hash)

    revoked = manage(role_env, "kvsp_principal", "revoke", "node-ii1")
    assert revoked.returncode == 0
    assert principal_for_token(answer["token"]) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["kvsp_scope"],
        ["kvsp_scope", "create"],
        ["kvsp_scope", "create", "x", "--key-hex", "zz"],
        ["kvsp_scope", "create", "x", "--key-hex", "abcd"],
        ["kvsp_scope", "frobnicate"],
        ["kvsp_principal", "create", "p", "--scope", "nothex"],
        ["kvsp_principal", "create", "p", "--scope", "ab" * 16],
        ["kvsp_principal", "create", "p", "--holder", "ftp://x"],
        ["kvsp_principal", "create", "p", "--holder", 'http://evil.test/"><svg/onload=x>/'],
        ["kvsp_principal", "revoke", "nobody"],
        ["kvsp_instance", "add", "ii1"],
        ["kvsp_instance", "add", "ii1", "--url", "http://no-slash"],
        ["kvsp_instance", "add", "ii1", "--url", "http://ii1.test/a<b>/"],
        ["kvsp_instance", "add", "II 1", "--url", "http://ii1/kvsp/"],
        ["kvsp_instance", "add", "ii1", "--url", "http://ii1/kvsp/", "--compat", "x"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(role_env, argv):
    result = manage(role_env, *argv)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert Scope.objects.count() == 0 and Principal.objects.count() == 0


def test_duplicates_are_refused_and_keep_the_original(role_env):
    assert manage(role_env, "kvsp_scope", "create", "tenant-a").returncode == 0
    original = Scope.objects.get()
    again = manage(role_env, "kvsp_scope", "create", "tenant-a")
    assert again.returncode == 2
    assert Scope.objects.get().scope_id == original.scope_id
