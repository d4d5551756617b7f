from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0001_squashed_0006_timings"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="servedsession",
            index=models.Index(fields=["session", "epoch"], name="workers_ser_session_e50dbd_idx"),
        ),
    ]
