import django.db.models.deletion
import uuid
from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [
        ("placement", "0001_initial"),
        ("placement", "0002_instance_last_sample_at"),
        ("placement", "0003_shardmap_reshardoperation"),
        ("placement", "0004_directive_polled_at"),
        ("placement", "0005_reported_compat_ids_nullable"),
        ("placement", "0006_shardmap_context"),
        ("placement", "0007_wide_versions_and_epochs"),
        ("placement", "0008_reshard_attempts"),
        ("placement", "0009_directive_blocks_compact_encoder"),
        ("placement", "0010_directive_blocks_lz4"),
        ("placement", "0011_directive_packed_blocks"),
    ]

    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Instance",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200, unique=True)),
                (
                    "url",
                    models.CharField(
                        help_text="Its ii-base and holder base.", max_length=2000, unique=True
                    ),
                ),
                (
                    "compat_ids",
                    models.JSONField(
                        blank=True,
                        default=list,
                        help_text="Compatibility IDs it serves; none listed: any.",
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("active", "Active"),
                            ("draining", "Draining"),
                            ("sleeping", "Sleeping"),
                            ("failed", "Failed"),
                        ],
                        default="failed",
                        max_length=16,
                    ),
                ),
                ("state_changed_at", models.DateTimeField(blank=True, null=True)),
                ("state_version", models.PositiveIntegerField(default=0)),
                ("pushed_state_version", models.PositiveIntegerField(default=0)),
                ("epoch", models.BigIntegerField(blank=True, null=True)),
                ("running", models.PositiveIntegerField(default=0)),
                ("queued", models.PositiveIntegerField(default=0)),
                ("batch_size", models.PositiveIntegerField(default=0)),
                ("kv_utilization", models.FloatField(default=0.0)),
                ("prefill_tokens_per_s", models.FloatField(blank=True, null=True)),
                ("decode_tokens_per_s", models.FloatField(blank=True, null=True)),
                ("reported_compat_ids", models.JSONField(blank=True, default=None, null=True)),
                ("requested_state", models.CharField(blank=True, default="", max_length=16)),
                ("last_status", models.JSONField(blank=True, null=True)),
                ("ttl_ms", models.PositiveIntegerField(blank=True, null=True)),
                ("last_report_at", models.DateTimeField(blank=True, null=True)),
                ("expires_at", models.DateTimeField(blank=True, db_index=True, null=True)),
                ("failed_at", models.DateTimeField(blank=True, null=True)),
                ("last_sample_at", models.DateTimeField(blank=True, null=True)),
                ("restarts", models.PositiveIntegerField(default=0)),
                ("registered_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={
                "ordering": ["name"],
            },
        ),
        migrations.CreateModel(
            name="ShardMap",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("map", models.CharField(max_length=128, unique=True)),
                ("version", models.PositiveBigIntegerField()),
                ("shards", models.JSONField()),
                ("context", models.JSONField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={
                "ordering": ["map"],
            },
        ),
        migrations.CreateModel(
            name="Directive",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("directive", models.UUIDField(default=uuid.uuid4, editable=False, unique=True)),
                ("request_ref", models.CharField(blank=True, default="", max_length=400)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("block_keys", models.BinaryField(default=b"")),
                (
                    "sources",
                    models.JSONField(
                        default=list, help_text="The distinct lists of sources by cost."
                    ),
                ),
                ("block_sources", models.BinaryField(default=b"")),
                ("deadline_ms", models.PositiveBigIntegerField()),
                ("lease_ms", models.PositiveIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "Pending"),
                            ("partial", "Partial"),
                            ("complete", "Complete"),
                            ("failed", "Failed"),
                        ],
                        default="pending",
                        max_length=16,
                    ),
                ),
                ("loaded", models.JSONField(blank=True, default=list)),
                ("reason", models.TextField(blank=True, default="")),
                ("status_url", models.CharField(blank=True, default="", max_length=2000)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                ("polled_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("send_error", models.TextField(blank=True, default="")),
                (
                    "instance",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="directives",
                        to="placement.instance",
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
            },
        ),
        migrations.CreateModel(
            name="ReshardOperation",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("from_version", models.PositiveBigIntegerField()),
                ("to_version", models.PositiveBigIntegerField()),
                ("attempt", models.PositiveIntegerField(default=1)),
                ("next_shards", models.JSONField()),
                ("next_context", models.JSONField(blank=True, null=True)),
                ("deadline_ms", models.PositiveBigIntegerField()),
                ("plans", models.JSONField()),
                (
                    "phase",
                    models.CharField(
                        choices=[
                            ("preparing", "Preparing"),
                            ("committed", "Committed"),
                            ("aborted", "Aborted"),
                        ],
                        default="preparing",
                        max_length=16,
                    ),
                ),
                ("acknowledged", models.JSONField(blank=True, default=list)),
                ("informed", models.JSONField(blank=True, default=list)),
                ("reason", models.TextField(blank=True, default="")),
                ("started_at", models.DateTimeField()),
                ("deadline_at", models.DateTimeField()),
                ("decided_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "shard_map",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="operations",
                        to="placement.shardmap",
                    ),
                ),
            ],
            options={
                "ordering": ["-started_at"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("shard_map", "to_version", "attempt"), name="one_row_per_attempt"
                    ),
                    models.UniqueConstraint(
                        condition=models.Q(("phase", "aborted"), _negated=True),
                        fields=("shard_map", "to_version"),
                        name="one_live_move_per_version",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="StatusSample",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("at", models.DateTimeField(db_index=True)),
                ("epoch", models.BigIntegerField()),
                ("state", models.CharField(max_length=16)),
                ("running", models.PositiveIntegerField()),
                ("queued", models.PositiveIntegerField()),
                ("kv_utilization", models.FloatField()),
                ("prefill_tokens_per_s", models.FloatField()),
                ("decode_tokens_per_s", models.FloatField()),
                (
                    "instance",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="samples",
                        to="placement.instance",
                    ),
                ),
            ],
            options={
                "ordering": ["-at"],
                "indexes": [
                    models.Index(fields=["instance", "-at"], name="placement_s_instanc_ac1c1a_idx")
                ],
            },
        ),
    ]
