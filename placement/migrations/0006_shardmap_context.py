from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("placement", "0005_reported_compat_ids_nullable"),
    ]

    operations = [
        migrations.AddField(
            model_name="shardmap",
            name="context",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="reshardoperation",
            name="next_context",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
