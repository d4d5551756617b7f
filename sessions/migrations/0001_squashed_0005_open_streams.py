import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [
        ("kvsp_sessions", "0001_initial"),
        ("kvsp_sessions", "0002_wide_epochs"),
        ("kvsp_sessions", "0003_owed_resumes"),
        ("kvsp_sessions", "0004_timings"),
        ("kvsp_sessions", "0005_open_streams"),
    ]

    initial = True

    dependencies = [
        ("placement", "0001_squashed_0011_directive_packed_blocks"),
    ]

    operations = [
        migrations.CreateModel(
            name="OpenStream",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("principal", models.BigIntegerField()),
                ("session", models.UUIDField()),
                ("server", models.CharField(max_length=64)),
                ("opened_at", models.DateTimeField(auto_now_add=True)),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "indexes": [
                    models.Index(fields=["principal", "expires_at"], name="open_stream_principal"),
                    models.Index(fields=["server"], name="open_stream_server"),
                ],
            },
        ),
        migrations.CreateModel(
            name="Session",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("session", models.UUIDField(unique=True)),
                ("scope_id", models.BinaryField(max_length=16)),
                ("compat_id", models.BinaryField(max_length=32)),
                ("epoch", models.PositiveBigIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("running", "Running"),
                            ("resuming", "Resuming"),
                            ("completed", "Completed"),
                            ("failed", "Failed"),
                        ],
                        default="running",
                        max_length=16,
                    ),
                ),
                ("checkpoint", models.JSONField(blank=True, null=True)),
                ("checkpoint_epoch", models.PositiveBigIntegerField(default=0)),
                ("checkpoint_offset", models.PositiveIntegerField(default=0)),
                ("checkpoints", models.PositiveIntegerField(default=0)),
                ("delivered", models.PositiveIntegerField(default=0)),
                ("final_length", models.PositiveIntegerField(blank=True, null=True)),
                ("failovers", models.PositiveIntegerField(default=0)),
                ("failed_over_at", models.DateTimeField(blank=True, null=True)),
                ("resumed_first_token_at", models.DateTimeField(blank=True, null=True)),
                ("resume_blocks", models.JSONField(blank=True, default=list)),
                ("resume_resident", models.JSONField(blank=True, default=list)),
                ("resume_due_at", models.DateTimeField(blank=True, null=True)),
                ("resume_attempts", models.PositiveIntegerField(default=0)),
                ("resume_sent_at", models.DateTimeField(blank=True, null=True)),
                ("resume_error", models.TextField(blank=True, default="")),
                ("timings_us", models.JSONField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                ("completed_at", models.DateTimeField(blank=True, null=True)),
                (
                    "instance",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="sessions",
                        to="placement.instance",
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
            },
        ),
        migrations.CreateModel(
            name="OutputToken",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("index", models.PositiveIntegerField()),
                ("token", models.PositiveBigIntegerField()),
                ("epoch", models.PositiveBigIntegerField()),
                ("delivered_at", models.DateTimeField(auto_now_add=True)),
                (
                    "session",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="tokens",
                        to="kvsp_sessions.session",
                    ),
                ),
            ],
            options={
                "ordering": ["session", "index"],
                "constraints": [
                    models.UniqueConstraint(fields=("session", "index"), name="token_index_once")
                ],
            },
        ),
    ]
