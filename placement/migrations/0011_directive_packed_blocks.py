"""A directive's blocks packed (``Directive.blocks``): its Block Keys as one ``bytea``, each
distinct list of sources once, and per block the position of its list, instead of a ``jsonb`` of
thousands of objects that Postgres parsed on every placement that prefetches. Existing rows are
converted both ways."""

from django.db import migrations, models

import placement.models

_INDEX_OCTETS = 4  # Directive.block_sources: uint32, little-endian, per block


def pack_blocks(apps, schema_editor):
    Directive = apps.get_model("placement", "Directive")
    for directive in Directive.objects.only("pk", "blocks").iterator(chunk_size=100):
        lists: dict[tuple, int] = {}
        source_of = [lists.setdefault(tuple(b["sources"]), len(lists)) for b in directive.blocks]
        Directive.objects.filter(pk=directive.pk).update(
            block_keys=b"".join(bytes.fromhex(b["block_key"]) for b in directive.blocks),
            sources=[list(sources) for sources in lists],
            block_sources=b"".join(i.to_bytes(_INDEX_OCTETS, "little") for i in source_of),
        )


def unpack_blocks(apps, schema_editor):
    Directive = apps.get_model("placement", "Directive")
    fields = ("pk", "block_keys", "sources", "block_sources")
    for directive in Directive.objects.only(*fields).iterator(chunk_size=100):
        keys, indexes = bytes(directive.block_keys), bytes(directive.block_sources)
        blocks = [
            {
                "block_key": keys[32 * b : 32 * b + 32].hex(),
                "sources": directive.sources[
                    int.from_bytes(indexes[_INDEX_OCTETS * b : _INDEX_OCTETS * (b + 1)], "little")
                ],
            }
            for b in range(len(keys) // 32)
        ]
        Directive.objects.filter(pk=directive.pk).update(blocks=blocks)


class Migration(migrations.Migration):
    dependencies = [("placement", "0010_directive_blocks_lz4")]

    operations = [
        migrations.AddField(
            model_name="directive",
            name="block_keys",
            field=models.BinaryField(default=b""),
        ),
        migrations.AddField(
            model_name="directive",
            name="sources",
            field=models.JSONField(
                default=list, help_text="The distinct lists of sources by cost."
            ),
        ),
        migrations.AddField(
            model_name="directive",
            name="block_sources",
            field=models.BinaryField(default=b""),
        ),
        # With a default, so that unapplying the removal below adds the column to existing rows.
        migrations.AlterField(
            model_name="directive",
            name="blocks",
            field=models.JSONField(default=list, encoder=placement.models.CompactJSONEncoder),
        ),
        migrations.RunPython(pack_blocks, unpack_blocks),
        migrations.RemoveField(model_name="directive", name="blocks"),
    ]
