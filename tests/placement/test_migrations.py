"""Migrations of the Placement Controller's rows that convert data, both ways."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

JSON_BLOCKS = [("placement", "0010_directive_blocks_lz4")]
PACKED_BLOCKS = [("placement", "0011_directive_packed_blocks")]
A, B = "http://a.test/kvsp/", "http://b.test/kvsp/"


def migrate(targets):
    """Migrate to ``targets`` (every app's latest when None); the models as they were then."""
    executor = MigrationExecutor(connection)
    targets = targets or executor.loader.graph.leaf_nodes()
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state(targets).apps


def test_directives_recorded_with_json_blocks_are_packed_and_unpacked():
    blocks = [
        {"block_key": "ab" * 32, "sources": [A, B]},
        {"block_key": "cd" * 32, "sources": [B]},
        {"block_key": "ef" * 32, "sources": [A, B]},
    ]
    try:
        before = migrate(JSON_BLOCKS)
        instance = before.get_model("placement", "Instance").objects.create(
            name="n", url="http://n.test/kvsp/"
        )
        Directive = before.get_model("placement", "Directive")
        common = {"instance": instance, "scope_id": b"s" * 16, "compat_id": b"c" * 32}
        common |= {"deadline_ms": 1000, "lease_ms": 2000}
        full = Directive.objects.create(blocks=blocks, **common).pk
        empty = Directive.objects.create(blocks=[], **common).pk

        migrate(PACKED_BLOCKS)
        from placement.models import Directive as Packed

        row = Packed.objects.get(pk=full)
        assert bytes(row.block_keys) == bytes.fromhex("ab" * 32 + "cd" * 32 + "ef" * 32)
        assert row.sources == [[A, B], [B]]
        assert bytes(row.block_sources) == bytes([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
        assert row.blocks == blocks and row.block_count == 3
        assert row.body()["blocks"] == blocks
        assert Packed.objects.get(pk=empty).blocks == []

        after = migrate(JSON_BLOCKS)
        unpacked = after.get_model("placement", "Directive").objects
        assert unpacked.get(pk=full).blocks == blocks
        assert unpacked.get(pk=empty).blocks == []
    finally:
        migrate(None)
