import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [
        ("workers", "0001_initial"),
        ("workers", "0002_sessions"),
        ("workers", "0003_reshard_moves"),
        ("workers", "0004_wide_versions_and_epochs"),
        ("workers", "0005_reshard_attempts"),
        ("workers", "0006_timings"),
    ]

    initial = True

    dependencies = [
        ("index", "0001_squashed_0002_lookupbucket"),
    ]

    operations = [
        migrations.CreateModel(
            name="Node",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=100, unique=True)),
                ("epoch", models.BigIntegerField(default=0)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("active", "Active"),
                            ("draining", "Draining"),
                            ("sleeping", "Sleeping"),
                        ],
                        default="active",
                        max_length=16,
                    ),
                ),
                ("state_changed_at", models.DateTimeField(blank=True, null=True)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("last_report_at", models.DateTimeField(blank=True, null=True)),
                ("last_report_error", models.TextField(blank=True, default="")),
                ("engine", models.JSONField(blank=True, null=True)),
            ],
            options={
                "ordering": ["name"],
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
                ("instance", models.CharField(max_length=100)),
                ("directive", models.UUIDField()),
                ("request_ref", models.CharField(blank=True, default="", max_length=1024)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("body", models.JSONField()),
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
                ("received_at", models.DateTimeField()),
                ("deadline_at", models.DateTimeField()),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "ordering": ["-received_at"],
                "constraints": [
                    models.UniqueConstraint(fields=("instance", "directive"), name="node_directive")
                ],
            },
        ),
        migrations.CreateModel(
            name="MeasuredLink",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("instance", models.CharField(max_length=100)),
                ("holder", models.CharField(max_length=2048)),
                ("mbit_per_s", models.FloatField()),
                ("rtt_us", models.FloatField()),
                ("samples", models.PositiveIntegerField(default=0)),
                ("measured_at", models.DateTimeField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("instance", "holder"), name="measured_link")
                ],
            },
        ),
        migrations.CreateModel(
            name="PendingWithdrawal",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("instance", models.CharField(max_length=100)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("block_key", models.BinaryField(max_length=32)),
                ("reason", models.TextField(blank=True, default="")),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("created_at", models.DateTimeField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("instance", "compat_id", "scope_id", "block_key"),
                        name="pending_withdrawal",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="ReshardMove",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("instance", models.CharField(max_length=100)),
                ("map", models.CharField(max_length=128)),
                ("from_version", models.PositiveBigIntegerField(blank=True, null=True)),
                ("to_version", models.PositiveBigIntegerField()),
                ("attempt", models.PositiveBigIntegerField(blank=True, null=True)),
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
                ("plan", models.JSONField(blank=True, null=True)),
                ("compat_id", models.BinaryField(blank=True, max_length=32, null=True)),
                ("scope_id", models.BinaryField(blank=True, max_length=16, null=True)),
                ("fetch_keys", models.JSONField(blank=True, default=list)),
                ("release_keys", models.JSONField(blank=True, default=list)),
                ("owed_release", models.JSONField(blank=True, default=list)),
                ("deadline_at", models.DateTimeField(blank=True, null=True)),
                ("loaded_at", models.DateTimeField(blank=True, null=True)),
                ("load_error", models.TextField(blank=True, default="")),
                ("fetched_blocks", models.PositiveIntegerField(default=0)),
                ("fetched_octets", models.PositiveBigIntegerField(default=0)),
                ("released_blocks", models.PositiveIntegerField(default=0)),
                ("received_at", models.DateTimeField()),
                ("decided_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "ordering": ["-received_at"],
                "indexes": [
                    models.Index(
                        fields=["instance", "phase"], name="workers_res_instanc_ee57aa_idx"
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("phase", "aborted"), _negated=True),
                        fields=("instance", "map", "to_version"),
                        name="node_live_reshard_move",
                    ),
                    models.UniqueConstraint(
                        fields=("instance", "map", "to_version", "attempt"),
                        name="node_reshard_attempt",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="StoredBlock",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("instance", models.CharField(max_length=100)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("block_key", models.BinaryField(max_length=32)),
                ("codec", models.PositiveIntegerField()),
                ("size", models.PositiveBigIntegerField()),
                ("token_count", models.PositiveIntegerField()),
                ("layer_count", models.PositiveIntegerField()),
                ("digest", models.BinaryField(max_length=32)),
                ("layer_digests", models.BinaryField()),
                ("repr_sha256", models.BinaryField(max_length=32)),
                (
                    "tier",
                    models.CharField(choices=[("host", "Host"), ("disk", "Disk")], max_length=8),
                ),
                ("device_layers", models.PositiveIntegerField(default=0)),
                ("device_octets", models.PositiveBigIntegerField(default=0)),
                ("stored_at", models.DateTimeField()),
                ("last_access", models.DateTimeField()),
                ("record_expires_at", models.DateTimeField(blank=True, null=True)),
                ("refresh_due_at", models.DateTimeField(db_index=True)),
                (
                    "pending_move",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="pending_blocks",
                        to="workers.reshardmove",
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="Lease",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("lease", models.CharField(max_length=64, unique=True)),
                ("instance", models.CharField(max_length=100)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("block_keys", models.BinaryField()),
                ("octets", models.PositiveBigIntegerField()),
                ("ttl_ms", models.PositiveBigIntegerField()),
                ("expires_at", models.DateTimeField(db_index=True)),
                ("created_at", models.DateTimeField()),
                ("renewed_at", models.DateTimeField(blank=True, null=True)),
                (
                    "principal",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="node_leases",
                        to="index.principal",
                    ),
                ),
                (
                    "blocks",
                    models.ManyToManyField(
                        blank=True, related_name="leases", to="workers.storedblock"
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="ServedSession",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("instance", models.CharField(max_length=100)),
                ("session", models.UUIDField()),
                ("epoch", models.PositiveBigIntegerField()),
                (
                    "kind",
                    models.CharField(
                        choices=[("generate", "Generate"), ("resume", "Resume")], max_length=16
                    ),
                ),
                ("scope_id", models.BinaryField(max_length=16)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("request_ref", models.CharField(blank=True, default="", max_length=1024)),
                ("body", models.JSONField()),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("accepted", "Accepted"),
                            ("running", "Running"),
                            ("completed", "Completed"),
                            ("superseded", "Superseded"),
                            ("failed", "Failed"),
                        ],
                        default="accepted",
                        max_length=16,
                    ),
                ),
                ("reason", models.TextField(blank=True, default="")),
                ("node_epoch", models.BigIntegerField(default=0)),
                ("output_offset", models.PositiveIntegerField(default=0)),
                ("produced", models.PositiveIntegerField(default=0)),
                ("released", models.PositiveIntegerField(default=0)),
                ("checkpoint_offset", models.PositiveIntegerField(default=0)),
                ("checkpoints", models.PositiveIntegerField(default=0)),
                ("loaded_blocks", models.PositiveIntegerField(default=0)),
                ("recomputed_tokens", models.PositiveIntegerField(default=0)),
                ("published_blocks", models.PositiveIntegerField(default=0)),
                ("timings_us", models.JSONField(blank=True, default=dict)),
                ("received_at", models.DateTimeField()),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("first_token_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "directive",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="sessions",
                        to="workers.directive",
                    ),
                ),
            ],
            options={
                "ordering": ["-received_at"],
                "indexes": [
                    models.Index(
                        fields=["instance", "state"], name="workers_ser_instanc_ecee48_idx"
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("instance", "session", "epoch"), name="served_session_epoch"
                    )
                ],
            },
        ),
        migrations.AddIndex(
            model_name="storedblock",
            index=models.Index(
                fields=["instance", "tier", "last_access"], name="workers_sto_instanc_09718d_idx"
            ),
        ),
        migrations.AddConstraint(
            model_name="storedblock",
            constraint=models.UniqueConstraint(
                fields=("instance", "compat_id", "scope_id", "block_key"), name="stored_block"
            ),
        ),
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(
                fields=["instance", "principal", "expires_at"],
                name="workers_lea_instanc_d1f5d9_idx",
            ),
        ),
    ]
