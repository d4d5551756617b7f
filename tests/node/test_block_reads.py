"""A block GET reads its row and marks the block used (the LRU order of eviction) before it
answers, in one statement on Postgres: the row as it was, the touch at most once per
KVSP_ACCESS_RESOLUTION_MS, none for a scope the reader may not read, and the connection left as
it was found; on the holder's own path for loaders, with no other statement but the token's."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from index.authentication import AuthenticatedPrincipal
from tests.node.support import block_row, container
from tests.support.fixtures import make_caller, make_scope
from tests.support.statements import (
    KEPT_CONNECTION_CHECK,
    PRINCIPAL_OF_TOKEN,
    statements_sent,
)
from workers import selectors, tiers
from workers.blockpath import LeanBlockRequests
from workers.models import StoredBlock

NODE = "reads-node"
IDS = (b"\x01" * 32, b"\x02" * 16, b"\x03" * 32)


def principal(*scopes: bytes) -> AuthenticatedPrincipal:
    return AuthenticatedPrincipal(
        id=1, name="r", holder_urls=(), instance="", controller=False, scope_ids=frozenset(scopes)
    )


def stored(last_access) -> StoredBlock:
    row = block_row(NODE, IDS, last_access)
    row.save()
    return row


def last_access(row: StoredBlock):
    return StoredBlock.objects.get(pk=row.pk).last_access


@pytest.fixture(autouse=True)
def on_the_node(settings):
    settings.KVSP_INSTANCE = NODE


# Outside a transaction, as a GET runs: the path of one statement for the read and the touch.
@pytest.mark.django_db(transaction=True)
def test_a_read_touches_the_block_once_a_second_and_answers_the_row_as_it_was():
    an_hour_ago = timezone.now() - timedelta(hours=1)
    row = stored(an_hour_ago)
    reader = principal(IDS[1])

    block = selectors.read_block(reader, *IDS)
    assert block.pk == row.pk and block.last_access == an_hour_ago
    touched = last_access(row)
    assert timezone.now() - touched < timedelta(seconds=5)
    # Within the resolution of a second the row is not written again.
    assert selectors.read_block(reader, *IDS).last_access == touched
    assert last_access(row) == touched
    # The touch's commit did not wait for the WAL; the connection's own writes still do.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == ("on",)

    # A reader of another scope gets a miss, and the block is not marked used.
    StoredBlock.objects.filter(pk=row.pk).update(last_access=an_hour_ago)
    assert selectors.read_block(principal(b"\x09" * 16), *IDS) is None
    assert last_access(row) == an_hour_ago
    # Nor by a miss of another key.
    assert selectors.read_block(reader, IDS[0], IDS[1], b"\x04" * 32) is None
    assert last_access(row) == an_hour_ago


@pytest.mark.django_db(transaction=True)
def test_a_read_on_a_connection_that_died_since_the_last_request_is_answered():
    """A GET skips Django's health check of the connection kept from the last request, and
    runs its statement again on a new connection when the kept one has died."""
    row = stored(timezone.now() - timedelta(hours=1))
    reader = principal(IDS[1])
    assert selectors.read_block(reader, *IDS).pk == row.pk
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    # What a new request does first (django.db.close_old_connections), then the database
    # ends the kept connection, as a restart would.
    connection.close_if_unusable_or_obsolete()
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert selectors.read_block(reader, *IDS).pk == row.pk
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone() != (pid,)


@pytest.mark.django_db(transaction=True)
def test_a_read_touches_a_block_last_used_longer_ago_than_the_configured_resolution(settings):
    half_an_hour_ago = timezone.now() - timedelta(minutes=30)
    row = stored(half_an_hour_ago)
    reader = principal(IDS[1])

    settings.KVSP_ACCESS_RESOLUTION_MS = 60 * 60 * 1000
    assert selectors.read_block(reader, *IDS).pk == row.pk
    assert set(selectors.read_blocks(reader, IDS[0], IDS[1], [IDS[2]])) == {IDS[2]}
    selectors.touch(StoredBlock.objects.get(pk=row.pk))
    assert last_access(row) == half_an_hour_ago

    settings.KVSP_ACCESS_RESOLUTION_MS = 10 * 60 * 1000
    assert selectors.read_block(reader, *IDS).last_access == half_an_hour_ago
    touched = last_access(row)
    assert touched > half_an_hour_ago

    # A resolution of nothing: every read marks the block used again.
    settings.KVSP_ACCESS_RESOLUTION_MS = 0
    selectors.read_blocks(reader, IDS[0], IDS[1], [IDS[2]])
    assert last_access(row) > touched


@pytest.mark.django_db(transaction=True)
def test_a_block_get_at_the_holder_sends_its_token_once_then_one_statement(settings, tmp_path):
    """The loader's GET (``workers.blockpath``), thousands per directive: for a token not seen
    yet, the check of the kept connection and the token's principal, then the statement that
    reads and touches the row; a token the process remembers (KVSP_AUTH_CACHE_S) costs
    nothing more, nor the check, which that statement makes itself."""
    scope = make_scope("tenant-r")
    token = make_caller("reader", scopes=[scope]).token
    ids = (IDS[0], bytes(scope.scope_id), IDS[2])
    settings.KVSP_SHM_DIR = tmp_path
    settings.KVSP_AUTH_CACHE_S = 3600.0
    data = container(1)
    tiers.ensure_dirs(NODE)
    tiers.block_path(tiers.HOST, NODE, ids).write_bytes(data)
    block_row(NODE, ids, timezone.now() - timedelta(hours=1), size=len(data)).save()
    request = {
        "type": "http",
        "method": "GET",
        "scheme": "http",
        "path": "/kvsp/blocks/" + "/".join(part.hex() for part in ids),
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode())],
        "client": ("127.0.0.1", 40000),
    }
    lean = LeanBlockRequests()
    assert lean.route(request) == ids

    with statements_sent() as first:
        answer = lean.answer(request, ids)
    assert (answer.status, answer.body) == (200, data)
    with statements_sent() as again:
        assert lean.answer(request, ids).body == data
    assert first == [
        KEPT_CONNECTION_CHECK,
        PRINCIPAL_OF_TOKEN,
        "WITH UPDATE, SELECT workers_storedblock",
    ]
    assert again == ["WITH UPDATE, SELECT workers_storedblock"]
