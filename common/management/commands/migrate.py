"""Django's ``migrate``, refusing in one line a database caught half-way through a squash.

Each app's migrations up to the release of December 2026 are squashed into one that ``replaces``
them. A database that applied all of them (or none) migrates as before; one that applied only
some cannot be carried forward by the squashed migration, and Django would fail deep in its
state rendering with a traceback.
"""

from __future__ import annotations

from django.core.management.base import CommandError
from django.core.management.commands import migrate
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

# The last commit whose migrations are not squashed: a database part-way through the replaced
# migrations migrates with it first.
UNSQUASHED_RELEASE = "bb5e57c"


def half_applied_squashes(connection) -> list[str]:
    """One line for each squashed migration some but not all of whose replaced ones are applied."""
    applied = MigrationRecorder(connection).applied_migrations()
    loader = MigrationLoader(None, ignore_no_migrations=True)
    lines = []
    for (app, name), migration in sorted(loader.replacements.items()):
        done = [key for key in migration.replaces if key in applied]
        if 0 < len(done) < len(migration.replaces):
            last = migration.replaces[-1][1]
            lines.append(
                f"{app} has {len(done)} of the {len(migration.replaces)} migrations that {name} "
                f"replaces; migrate it to {last} with release {UNSQUASHED_RELEASE} first"
            )
    return lines


class Command(migrate.Command):
    def handle(self, *args, **options):
        problems = half_applied_squashes(connections[options["database"]])
        if problems:
            raise CommandError("; ".join(problems), returncode=2)
        return super().handle(*args, **options)
