"""Each app's migrations squashed into one: a database migrated before the squash carries on, and
one caught half-way through the replaced migrations is refused in one line."""

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.recorder import MigrationRecorder

pytestmark = pytest.mark.django_db


def squashed() -> dict[str, list[tuple[str, str]]]:
    """Each app's squashed migration: what it replaces."""
    loader = MigrationExecutor(connection).loader
    return {app: m.replaces for (app, _), m in loader.disk_migrations.items() if m.replaces}


def recorded() -> set[tuple[str, str]]:
    return set(MigrationRecorder(connection).applied_migrations())


def test_a_database_with_every_replaced_migration_applied_has_nothing_left_to_apply():
    # Applying a squashed migration records the names it replaces, just as a database that ran
    # them one by one before the squash holds them.
    assert sorted(squashed()) == ["index", "kvsp_sessions", "placement", "workers"]
    for replaces in squashed().values():
        assert set(replaces) <= recorded()
    executor = MigrationExecutor(connection)
    assert executor.migration_plan(executor.loader.graph.leaf_nodes()) == []


def test_a_database_half_way_through_the_replaced_migrations_is_refused_and_left_as_it_was():
    later = squashed()["placement"][5:]
    MigrationRecorder.Migration.objects.filter(
        app="placement", name__in=[name for _, name in later]
    ).delete()
    before = recorded()

    with pytest.raises(CommandError) as refused:
        call_command("migrate", verbosity=0)

    assert refused.value.returncode == 2
    assert str(refused.value) == (
        "placement has 5 of the 11 migrations that 0001_squashed_0011_directive_packed_blocks "
        "replaces; migrate it to 0011_directive_packed_blocks with release bb5e57c first"
    )
    assert recorded() == before
