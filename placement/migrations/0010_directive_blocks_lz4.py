from django.db import DatabaseError, migrations, transaction


def compress_with_lz4(apps, schema_editor):
    # A directive's blocks run to hundreds of kilobytes of hex and URLs: lz4 writes them several
    # times faster than Postgres' default pglz, on the path of every placement that prefetches.
    if schema_editor.connection.vendor != "postgresql":
        return
    try:
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute(
                "ALTER TABLE placement_directive ALTER COLUMN blocks SET COMPRESSION lz4"
            )
    except DatabaseError:
        pass  # a server built without lz4 keeps pglz


def compress_with_pglz(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "ALTER TABLE placement_directive ALTER COLUMN blocks SET COMPRESSION pglz"
        )


class Migration(migrations.Migration):
    dependencies = [("placement", "0009_directive_blocks_compact_encoder")]

    operations = [migrations.RunPython(compress_with_lz4, compress_with_pglz)]
