import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [
        ("index", "0001_initial"),
        ("index", "0002_lookupbucket"),
    ]

    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="CompatDescriptor",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("compat_id", models.BinaryField(max_length=32, unique=True)),
                ("descriptor", models.JSONField()),
                ("model", models.CharField(max_length=400)),
                ("block_tokens", models.PositiveIntegerField()),
                ("layers", models.PositiveIntegerField()),
                ("kv_heads", models.PositiveIntegerField()),
                ("head_dim", models.PositiveIntegerField()),
                ("kv_dtype", models.CharField(max_length=40)),
                ("registered_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={
                "verbose_name": "compatibility descriptor",
            },
        ),
        migrations.CreateModel(
            name="Holder",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("url", models.CharField(max_length=2000, unique=True)),
            ],
        ),
        migrations.CreateModel(
            name="LookupBucket",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("minute", models.DateTimeField(unique=True)),
                ("lookups", models.PositiveBigIntegerField(default=0)),
                ("hits", models.PositiveBigIntegerField(default=0)),
                ("block_keys", models.PositiveBigIntegerField(default=0)),
                ("matched_blocks", models.PositiveBigIntegerField(default=0)),
            ],
            options={
                "ordering": ["-minute"],
            },
        ),
        migrations.CreateModel(
            name="Scope",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("scope_id", models.BinaryField(max_length=16, unique=True)),
                ("name", models.CharField(max_length=200, unique=True)),
                ("key_ciphertext", models.BinaryField()),
                (
                    "shared_prefix",
                    models.BooleanField(
                        default=False,
                        help_text="A dedicated scope for a public prefix shared across tenants (spec 4.2).",
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={
                "ordering": ["name"],
            },
        ),
        migrations.CreateModel(
            name="Principal",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200, unique=True)),
                ("token_hash", models.BinaryField(max_length=32, unique=True)),
                (
                    "holder_urls",
                    models.JSONField(
                        blank=True,
                        default=list,
                        help_text="Holder base URLs this principal may publish for.",
                    ),
                ),
                (
                    "instance",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="The instance this principal speaks for.",
                        max_length=200,
                    ),
                ),
                (
                    "controller",
                    models.BooleanField(
                        default=False,
                        help_text="The Placement Controller: may act on every instance.",
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                (
                    "scopes",
                    models.ManyToManyField(blank=True, related_name="principals", to="index.scope"),
                ),
            ],
            options={
                "ordering": ["name"],
            },
        ),
        migrations.CreateModel(
            name="Replica",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("compat_id", models.BinaryField(max_length=32)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("block_key", models.BinaryField(max_length=32)),
                ("codec", models.PositiveIntegerField()),
                ("size", models.PositiveBigIntegerField()),
                ("digest", models.BinaryField(max_length=32)),
                ("layer_digests", models.BinaryField(blank=True, default=b"")),
                ("residency", models.TextField(default="[]")),
                ("tier_mask", models.PositiveSmallIntegerField(default=0)),
                ("moqt_namespace", models.CharField(blank=True, default="", max_length=400)),
                ("ttl_ms", models.PositiveBigIntegerField()),
                ("expires_at", models.DateTimeField(db_index=True)),
                ("published_at", models.DateTimeField()),
                ("refreshed_at", models.DateTimeField()),
                ("refresh_count", models.PositiveIntegerField(default=0)),
                (
                    "holder",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="replicas",
                        to="index.holder",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("block_key", "scope_id", "compat_id", "holder"),
                        name="replica_identity",
                    )
                ],
            },
        ),
    ]
